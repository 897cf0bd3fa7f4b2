"""A check judges the port's code as it stands when it starts: the same port object checked again after a
constant it reads changed (pytest's ``monkeypatch``; an edit and ``importlib.reload``) is judged anew, not by
what the first check kept (the model's traced graph, its facts, JAX's traces of its functions)."""

import importlib
import os
import shutil
import sys

import pytest
from conftest import ROOT

from equivalence import check
from equivalence.core.compare.outcome import Outcome

TEMPLATE = os.path.join(ROOT, 'tests', 'data', 'edited_port.py')


@pytest.fixture
def edited(tmp_path, monkeypatch):
    """The team's module, imported from a folder of its own, with the example's modules beside it."""
    shutil.copy(TEMPLATE, tmp_path / 'edited_port.py')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.syspath_prepend(os.path.join(ROOT, 'examples', 'mlp_port'))
    sys.modules.pop('edited_port', None)
    module = importlib.import_module('edited_port')
    yield module, tmp_path / 'edited_port.py'
    sys.modules.pop('edited_port', None)


def outcome(port) -> Outcome:
    return check(port, devices=2, steps_per_call=2, calls=2, diagnose=False).outcome


def test_a_change_to_the_code_reaches_the_next_check_of_the_same_port(edited, monkeypatch):
    """pytest's monkeypatch on a constant read when the model is built (the graph kept per port) and on one read
    while a jitted function of the team's traces (JAX's trace cache), then an edit of the file and a reload:
    each a slip on the NNX side only, each caught by the next check of the very same port object."""
    module, path = edited
    port = module.PORT
    assert outcome(port) is Outcome.MATCH  # the negative control: kept work, then the code changes
    monkeypatch.setattr(module, 'LN_EPS', 1e-5)
    assert outcome(port) is Outcome.MISMATCH
    monkeypatch.setattr(module, 'LN_EPS', 1e-6)
    monkeypatch.setattr(module, 'OUT_SCALE', 1.01)
    assert outcome(port) is Outcome.MISMATCH
    monkeypatch.setattr(module, 'OUT_SCALE', 1.0)
    path.write_text(path.read_text().replace('LN_EPS = 1e-6', 'LN_EPS = 1e-5'))
    importlib.reload(module)
    assert outcome(port) is Outcome.MISMATCH
