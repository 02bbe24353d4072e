"""The wheel in a venv of its declared dependencies alone: `pyproject.toml`'s dependencies and,
recursively, theirs (extras left out; no test, docs, cuda or tpu extra). Every module of the
wheel imports there, and the chat endpoint's template rendering (jinja2) runs.

The venv is built without the network: the wheel is built from this checkout (`pip wheel
--no-deps`), and each required distribution's files are linked in from the test environment's
site-packages, so nothing else (pytest, torch, transformers, ...) is importable in it."""

import shutil
import subprocess
import sys
import textwrap
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

from tests.test_packaging import ROOT, _required_distributions

pytestmark = pytest.mark.slow

CHECK = textwrap.dedent("""
    import importlib, pkgutil
    count = 0
    for top in ("jaxrl", "serving", "sharding"):
        assert importlib.import_module(top).__file__.startswith(SITE), top
        for info in pkgutil.walk_packages(importlib.import_module(top).__path__, top + "."):
            importlib.import_module(info.name)
            count += 1
    for absent in ("pytest", "torch", "transformers"):
        try:
            importlib.import_module(absent)
        except ImportError:
            continue
        raise AssertionError(f"{absent} is importable in the bare venv")
    from jaxrl.models.chat import render_chat
    text = render_chat("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
                       "{% if add_generation_prompt %}<assistant>{% endif %}",
                       [{"role": "user", "content": "2+2?"}], None)
    assert text == "<user>2+2?<assistant>", text
    print(count)
""")


def _link(dist: metadata.Distribution, site: Path) -> None:
    """The distribution's files in `site`, as links: each top-level module or package, and
    inside a namespace package (no __init__.py, shared by several distributions) each of its
    entries."""
    for f in dist.files or []:
        if f.parts[0] in ("..", "__pycache__") or f.suffix == ".pth":
            continue
        top = Path(dist.locate_file(f.parts[0]))
        namespace = top.is_dir() and not (top / "__init__.py").exists() and len(f.parts) > 2 \
            and not f.parts[0].endswith((".dist-info", ".libs", ".data"))
        parts = f.parts[:2] if namespace else f.parts[:1]
        target = site.joinpath(*parts)
        if not target.exists() and not target.is_symlink():
            target.parent.mkdir(parents=True, exist_ok=True)
            target.symlink_to(Path(dist.locate_file(Path(*parts))))


def _wheel(tmp_path: Path) -> Path:
    """The wheel, built from a copy of the checkout's sources (the build writes beside them)."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for name in ("jaxrl", "serving", "sharding"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp_path / "wheel"), str(src)], check=True,
                   cwd=tmp_path)
    return next((tmp_path / "wheel").glob("jaxrl-*.whl"))


def test_every_module_of_the_wheel_imports_with_its_declared_dependencies_alone(tmp_path):
    wheel_file = _wheel(tmp_path)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(tmp_path / "venv")],
                   check=True)
    site = next((tmp_path / "venv" / "lib").glob("python*/site-packages"))
    for name in sorted(_required_distributions()):
        try:
            _link(metadata.distribution(name), site)
        except metadata.PackageNotFoundError:
            continue        # a requirement for other Pythons or platforms (its marker)
    with zipfile.ZipFile(wheel_file) as wheel:
        wheel.extractall(site)
    done = subprocess.run([str(tmp_path / "venv" / "bin" / "python"), "-c",
                           f"SITE = {str(site)!r}\n{CHECK}"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=600,
                          env={"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert int(done.stdout.split()[-1]) > 100      # every module, not an empty package
