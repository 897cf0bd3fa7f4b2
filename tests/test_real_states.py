"""Train states as teams write them: a ``flax.struct`` state with no step counter is read (its
counter "not compared", as for a tuple), and a state the comparison cannot read is refused by the
pre-flight, before anything trains (exit 2)."""

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import require_devices
from flax import nnx
from test_step_forms import BASE, LinenMLP, skipped, tx

from equivalence import LoopPort
from equivalence.core import harness, kinds, preflight
from equivalence.core.compare.outcome import Outcome
from equivalence.core.report import words
from equivalence.core.run import step_side
from equivalence.core.state import new_side
from equivalence.core.state.states import Skip

QUICK = {'steps_per_call': 2, 'calls': 2}
SCREEN = {**QUICK, 'verdict': 'screen'}  # the fixed screen: what is checked here is the reading, not the floor
KEY0 = jax.random.PRNGKey(11)


@flax.struct.dataclass
class State:
    """A research group's state: parameters, optimizer state and the dropout key; no step."""

    params: Any
    opt_state: Any
    rng: jax.Array


def legacy_state(variables: dict, key: jax.Array = KEY0) -> State:
    return State(params=variables['params'], opt_state=tx().init(variables['params']), rng=key)


def legacy_step(state: State, batch):
    rng, dropout_rng = jax.random.split(state.rng)

    def loss_fn(params):
        pred = LinenMLP().apply({'params': params}, batch['x'], True, rngs={'dropout': dropout_rng})
        return jnp.mean((pred - batch['y']) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = tx().update(jax.lax.pmean(grads, 'batch'), state.opt_state, state.params)
    new = State(params=optax.apply_updates(state.params, updates), opt_state=opt_state, rng=rng)
    return new, {'loss': jax.lax.pmean(loss, 'batch')}


def nnx_state(model, lr: float = 0.05, key: jax.Array = KEY0):
    return model, nnx.Optimizer(model, tx(lr), wrt=nnx.Param), nnx.Variable(key)


def one_step(ts, batch):
    model, optimizer, rng = ts
    rng[...], dropout_rng = jax.random.split(rng[...])
    nnx.reseed(model, dropout=dropout_rng)
    loss_fn = lambda m: jnp.mean((m(batch['x']) - batch['y']) ** 2)  # noqa: E731
    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return {'loss': loss}


nnx_step = nnx.jit(one_step)
STRUCT = LoopPort(**{**BASE, 'name': 'struct state', 'legacy_state': legacy_state, 'new_state': nnx_state},
                  legacy_step=legacy_step, step_form='state', loss='loss', new_step=nnx_step)  # fmt: skip


def test_a_struct_state_without_a_step_is_read_and_its_counter_not_compared():
    """Was exit 3 ('State' object has no attribute 'step') after the pmap side had trained."""
    require_devices(2)
    result = harness.check(STRUCT, devices=2, **SCREEN)
    assert result.report.match, [leaf for leaf in result.report.leaves if not leaf.ok]
    groups = {leaf.group for leaf in result.report.leaves}
    assert {'params', 'opt_state', 'losses'} <= groups and 'step' not in groups, groups
    assert {('step', Skip.NO_STEP), ('rng', Skip.KEY)} <= skipped(result.notes), result.notes
    slipped = dataclasses.replace(STRUCT, new_state=lambda m: nnx_state(m, lr=0.0505))  # negative control
    assert not harness.check(slipped, devices=2, diagnose=False, **SCREEN).report.match


@flax.struct.dataclass
class SplitState:
    """``nnx.split((model, optimizer))`` kept whole, as a loop over a plain dict carries it (examples/vit_port)."""

    graphdef: Any = flax.struct.field(pytree_node=False)
    state: dict


def test_a_split_state_is_read_and_not_said_not_compared():
    """Its arrays are read, merged back with its graphdef; the report said 'not compared: state: dict (452 arrays):
    no NNX counterpart the suite reads' of a ViT-B whose every parameter it compared. Its graphdef is said
    (no array); a field of another name beside it still is (the negative control)."""
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split((model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)))
    split = SplitState(graphdef, nnx.to_pure_dict(state))
    assert set(new_side.read_groups(split)['params']) == {'kernel', 'bias'}
    assert skipped(new_side.not_compared(split)) == {('graphdef', Skip.STATIC)}
    other = {'graphdef': graphdef, 'state': {}, 'params': {}, 'extra': {'a': 1.0}}  # not the split form
    assert {name for name, _ in skipped(new_side.not_compared(other))} >= {'state', 'extra'}


def test_typed_keys_in_either_state_are_read_compared_and_placed_as_raw_keys():
    """google-research/vision_transformer's ``flax.struct`` state holding ``jax.random.key(0)`` (dtype
    key<fry>) was exit 3 (``TypeError: JAX array with PRNGKey dtype cannot be converted to a NumPy array`` in
    ``unreplicate_to_host``; issue 51). A typed key, in the pmap side's ``flax.struct`` and the new side's
    ``nnx.Variable``, is placed, read and, where the port's groups hand it on, compared as its key data, as a
    raw key is: the same bits as the raw key run's."""
    require_devices(2)
    finals = {}
    for name, key in (('raw', KEY0), ('typed', jax.random.wrap_key_data(KEY0))):
        port = dataclasses.replace(
            STRUCT,
            name=f'{name} keys',
            legacy_state=lambda v, key=key: legacy_state(v, key=key),
            new_state=lambda m, key=key: nnx_state(m, key=key),
            legacy_groups=lambda s: {'params': s.params, 'opt_state': s.opt_state, 'keys': {'rng': s.rng}},
            new_groups=lambda ts: {**new_side.read_groups(ts), 'keys': {'rng': ts[2][...]}, 'step': None},
        )
        result = harness.check(port, devices=2, **SCREEN)
        assert result.outcome is Outcome.MATCH, (name, words.lines(result.verdict))
        finals[name] = (result.legacy.final['keys']['rng'], result.new.final['keys']['rng'])
    raw, typed = finals['raw'], finals['typed']
    assert raw[0].dtype == typed[0].dtype == typed[1].dtype == jnp.uint32 and typed[0].shape == (2,), typed
    assert (raw[0] == typed[0]).all() and (raw[1] == typed[1]).all() and (typed[0] == typed[1]).all()


def test_groups_the_port_maps_without_its_step_counter_leave_it_out_said_not_a_mismatch():
    """A port whose ``legacy_groups`` read its parameters and optimizer state but not its step counter (a
    ``global_step`` field, which the report then lists as not compared): the report had also called it a
    bookkeeping MISMATCH, ``step only on the new side ... map the field`` (issue 60: a report must not say both).
    The counter is left out on both sides and said, as for a state that holds none; the negative control, a
    learning rate off, still fails."""
    require_devices(2)
    port = dataclasses.replace(STRUCT, name='unmapped step',
                               legacy_groups=lambda s: {'params': s.params, 'opt_state': s.opt_state})  # fmt: skip
    result = harness.check(port, devices=2, **SCREEN)
    assert result.outcome is Outcome.MATCH, words.lines(result.verdict)
    assert ('step', Skip.NO_STEP) in skipped(result.notes), result.notes
    slipped = dataclasses.replace(port, new_state=lambda m: nnx_state(m, lr=0.0505))
    assert not harness.check(slipped, devices=2, diagnose=False, **SCREEN).report.match


@flax.struct.dataclass
class Renamed:
    """A state whose fields the comparison cannot read by name: no ``params``, no ``opt_state``."""

    weights: Any
    moments: Any
    rng: jax.Array


def renamed_state(variables: dict) -> Renamed:
    return Renamed(weights=variables['params'], moments=tx().init(variables['params']), rng=KEY0)


def renamed_step(state: Renamed, batch):
    new, out = legacy_step(State(state.weights, state.moments, state.rng), batch)
    return Renamed(new.params, new.opt_state, new.rng), out


def test_a_state_the_comparison_cannot_read_is_refused_before_training(monkeypatch):
    require_devices(2)

    def trained(*args, **kwargs):
        raise AssertionError('a training step ran before the unreadable state was reported')

    monkeypatch.setattr(step_side.StepLegacySetup, 'call', trained)
    monkeypatch.setattr(step_side.StepNewSetup, 'call', trained)
    port = dataclasses.replace(STRUCT, legacy_state=renamed_state, legacy_step=renamed_step)
    with pytest.raises(preflight.PreflightError) as e:
        harness.check(port, devices=2, **QUICK)
    text = str(e.value)
    assert 'legacy_state returns a Renamed, which the comparison cannot read' in text and '\n' not in text, text
    assert 'legacy_groups=' in text, text
    # Given legacy_groups=, the same state is read and trains (positive control of the refusal).
    read = dataclasses.replace(port, legacy_groups=lambda s: {'params': s.weights, 'opt_state': s.moments})
    preflight.check(kinds.of(read), harness_config(read))


def harness_config(port: LoopPort):
    from equivalence.core.port.config import RunConfig

    return RunConfig(workload=port.name, devices=2, batch_size=port.default_batch, rng_mode='global', **QUICK)


class Holder(nnx.Module):
    """An NNX train state under names the suite does not look for (no .model, no .optimizer)."""

    def __init__(self, model):
        self.net, self.opt, self.key = nnx_state(model)


@nnx.jit
def holder_step(ts: Holder, batch):
    return one_step((ts.net, ts.opt, ts.key), batch)


def test_an_nnx_train_state_the_comparison_cannot_read_is_refused_before_training():
    require_devices(2)
    port = dataclasses.replace(STRUCT, new_state=Holder, new_step=holder_step)
    with pytest.raises(preflight.PreflightError, match="port 'struct state': new_state returns what the comparison"):
        preflight.check(kinds.of(port), harness_config(port))


def test_fields_that_the_ports_own_groups_read_are_not_said_to_be_left_out():
    """With ``legacy_groups=`` reading ``weights`` and ``moments``, the report said 'not compared:
    moments: tuple (... arrays): no NNX counterpart the suite reads (give legacy_groups=, ...)' on every
    run, though those leaves were compared. What the groups read is compared; only the rest is listed."""
    require_devices(2)
    port = dataclasses.replace(
        STRUCT,
        legacy_state=renamed_state,
        legacy_step=renamed_step,
        legacy_groups=lambda s: {'params': s.weights, 'opt_state': s.moments},
        new_groups=lambda ts: {**new_side.read_groups(ts), 'step': None},
    )  # no counter: SGD
    result = harness.check(port, devices=2, verdict='screen', **QUICK)
    assert result.outcome is Outcome.MATCH, words.lines(result.verdict)
    said = {subject: why for subject, why in skipped(result.notes)}
    assert 'weights' not in said and 'moments' not in said and said.get('rng') is Skip.KEY, said  # what is not read
