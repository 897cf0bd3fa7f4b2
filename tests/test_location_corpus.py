"""The location corpus (``location_corpus_ports``): a NeRF-like step's loop ports in the structures real ports
take (``nnx.vmap`` over the groups of rows with more rows a device than a recording keeps, a Python loop over
the groups, ``nnx.scan`` over layers; loss terms as metrics and clipping per MLP in each), with one-constant
slips whose place is known. The rule: no place named that is not the slip's own ('not located' is never
wrong), every correct port located nowhere with every module call paired and agreeing, and every slip the
corpus marks 'placed' placed. Any change to the recording (what rows it keeps, how it pairs) runs against it.
Below it, the rows kept on each side, without running JAX programs."""

import functools
import types

import location_corpus_ports as cp
import numpy as np
import pytest
from conftest import require_devices

from equivalence.core import harness
from equivalence.core.compare import location
from equivalence.core.locate import stages
from equivalence.core.record import intercept, pairing, recorded
from equivalence.core.record.recorded import Record
from equivalence.core.report import screen


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


def test_a_linen_module_pairs_with_the_nnx_module_that_holds_exactly_what_it_holds():
    """``pairing.pairs``: an NNX port that keeps its layers in a list (``mlp/layers/0``, one level deeper than
    linen's ``MLP_0/Dense_0``, beside ``mlp/density``; google/mipnerf's, tried blind) pairs linen's MLP with its MLP
    and the model with the model, each call in turn; a module holding one other is not its child. The controls: an
    NNX side with no module for the MLP (its layers at the top) leaves it unpaired, as does one whose module holds a
    layer the linen module does not."""

    def paired(mapping: dict, legacy: list, new: list) -> dict:
        record = lambda cls: Record(cls, 0, None, {})  # noqa: E731
        return pairing.pairs({label: record('Dense') for label in legacy}, {label: record('Linear') for label in new},
                             mapping, None)  # fmt: skip

    deeper = {'MLP_0/Dense_0/kernel': 'mlp/layers/0/kernel', 'MLP_0/Dense_4/kernel': 'mlp/density/kernel'}
    found = paired(deeper, ['MLP_0/Dense_0', 'MLP_0/Dense_4', 'MLP_0', 'MLP_0#1', ''],
                   ['mlp/layers/0', 'mlp/density', 'mlp', 'mlp#1', ''])  # fmt: skip
    assert found == {'MLP_0/Dense_0': 'mlp/layers/0', 'MLP_0/Dense_4': 'mlp/density', 'MLP_0': 'mlp',
                     'MLP_0#1': 'mlp#1', '': ''}  # fmt: skip
    nested = {f'Block_0/{k}': f'block/{v}' for k, v in deeper.items()}
    assert paired(nested, ['Block_0/MLP_0', 'Block_0'], ['block/mlp', 'block']) == {
        'Block_0/MLP_0': 'block/mlp', 'Block_0': 'block'}  # fmt: skip
    flat = {'MLP_0/Dense_0/kernel': 'layers/0/kernel', 'MLP_0/Dense_4/kernel': 'density/kernel'}
    assert 'MLP_0' not in paired(flat, ['MLP_0', ''], ['layers/0', 'density', ''])  # not the model
    more = {**deeper, 'Head_0/Dense_0/kernel': 'mlp/head/kernel'}  # NNX's mlp holds linen's head too
    assert 'MLP_0' not in paired(more, ['MLP_0', 'Head_0', ''], ['mlp', 'mlp/head', ''])
    # One candidate, held to the same rule (Hugging Face's ViT against a port that keeps its attention flat):
    # HF's self-attention holds the query, NNX's attn holds the query and the output projection: not paired.
    # HF's output module and its dense hold the same kernel: the dense pairs with attn/out, the output with nothing.
    vit = {'attention/attention/query/kernel': 'attn/query/kernel', 'attention/output/dense/kernel': 'attn/out/kernel'}
    found = paired(vit, ['attention/attention', 'attention/output/dense', 'attention/output', 'attention'],
                   ['attn/query', 'attn/out', 'attn'])  # fmt: skip
    assert found == {'attention/output/dense': 'attn/out'}, found
    # The model pairs with the model, however much deeper linen nests its layers (Hugging Face's BERT against a flat
    # port: its output was never compared, and a loss slip was not located); a submodule holding every layer does not.
    hf = {'bert/encoder/layer/0/attention/self/query/kernel': 'layers/0/query/kernel'}
    assert paired(hf, ['', 'bert'], ['', 'layers/0']) == {'': ''}


def test_a_module_whose_sides_part_by_exactly_its_input_is_cut_otherwise_not_slipped():
    """``pairing.residual_moved``: a module that adds its input inside on one side (``x + f(x)``) and not on the other
    (the parent adds it) parts by exactly that input, within its floor: its output is not compared. The controls: a
    part by anything else (``f`` 1% off, or the residual and 1% more) is compared."""
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    f = np.tanh(x) * 0.5
    inside = {'blk/in/0': x, 'blk/out/0': x + f}
    assert pairing.residual_moved((inside, {'blk/in/0': x, 'blk/out/0': f}, {}), 'blk', 1e-6)
    assert pairing.residual_moved(({'blk/in/0': x, 'blk/out/0': f}, inside, {}), 'blk', 1e-6)  # either side
    for other in (1.01 * f, x + 1.01 * f):
        assert not pairing.residual_moved((inside, {'blk/in/0': x, 'blk/out/0': other}, {}), 'blk', 1e-6)


def test_the_loss_is_no_place_while_the_models_output_was_not_compared():
    """Every module call compared agrees and the loss parts: the loss is the place only where the model's own
    output agrees too; the outermost call recorded and not paired leaves the model's code after its last compared
    call unseen (google/mipnerf's rgb padding, tried blind, its model unpaired, was placed at the loss)."""
    dense = location.Module('MLP_0/Dense_0', 'mlp/layers/0', 'Dense', 0.0, 1e-6, True, 0.0, 1e-6, 1e-7, True)
    results = {side: types.SimpleNamespace(losses=np.float32([x]), metrics={})
               for side, x in (('legacy', 1.0), ('new', 1.1), ('twin', 1.1))}  # fmt: skip
    raw = {'legacy': {'': None, 'MLP_0/Dense_0': None}, 'new': {'': None, 'mlp/layers/0': None}}
    kind = types.SimpleNamespace(loss_names=lambda: ("the pmap step's loss", "the new step's loss"))

    def loss(modules: list) -> location.Location:
        return stages.loss(stages.Step(kind, results, raw, {}, {}, modules, {'MLP_0/Dense_0': 'mlp/layers/0'}))

    unseen = loss([dense])
    assert unseen.why is location.Unplaced.OUTPUT_UNCOMPARED and unseen.reading['apart'] > 0, unseen.line()
    root = location.Module(location.ROOT, location.ROOT, 'Model', 0.0, 1e-6, True, 0.0, 1e-6, 1e-7, True)
    assert loss([dense, root]).kind == 'loss'  # the control: the model's output compared, and agreeing


def test_the_first_screen_names_each_place_by_the_order_of_the_calls_not_a_data_flow():
    """The first screen's ``where:`` for the corpus's places: the code between two calls is named by their order
    (no data flow is observed: google/mipnerf's level 1 is fed by level 0's density head, the call before it is the
    rgb head); the model's own code after its submodules, by what agrees; the step's own draws once."""
    said = lambda structure, name: screen.where(checked(structure, name))[0]  # noqa: E731
    assert said('vmap', 'relu-density').startswith('where: the code inside prop_mlp: its inputs and its submodule')
    assert said('vmap', 'near-plane').startswith('where: the code before prop_mlp/Dense_0, the first call, from the')
    assert said('loop', 'rgb-padding').startswith('where: the code inside (the model): its inputs and its submodule')
    assert said('vmap', 'key-folded').startswith("where: the step's own random draws: ")


def test_a_value_the_same_for_every_example_compares_with_its_one_row():
    """``pairing.one_row``: Hugging Face's GPT-2 hands its position embedding ``[B, T]`` ids, every row
    ``arange(T)``, where an NNX port hands ``arange(T)`` or ``arange(T)[None]``: each side as that row, the twin's
    its own first row; rows that differ (positions per example) keep their shapes, and are not compared."""
    row = np.arange(4.0)
    full = np.broadcast_to(row, (3, 4)).copy()
    for one in (row, row[None]):
        legacy, new, twin = pairing.one_row(full, one, one + 1)
        assert legacy.shape == new.shape and np.array_equal(legacy, one) and np.array_equal(twin, one + 1)
        legacy, new, twin = pairing.one_row(one, full, full + 1)  # the other way round: the twin's row too
        assert new.shape == twin.shape == one.shape and np.array_equal(twin, one + 1)
    apart = full + np.arange(3.0)[:, None]  # per-example positions: not one row
    assert [a.shape for a in pairing.one_row(apart, row[None], None)[:2]] == [(3, 4), (1, 4)]
    assert pairing.one_row(full[:1], row[None], None)[0].shape == (1, 4)  # the same shapes: as they are


def test_hugging_faces_own_gpt2_is_placed_past_its_positions_and_its_outermost_call():
    """Hugging Face's own Flax GPT-2 (``hf_gpt2_modeling``, copied) under a pmap step against an NNX port written as
    teams write one: its position ids ``[B, T]`` against ``arange(T)`` (compared as one row), and its outermost call,
    which takes masks and positions and returns a tuple of hidden states, its head applied outside it, where the NNX
    model takes the tokens and returns the logits (its arrays do not compare: the loss reads it). Before, the
    correct port and every slip were 'not located (uncompared)'. Now the correct port is located nowhere, every
    call inside it paired and agreeing; a LayerNorm's epsilon at that LayerNorm; a warmup at the update rule. Its
    attention's dropout (HF's own import of ``dot_product_attention_weights``, its key from ``make_rng``) is bridged:
    the correct port MATCHes with dropout 0.1 everywhere, nothing named as unbridged."""
    require_devices(2)
    import hf_gpt2_ports as hf

    flags = dict(devices=2, steps_per_call=2, calls=1, locate=True)
    correct, eps, warmup = (harness.check(p, **flags) for p in (hf.LOOP, hf.LOOP_LN_EPS, hf.LOOP_WARMUP))
    loc = correct.verdict.location
    inside = [m for m in loc.modules if location.ROOT not in (m.legacy, m.new)]
    assert correct.outcome.label == 'MATCH' and loc.kind == 'none', loc.line()
    assert not [n for n in correct.notes if 'not bridged' in str(n)], correct.notes
    assert 'wpe' in [m.new for m in inside] and all(m.input_ok and m.output_ok for m in inside)
    placed = [(r.outcome.label, r.verdict.location.kind, r.verdict.location.new) for r in (eps, warmup)]
    assert placed == [('MISMATCH', 'module', 'h/0/ln_1'), ('MISMATCH', 'update', 'the update rule')], placed


def test_hugging_faces_own_vit_matches_a_port_whose_module_boundaries_are_its_own():
    """Hugging Face's own Flax ViT (``hf_vit_modeling``, copied) under a pmap step against two NNX ports written blind:
    one keeps a layer's attention flat (``attn/query`` beside ``attn/out``, where HF nests a self-attention and an
    output), one adds a layer's second residual in the block (HF's ``ViTOutput`` takes it as a second array and adds
    it inside). Each correct port has 6 noise-dominated key biases, so its first step is held module by module: HF's
    self-attention was paired with the flat ``attn``, which holds the output projection too, and the output with the
    residual compared with one without it, and each correct port was a MISMATCH. Now both MATCH, every module call
    held agreeing; the control, a LayerNorm's epsilon, is placed at that LayerNorm."""
    require_devices(2)
    import hf_vit_ports as flat
    import hf_vit_ports_nested as nested

    from equivalence.core.compare.findings import Held

    flags = dict(devices=2, steps_per_call=2, calls=1)
    for port in (flat.LOOP, nested.NESTED):
        result = harness.check(port, **flags)
        held = [d for d in result.verdict.done if isinstance(d, Held)]
        assert result.outcome.label == 'MATCH', (port.name, [x for x in result.report.leaves if not x.ok][:2])
        assert held and held[0].part is None and held[0].calls > 0, (port.name, held)
    slip = harness.check(flat.LOOP_LN_EPS, **flags).verdict.location
    assert (slip.kind, slip.new) == ('module', 'blocks/0/layernorm_before'), slip.line()
