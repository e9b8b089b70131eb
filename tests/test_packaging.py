"""Regular and editable installs both provide tfuse.kernels, and no top-level ``kernels``."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from helpers import run_command

ROOT = Path(__file__).resolve().parent.parent
CHECK = "import tfuse, tfuse.kernels; print(tfuse.kernels.__file__)"

pytestmark = pytest.mark.skipif(
    not (ROOT / "pyproject.toml").is_file(),
    reason="needs the source tree (tests run from an installed copy)",
)


def _source_copy(tmp_path: Path) -> Path:
    """A copy of the files a build reads, so building leaves no trace in the checkout."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("tfuse", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    return src


def _pip_install(args: list[str]) -> None:
    result = run_command(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", *args], timeout=300
    )
    assert result.returncode == 0, result.stderr


def _import_from(target: Path, cwd: Path, editable: bool) -> list[str]:
    # An editable install works through a .pth file, which only site dirs process.
    code = f"import site; site.addsitedir({str(target)!r}); {CHECK}" if editable else CHECK
    env = dict(os.environ, PYTHONPATH=str(target), TRITON_INTERPRET="1")
    result = run_command([sys.executable, "-c", code], cwd=cwd, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_regular_install(tmp_path):
    src = _source_copy(tmp_path)
    target = tmp_path / "site"
    _pip_install(["--target", str(target), str(src)])
    assert (target / "tfuse" / "kernels" / "add.py").is_file()
    assert not (target / "kernels").exists(), "a top-level kernels package was installed"
    (kernels_file,) = _import_from(target, cwd=tmp_path, editable=False)
    assert Path(kernels_file) == target / "tfuse" / "kernels" / "__init__.py"


def test_editable_install(tmp_path):
    src = _source_copy(tmp_path)
    target = tmp_path / "site"
    _pip_install(["--target", str(target), "--editable", str(src)])
    assert not (target / "kernels").exists()
    (kernels_file,) = _import_from(target, cwd=tmp_path, editable=True)
    assert Path(kernels_file) == src / "kernels" / "__init__.py"


def test_checkout_run_from_its_root(tmp_path):
    # `python -m benchmarks` from the repository root imports tfuse from the
    # checkout, where no install maps kernels/ to tfuse.kernels.
    src = _source_copy(tmp_path)
    empty = tmp_path / "nothing-installed"
    empty.mkdir()
    (kernels_file,) = _import_from(empty, cwd=src, editable=False)
    assert Path(kernels_file) == src / "kernels" / "__init__.py"


def test_every_package_of_the_source_tree_is_listed_for_setuptools():
    # setuptools puts the files of a subpackage missing from pyproject.toml's list into the wheel anyway, as
    # package data (with a deprecation warning), so the install tests above pass without it; the list is checked.
    tomllib = pytest.importorskip("tomllib", reason="tomllib comes with Python 3.11")
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "tfuse").rglob("__init__.py")}
    assert found <= listed, f"not in [tool.setuptools] packages: {sorted(found - listed)}"
