"""Where the runtime finds generated/manifest.json and the built libraries (the only contract with codegen)."""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]  # runtime/cuda/manifest.py -> repository root
MANIFEST_PATH = REPO_ROOT / "generated" / "manifest.json"
INDEX = "index.json"


def lib_dir() -> Path:
    """Built libraries: $FP4GEN_LIB_DIR, else build/lib of this checkout (where build.py publishes)."""
    return Path(os.environ.get("FP4GEN_LIB_DIR") or REPO_ROOT / "build" / "lib")


@functools.lru_cache(maxsize=None)
def load_manifest(path: Path = MANIFEST_PATH) -> dict:
    from ..errors import BuildError

    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise BuildError(f"cannot read the kernel manifest {path} ({exc}); run `python build.py` in "
                         f"{REPO_ROOT}") from None
