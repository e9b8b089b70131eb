"""Sphinx configuration of tfuse's documentation.

Sphinx, not mkdocs: tfuse's docstrings are written for Sphinx (``:class:`` and
``:func:`` roles, Google-style sections), so autodoc renders them as they are
and checks every reference in them (``nitpicky``). The pages are Markdown
(MyST), like the README, and their ``python`` code blocks run in the tests.

Build (what the tests run; any warning fails it)::

    sphinx-build -W --keep-going -n -b html docs docs/_build/html
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

from sphinx.ext.napoleon.docstring import GoogleDocstring

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # a checkout builds its own tfuse, installed or not
os.environ.setdefault("TRITON_INTERPRET", "1")  # importing tfuse on a machine without a GPU

import tfuse  # noqa: E402  (after the path and the interpreter flag)

project = "tfuse"
author = "The tfuse authors"
copyright = "2026, the tfuse authors"
release = version = tfuse.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon", "myst_parser"]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
root_doc = "index"
html_theme = "alabaster"
html_title = f"tfuse {release}"
myst_heading_anchors = 3  # links to a page's sections: [text](page.md#a-heading)

autodoc_member_order = "bysource"
autodoc_typehints = "description"  # the types beside each argument, not in a 300-character signature
# Methods a public class inherits from tfuse's own mixins are its API (FlatParams.zero_grad); what it inherits
# from torch and Python is torch's and Python's.
autodoc_default_options = {
    "members": True,
    "undoc-members": True,
    "inherited-members": (
        "Module,GraphModule,Optimizer,SyncBatchNorm,BatchNorm1d,BatchNorm2d,_BatchNorm,_NormBase,Conv2d,_ConvNd,Linear,"
        "tuple,object,Enum,IntEnum,int,str,float,dict,list,Exception,Generic"
    ),
}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # an "Attributes:" section as fields: autodoc documents the attributes themselves

# Every reference must resolve, except to names outside tfuse (no network for torch's inventory) and to
# tfuse's private modules, whose types appear in some signatures but are not part of the API.
nitpicky = True
_EXTERNAL = (
    r"(torch|nn|F|fx|dist|datetime|numpy|np|typing|collections|enum|pathlib|logging|os|abc|contextlib"
    r"|dataclasses|triton)"
)
nitpick_ignore_regex = [
    (r"py:.*", _EXTERNAL + r"(\..*)?"),
    (r"py:.*", r"tfuse(\.[a-z_]+)*\._.*"),
    # The optimizers' engine (the span stepper, torch's state-dict rules): internal, described in architecture.md.
    (r"py:.*", r"tfuse\.optim\.(span|load_rules)(\..*)?"),
    (r"py:.*", r"(Tensor|Module|Parameter|Optimizer|ProcessGroup|Work|Callable|Iterable|Iterator|Sequence|Mapping)"),
    (r"py:.*", r"(Any|Self|None|Literal|Union|Optional)"),
]


def _prose_attribute_docstrings() -> None:
    """Napoleon reads an attribute's first docstring line "X: Y" as "type: description"; tfuse's attribute and
    property docstrings are prose whose first sentence may hold a colon, and their types are annotations."""

    def consume_inline_attribute(self) -> tuple[str, list[str]]:
        lines = [self._lines.next(), *self._dedent(self._consume_to_end())]
        return "", self.__class__(lines, self._config).lines()

    GoogleDocstring._consume_inline_attribute = consume_inline_attribute


def _public_names() -> dict[int, str]:
    """id(object) -> the public name it is documented under (the first public package that exports it)."""
    names: dict[int, str] = {}
    for package in (
        "tfuse",
        "tfuse.nn",
        "tfuse.functional",
        "tfuse.optim",
        "tfuse.distributed",
        "tfuse.flat",
        "tfuse.fusion",
        "tfuse.ops",
    ):
        module = importlib.import_module(package)
        for name in getattr(module, "__all__", []):
            names.setdefault(id(getattr(module, name)), f"{package}.{name}")
    return names


def _resolve_by_object(target: str, names: dict[int, str]) -> str | None:
    """The public name of what ``target`` (a definition path such as tfuse.optim.adam.FusedAdam.step) is."""
    parts = target.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        rest = parts[split:]
        for index, attribute in enumerate(rest):
            obj = getattr(obj, attribute, None)
            if obj is None:
                return None
            public = names.get(id(obj))
            if public is not None and index == len(rest) - 1:
                return public
            if public is not None:  # a member of a public class: tfuse.optim.FusedAdam.step
                return ".".join([public, *rest[index + 1 :]])
        return None
    return None


def _missing_reference(app, env, node, contnode):
    """A reference to where a public object is defined (tfuse.flat._flat_params.FlatParams, as type hints
    and docstrings name it) resolves to where it is documented (tfuse.flat.FlatParams)."""
    if node.get("refdomain") != "py":
        return None
    target, module = node.get("reftarget", ""), node.get("py:module") or ""
    # A name relative to the module whose docstring says it (FusionReport in tfuse.fusion's docstring).
    candidates = [target] if target.startswith("tfuse.") else [f"{module}.{target}"] if module else []
    for candidate in candidates:
        public = _resolve_by_object(candidate, app.config._tfuse_public_names)
        if public is not None and public != target:
            domain = env.get_domain("py")
            return domain.resolve_xref(env, node["refdoc"], app.builder, node["reftype"], public, node, contnode)
    return None


def setup(app):
    _prose_attribute_docstrings()
    app.config._tfuse_public_names = _public_names()
    app.connect("missing-reference", _missing_reference)
