"""Makes ``tfuse.kernels`` importable when tfuse runs from a source checkout.

An install (regular or editable) maps the top-level ``kernels/`` folder of the
source tree to ``tfuse.kernels``. A script run from the repository root with
a regular install imports ``tfuse`` from the checkout instead, and there the
mapping does not exist; this module supplies it from the same checkout, so
``python -m benchmarks`` and ``pytest`` work from the root after any install,
and a checkout never mixes its tfuse with another copy's kernels.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_NAME = "tfuse.kernels"


def ensure_kernels_importable() -> None:
    """Registers ``<checkout>/kernels`` as ``tfuse.kernels`` when tfuse runs from a checkout.

    tfuse and its kernels then always come from the same tree, even when
    another copy of tfuse is installed. In an installed tfuse (no
    ``pyproject.toml`` beside the package) this does nothing.
    """
    if _NAME in sys.modules:
        return
    root = Path(__file__).resolve().parent.parent
    init = root / "kernels" / "__init__.py"
    if not (init.is_file() and (root / "pyproject.toml").is_file()):
        return
    spec = importlib.util.spec_from_file_location(_NAME, init, submodule_search_locations=[str(init.parent)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[_NAME] = module
    spec.loader.exec_module(module)
