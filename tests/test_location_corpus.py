"""The location corpus (``location_corpus_ports``): a NeRF-like step's loop ports in the structures real ports
take (``nnx.vmap`` over the groups of rows with more rows a device than a recording keeps, a Python loop over
the groups, ``nnx.scan`` over layers; loss terms as metrics and clipping per MLP in each), with one-constant
slips whose place is known. The rule: no place named that is not the slip's own ('not located' is never
wrong), every correct port located nowhere with every module call paired and agreeing, and every slip the
corpus marks 'placed' placed. Any change to the recording (what rows it keeps, how it pairs) runs against it.
Below it, the rows kept on each side, without running JAX programs."""

import functools

import location_corpus_ports as cp
import numpy as np
import pytest
from conftest import require_devices

from equivalence.core import harness
from equivalence.core.record import intercept, recorded
from equivalence.core.record.recorded import Record


@functools.cache
def checked(structure: str, name: str):
    require_devices(cp.DEVICES)
    return harness.check(cp.port(structure, name), devices=cp.DEVICES, steps_per_call=2, calls=2, locate=True)


def truth(name: str) -> cp.Truth:
    return cp.SLIPS[name][1] if name in cp.SLIPS else cp.CORRECT


def said(structure: str, name: str) -> str:
    result = checked(structure, name)
    return f'{structure}:{name}: {result.outcome.label}, {result.verdict.location.line()}'


def test_the_corpus_names_no_wrong_place_and_places_every_slip_it_must():
    wrong, unplaced, verdicts, blind = [], [], [], []
    for (structure, name), must in cp.CORPUS.items():
        result = checked(structure, name)
        loc = result.verdict.location
        if result.outcome.label != ('MATCH' if name == 'correct' else 'MISMATCH'):
            verdicts.append(said(structure, name))
        if loc.kind not in ('none', 'unlocated') and not placed_right(structure, name):
            wrong.append(said(structure, name))
        if must == 'placed' and not placed_right(structure, name, exactly=True):
            unplaced.append(said(structure, name))
        if name == 'correct' and not (loc.kind == 'none' and all(m.input_ok and m.output_ok for m in loc.modules)):
            blind.append(said(structure, name))  # every module call paired and agreeing, nothing else said
    assert not wrong and not unplaced and not verdicts and not blind, {
        'wrong places': wrong, 'not placed': unplaced, 'wrong verdicts': verdicts, 'correct ports': blind,
    }  # fmt: skip
    # each correct port's every module call paired: each MLP's 3 Dense and itself, and the model (scan: each MLP's
    # 2 Dense, its stacked layers and their Dense, recorded on their first iteration, and itself)
    calls = {s: [m.new for m in checked(s, 'correct').verdict.location.modules] for s in ('vmap', 'loop', 'scan')}
    assert [len(c) for c in calls.values()] == [9, 9, 11], calls


def placed_right(structure: str, name: str, exactly: bool = False) -> bool:
    """Whether the location names one of the slip's true places (``exactly``: its first)."""
    loc = checked(structure, name).verdict.location
    places = truth(name).places[:1] if exactly else truth(name).places
    return any(loc.kind == kind and part in loc.new for kind, part in places)


def test_the_corpus_names_the_cause_where_its_place_is_the_update_rule_or_a_loss_term():
    """Clipping per MLP made global is said with clipping among the causes (placed at the update rule or not
    located); a loss term's weight placed at the loss, naming the term whose metric alone parts."""
    missing = [
        said(structure, name)
        for structure, name in cp.CORPUS
        if name in cp.CAUSES and cp.CAUSES[name] not in checked(structure, name).verdict.location.line()
    ]
    assert not missing, missing


# -- the rows a recording keeps, on the host's arrays (no program runs) --


@pytest.fixture
def rows(monkeypatch):
    """A recording keeping 2 rows of each of 2 devices' 4 (a global batch of 8)."""
    monkeypatch.setattr(intercept._SESSION, 'rows', (2, 2, 8))


def test_each_side_keeps_the_same_rows_whatever_the_new_sides_form(rows):
    """The pmap side's device d keeps its first rows; the new side keeps the same examples, whether its value is
    the global batch, vmapped over the D groups (``[D, B / D, ...]``, its vmap's axis anywhere), or one group's
    (a Python loop's call, flagged); ``recorded.value`` joins the pmap side's into the new side's layout."""
    x = np.arange(8 * 3.0).reshape(8, 3)  # example i holds 3i, 3i + 1, 3i + 2
    legacy = [intercept.sampled([x[4 * d : 4 * d + 4]], [()], 'legacy') for d in range(2)]
    assert all(groups == (False,) for _, _, groups in legacy)
    record = Record('Dense', 0, None, {d: ([values[0]], []) for d, (values, _, _) in enumerate(legacy)})
    kept = x[[0, 1, 4, 5]]
    (whole,), _, groups = intercept.sampled([x], [()], 'new')
    np.testing.assert_array_equal(whole, kept)
    assert groups == (False,)
    grouped = x.reshape(2, 4, 3).transpose(1, 2, 0)  # a vmap's axis last: [B / D, F, D]
    (vmapped,), (levels,), groups = intercept.sampled([grouped], [((2, 2),)], 'new')
    vmapped = recorded.batch_axes_first(np.asarray(vmapped), levels)
    assert vmapped.shape == (2, 2, 3) and levels == ((0, 2),) and groups == (False,)
    np.testing.assert_array_equal(recorded.value(record, 0, 0, vmapped), vmapped)
    np.testing.assert_array_equal(vmapped.reshape(4, 3), kept)
    (one,), _, groups = intercept.sampled([x[4:]], [()], 'new')  # group 1's rows, alone
    np.testing.assert_array_equal(one, x[[4, 5]])
    assert groups == (True,)
    (unmapped,), _, groups = intercept.sampled([x[:4]], [((None, 2),)], 'new')  # no vmap maps it: whole
    np.testing.assert_array_equal(unmapped, x[:4])


def test_a_module_called_once_a_group_is_one_call_and_no_other_count_is_joined():
    """``recorded.joined``: a module the new side calls once for each of the D groups (``path``, ``path#1``),
    on one group's rows each, is one record of the groups' rows in order, its other values the first call's;
    called twice a group, its calls stay apart (their rows are then compared with nothing: not paired)."""
    a, b, w = np.zeros((2, 3)), np.ones((2, 3)), np.full(3, 7.0)
    calls = {'mlp': Record('Dense', 1, None, {0: ([a, w], [a])}), 'mlp#1': Record('Dense', 2, None, {0: ([b, w], [b])})}
    flags = {label: ((True, False), (True,)) for label in calls}
    joined = recorded.joined(calls, flags, 2)
    assert list(joined) == ['mlp']
    (x, weight), (y,) = joined['mlp'].values[0]
    np.testing.assert_array_equal(x, np.concatenate([a, b]))
    np.testing.assert_array_equal(y, np.concatenate([a, b]))
    np.testing.assert_array_equal(weight, w)
    assert recorded.joined(calls, flags, 4) == calls  # 2 calls of 4 groups: a module called otherwise
    assert recorded.joined(calls, {label: ((False, False), (False,)) for label in calls}, 2) == calls  # no rows


def test_one_groups_rows_recorded_in_no_known_order_are_left_out():
    """``recorded.host``: a module inside a transform traced apart (``nnx.scan``'s body) under a vmap over the
    groups calls back once a group under one label, in no fixed order: which group's rows a value holds is not
    known, so it is left out (the modules after it are compared); called once a step, it is kept; the pmap side's
    several calls (a scan's iterations) are kept, the first."""
    rows = np.zeros((2, 3))
    entry = lambda group: (0, 0, [rows], [rows], (((),), ((),), (group,), (group,)), 1)  # noqa: E731
    raw = {'layers': ('Dense', 1, None, [entry(True), entry(True)], ()), 'head': ('Dense', 2, None, [entry(True)], ())}
    assert list(recorded.host(raw, 2)) == ['head']
    assert list(recorded.host({'layers': ('Dense', 1, None, [entry(False), entry(False)], ())}, 1)) == ['layers']
