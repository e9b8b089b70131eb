"""tfuse's packages talk through each other's public names only.

A module of one package (``tfuse.optim``, ``tfuse.distributed``, ``tfuse.flat``,
``tfuse.ops``, ``tfuse.nn``, ``tfuse.fusion``, ... and the top-level modules
as the package ``tfuse``) may import from another package only modules and
names without a leading underscore: e.g. ShardedOptimizer and LocalSGD step
through ``tfuse.optim.span``, never through ``tfuse.optim._update``. Within a
package anything goes. Shared infrastructure of the root package
(``tfuse._backend``, ``tfuse._launch``...) is the root's to hand down.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tfuse

ROOT = Path(tfuse.__file__).resolve().parent
PACKAGES = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists())


def _package_of(module: str) -> str:
    """The package a dotted tfuse module belongs to: its first component under tfuse, or "tfuse" itself."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else "tfuse"


def _private_imports() -> list[str]:
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT).with_suffix("")
        here = ".".join(("tfuse", *relative.parts)).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("tfuse."):
                imported = [(node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                imported = [(alias.name, "") for alias in node.names if alias.name.startswith("tfuse.")]
            else:
                continue
            for module, name in imported:
                theirs = _package_of(module)
                if theirs == _package_of(here) or theirs == "tfuse":
                    continue
                private = [p for p in module.split(".")[2:] if p.startswith("_")]
                if private or name.startswith("_"):
                    found.append(f"{here}:{node.lineno} imports {module}{'.' + name if name else ''}")
    return found


def test_no_module_imports_another_packages_private_names():
    assert _private_imports() == []


def test_the_check_sees_a_private_import(tmp_path, monkeypatch):
    """The check itself: a module of tfuse.distributed importing tfuse.optim._update is reported."""
    fake = tmp_path / "tfuse"
    (fake / "distributed").mkdir(parents=True)
    (fake / "optim").mkdir()
    for package in ("distributed", "optim"):
        (fake / package / "__init__.py").write_text("")
    (fake / "distributed" / "bad.py").write_text("from tfuse.optim._update import sgd_update\n")
    (fake / "distributed" / "good.py").write_text("from tfuse.optim.span import SpanStepper\nfrom tfuse._backend import x\n")
    monkeypatch.setattr(__import__(__name__), "ROOT", fake)
    monkeypatch.setattr(__import__(__name__), "PACKAGES", ["distributed", "optim"])
    assert _private_imports() == ["tfuse.distributed.bad:1 imports tfuse.optim._update.sgd_update"]
