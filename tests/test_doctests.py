"""The examples in tfuse's docstrings run, as written, and print what they say (doctest).

Every module of the installed package is searched; each docstring with an
example is one test. On a CPU machine they run through Triton's interpreter
(set by conftest.py) or the PyTorch path, as a user's CPU session would. An
example that needs CUDA says so with ``# doctest: +SKIP`` in the docstring.
"""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest
import torch

import tfuse


def _modules() -> list[str]:
    names = ["tfuse"]
    for info in pkgutil.walk_packages(tfuse.__path__, prefix="tfuse."):
        names.append(info.name)
    return sorted(names)


def _examples() -> list[tuple[str, doctest.DocTest]]:
    finder = doctest.DocTestFinder(exclude_empty=True)
    found = []
    seen = set()
    for name in _modules():
        module = importlib.import_module(name)
        for test in finder.find(module, name, globs={}):
            # Objects re-exported by a package are found twice: test each where it is defined.
            if test.examples and test.name not in seen and test.name.startswith(name):
                seen.add(test.name)
                found.append((test.name, test))
    return found


EXAMPLES = _examples()


def test_the_public_api_has_examples():
    names = {name for name, _ in EXAMPLES}
    for expected in ("tfuse.flat.FlatParams", "tfuse.optim.adam.FusedAdam", "tfuse.optim.sgd.FusedSGD",
                     "tfuse.optim.clip.clip_grad_norm_", "tfuse.flat.flat_params_of"):
        assert expected in names, f"{expected} lost its docstring example"


@pytest.mark.parametrize("name,test", EXAMPLES, ids=[name for name, _ in EXAMPLES])
def test_docstring_example(name: str, test: doctest.DocTest) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    output: list[str] = []
    state = torch.random.get_rng_state()
    try:
        torch.manual_seed(0)
        runner.run(test, out=output.append)
    finally:
        torch.random.set_rng_state(state)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, "".join(output)
