"""The wheel a user installs: typed (``py.typed``), licensed (LICENSE in its metadata), with
the topology specs, and its version from the one place it is written (`resilax.__version__`)."""

import pathlib
import shutil
import subprocess
import sys
import zipfile

import resilax

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_wheel_has_py_typed_license_and_specs(tmp_path):
    # built from a copy of what the wheel is made of, so no build files land in the checkout
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(ROOT / "resilax", src / "resilax", ignore=ignore)
    shutil.copytree(ROOT / "slices", src / "slices", ignore=ignore)
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(src)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp_path / "dist").glob("resilax-*.whl")
    assert wheel.name.startswith(f"resilax-{resilax.__version__}-")
    names = zipfile.ZipFile(wheel).namelist()
    assert "resilax/py.typed" in names
    assert "resilax/slices/cpu-2x4.toml" in names
    licenses = [n for n in names if n.endswith("LICENSE") and ".dist-info/" in n]
    assert licenses, names
    text = zipfile.ZipFile(wheel).read(licenses[0]).decode()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    meta = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert f"Version: {resilax.__version__}" in meta and "LICENSE" in meta


def test_no_module_over_700_lines():
    """One module, one responsibility (docs/architecture.md): none grows past 700 lines."""
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "resilax").rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 700}
    assert not long, long
