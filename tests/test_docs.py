"""The documentation site (docs/) builds with every warning an error, and its API reference has every public name.

The build is Sphinx's, as a user or CI runs it (``sphinx-build -W --keep-going -n``): a broken link between
pages, a link to a missing heading, a docstring reference to a name that does not exist, a page left out of
every table of contents or a docstring autodoc cannot parse fails it. The pages' Python examples run in
``test_doc_examples.py`` and the docstrings' examples in ``test_doctests.py``.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import sys
import zlib
from pathlib import Path

import pytest
from helpers import run_command

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _public_packages() -> list[str]:
    """tfuse and each of its modules without an underscore in its path that states an ``__all__`` (tfuse.kernels
    and tfuse.examples state none: the kernels' namespace and the runnable examples are not APIs)."""
    import tfuse

    names = ["tfuse"]
    for info in pkgutil.walk_packages(tfuse.__path__, prefix="tfuse."):
        if not any(part.startswith("_") for part in info.name.split(".")):
            if hasattr(importlib.import_module(info.name), "__all__"):
                names.append(info.name)
    return names


pytestmark = pytest.mark.skipif(not (DOCS / "conf.py").is_file(), reason="needs the source tree (docs/)")


@pytest.fixture(scope="module")
def built_site(tmp_path_factory) -> Path:
    # The docs extra is part of the test extra; without it (a bare `pip install pytest`) there is no builder.
    pytest.importorskip("sphinx", reason="the docs extra (pip install -e '.[docs]') is not installed")
    pytest.importorskip("myst_parser", reason="the docs extra (pip install -e '.[docs]') is not installed")
    out = tmp_path_factory.mktemp("site")
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html", str(DOCS), str(out)]
    result = run_command(command, cwd=ROOT, timeout=600)
    assert result.returncode == 0, f"the docs do not build cleanly:\n{result.stderr[-6000:]}"
    return out


def _documented_names(site: Path) -> set[str]:
    """The Python names in the site's object inventory (objects.inv: four header lines, then zlib)."""
    data = (site / "objects.inv").read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = data.index(b"\n", header_end) + 1
    names = set()
    for line in zlib.decompress(data[header_end:]).decode().splitlines():
        name, role = line.split(" ", 2)[:2]
        if role.startswith("py:"):
            names.add(name)
    return names


def test_the_site_builds_with_no_warning(built_site: Path) -> None:
    pages = {p.relative_to(built_site).as_posix() for p in built_site.rglob("*.html")}
    for page in (
        "index.html",
        "getting-started.html",
        "optimizers.html",
        "distributed.html",
        "benchmarks.html",
        "ideas.html",
        "api/optim.html",
        "changelog.html",
    ):
        assert page in pages, f"{page} was not built"


def test_every_public_name_is_in_the_api_reference(built_site: Path) -> None:
    documented = _documented_names(built_site)
    packages = _public_packages()
    assert {"tfuse.nn", "tfuse.functional", "tfuse.optim", "tfuse.distributed", "tfuse.flat"} <= set(packages)
    missing = []
    for package in packages:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj):
                continue  # a subpackage: its own page
            # A name re-exported by another public package counts where that package documents it
            # (tfuse.fusion.fuse_model is documented as tfuse.fuse_model).
            homes = [
                f"{other}.{name}" for other in packages if getattr(importlib.import_module(other), name, None) is obj
            ]
            if not any(home in documented for home in homes):
                missing.append(f"{package}.{name}")
    assert not missing, f"public names without an entry in the API reference: {missing}"
    # Public classes come with their public methods.
    for name in (
        "tfuse.optim.FusedAdam.step",
        "tfuse.flat.FlatParams.zero_grad",
        "tfuse.distributed.ShardedOptimizer.state_dict",
        "tfuse.distributed.FusedDataParallel.overlap_step",
    ):
        assert name in documented, f"{name} is not in the API reference"
