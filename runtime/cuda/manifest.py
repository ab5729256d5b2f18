"""Where the runtime finds the kernel manifest and the built libraries (its only contract with codegen).

Two install styles, one rule each:
- from a source checkout (`pip install -e .`, or the checkout on sys.path), the manifest is the checkout's
  generated/manifest.json;
- from a regular install (`pip install .`), it is the copy packaged with fp4gen (fp4gen/generated/).
Either way the libraries are where `python build.py` publishes them: $FP4GEN_LIB_DIR, else lib/ under the
build cache ($FP4GEN_CACHE_DIR, default ~/.cache/fp4gen). Both are outside the package, so a regular install
finds libraries built from its checkout.
"""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # fp4gen/ (runtime/ in a checkout)
# a checkout holds build.py and the specs beside the package; site-packages does not
CHECKOUT = PACKAGE_DIR.parent if ((PACKAGE_DIR.parent / "build.py").is_file()
                                  and (PACKAGE_DIR.parent / "codegen" / "specs").is_dir()) else None
MANIFEST_PATH = (CHECKOUT or PACKAGE_DIR) / "generated" / "manifest.json"
INDEX = "index.json"


def cache_root() -> Path:
    """The build cache: $FP4GEN_CACHE_DIR, else ~/.cache/fp4gen (the runtime keeps its launcher and GEMM
    measurements there too)."""
    return Path(os.environ.get("FP4GEN_CACHE_DIR") or Path.home() / ".cache" / "fp4gen").expanduser()


def lib_dir() -> Path:
    """Built libraries: $FP4GEN_LIB_DIR, else lib/ in the build cache (where build.py publishes)."""
    if os.environ.get("FP4GEN_LIB_DIR"):
        return Path(os.environ["FP4GEN_LIB_DIR"]).expanduser()
    return cache_root() / "lib"


def build_command(arch: str | None = None) -> str:
    """The command that builds the kernels, phrased for this install style."""
    command = "python build.py" + (f" --arch {arch}" if arch else "")
    if CHECKOUT is not None:
        return f"`{command}` in {CHECKOUT}"
    return (f"`{command}` in the fp4gen source checkout this package was installed from (at the same version; "
            f"after changing the checkout, `pip install .` there again)")


@functools.lru_cache(maxsize=None)
def load_manifest(path: Path = MANIFEST_PATH) -> dict:
    from ..errors import BuildError

    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        if CHECKOUT is not None:
            fix = f"run `python build.py --render-only` in {CHECKOUT}"
        else:
            fix = "reinstall fp4gen from its source checkout (`pip install .` there)"
        raise BuildError(f"cannot read the kernel manifest {path} ({exc}); {fix}") from None
