"""Both install styles find the manifest and the built libraries, and their errors give commands that work
for that style. A regular install is simulated by the layout `pip install .` produces: the package files
under fp4gen/ with the manifest in fp4gen/generated/, away from any checkout (.ci/run also installs it for
real in a second environment)."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import fp4gen.cuda.manifest as manifest
from conftest import load_build_py

ROOT = Path(__file__).resolve().parents[1]

PROBE = """
import json, fp4gen, fp4gen.cuda.manifest as m
from fp4gen.cuda import library
try:
    library.load_kernel("dequantize_nvfp4_to_bf16_sm90a")
    error = None
except fp4gen.BuildError as exc:
    error = str(exc)
print(json.dumps({"package": fp4gen.__file__, "manifest": str(m.MANIFEST_PATH), "checkout": m.CHECKOUT and str(m.CHECKOUT),
                  "kernels": len(m.load_manifest()["kernels"]), "lib_dir": str(m.lib_dir()), "error": error}))
"""


def _probe(pythonpath: Path, cwd: Path, env_extra: dict) -> dict:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(cwd), "PYTHONPATH": str(pythonpath), **env_extra}
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def _installed_layout(site: Path) -> None:
    shutil.copytree(ROOT / "runtime", site / "fp4gen", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "fp4gen" / "generated").mkdir()
    shutil.copy(ROOT / "generated" / "manifest.json", site / "fp4gen" / "generated" / "manifest.json")


def test_regular_install_reads_its_packaged_manifest_and_the_default_lib_dir(tmp_path):
    site = tmp_path / "site"
    _installed_layout(site)
    torch_site = Path(__import__("torch").__file__).parents[1]
    result = _probe(f"{site}:{torch_site}", tmp_path, {})
    assert result["package"].startswith(str(site)) and result["checkout"] is None
    assert result["manifest"] == str(site / "fp4gen" / "generated" / "manifest.json")
    assert result["kernels"] == len(json.loads((ROOT / "generated" / "manifest.json").read_text())["kernels"])
    assert result["lib_dir"] == str(tmp_path / ".cache" / "fp4gen" / "lib")  # HOME is tmp_path
    # the fix names the checkout it was installed from, never site-packages
    assert "python build.py --arch sm90a` in the fp4gen source checkout" in result["error"]
    assert str(site) not in result["error"].split("(no ")[0]


def test_checkout_reads_generated_and_names_the_checkout(tmp_path):
    # what an editable install (or the checkout on sys.path) imports: fp4gen is the checkout's runtime/
    (tmp_path / "path").mkdir()
    (tmp_path / "path" / "fp4gen").symlink_to(ROOT / "runtime")
    torch_site = Path(__import__("torch").__file__).parents[1]
    result = _probe(f"{tmp_path / 'path'}:{torch_site}", tmp_path, {"FP4GEN_CACHE_DIR": str(tmp_path / "cache")})
    assert result["checkout"] == str(ROOT) and result["manifest"] == str(ROOT / "generated" / "manifest.json")
    assert result["lib_dir"] == str(tmp_path / "cache" / "lib")
    assert f"`python build.py --arch sm90a` in {ROOT}" in result["error"]


def test_lib_dir_rule(monkeypatch, tmp_path):
    monkeypatch.delenv("FP4GEN_LIB_DIR", raising=False)
    monkeypatch.setenv("FP4GEN_CACHE_DIR", str(tmp_path / "c"))
    assert manifest.lib_dir() == tmp_path / "c" / "lib"
    monkeypatch.setenv("FP4GEN_LIB_DIR", str(tmp_path / "libs"))
    assert manifest.lib_dir() == tmp_path / "libs"


def test_build_py_and_the_runtime_agree_on_the_lib_dir(monkeypatch, tmp_path):
    build = load_build_py()
    for env in ({"FP4GEN_CACHE_DIR": str(tmp_path / "c")}, {"FP4GEN_LIB_DIR": str(tmp_path / "l")}, {}):
        monkeypatch.delenv("FP4GEN_LIB_DIR", raising=False)
        monkeypatch.delenv("FP4GEN_CACHE_DIR", raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert Path(build.lib_dir()) == manifest.lib_dir()
