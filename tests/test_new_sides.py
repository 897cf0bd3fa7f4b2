"""The new side as real teams write it, with no wrapper and no ``*_groups=``: functional NNX in a flax
``TrainState`` (``graphdef`` + ``nnx.State``, ``jax.jit``, the key by keyword), and linen under
``jax.jit`` over a dict of linen parameters and optax state, with no NNX model at all. Each matches
and each one-constant slip does not; the pre-flight hands the step the real pytree; the old field
names still build the same port."""

import dataclasses
import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from equivalence import LoopPort
from equivalence.core import harness, kinds, preflight
from equivalence.core.compare.findings import Twins
from equivalence.core.compare.outcome import Outcome
from equivalence.core.port.config import ConfigError, RunConfig
from equivalence.core.report import render, words
from equivalence.core.run import adapters
from equivalence.core.run import inputs as made
from equivalence.core.run.nudge import DRAWS
from equivalence.core.state import new_side, states

AXIS, FEATURES, HIDDEN, RATE = 'batch', 4, 8, 0.2
QUICK = {'steps_per_call': 2, 'calls': 2}


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        h = nn.Dropout(RATE, deterministic=not train)(nn.relu(nn.Dense(HIDDEN)(x)))
        return nn.Dense(1)(h)


class NnxMLP(nnx.Module):
    """Dropout keys given at call time (``rngs=``), as flax's functional NNX examples do."""

    def __init__(self, rngs: nnx.Rngs):
        self.Dense_0, self.Dense_1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, 1, rngs=rngs)
        self.dropout = nnx.Dropout(RATE)

    def __call__(self, x, rngs=None):
        return self.Dense_1(self.dropout(nnx.relu(self.Dense_0(x)), rngs=rngs))


def make_data(rng, n_steps, batch):
    x = rng.normal(size=(n_steps, batch, FEATURES)).astype('float32')
    return {'x': x, 'y': x.sum(-1, keepdims=True).astype('float32')}


def learning_rate_fn(step):
    return 0.05 * jnp.minimum(1.0, (step + 1) / 2)


def tx(b2=0.98):
    return optax.adam(learning_rate_fn, b2=b2)


# -- the pmap side: a flax TrainState, the key as dropout_rng= ----------------------------------------


def legacy_step(state, batch, learning_rate_fn, dropout_rng=None):
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        pred = state.apply_fn({'params': params}, batch['x'], rngs={'dropout': dropout_rng})
        return jnp.mean((pred - batch['y']) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    state = state.apply_gradients(grads=jax.lax.pmean(grads, AXIS))
    return state, {'loss': jax.lax.pmean(loss, AXIS), 'learning_rate': learning_rate_fn(state.step)}


def legacy_state(variables):
    return train_state.TrainState.create(apply_fn=LinenMLP().apply, params=variables['params'], tx=tx())


# -- (b) functional NNX: TrainState(graphdef, params=nnx.State), jax.jit, dropout_rng= ----------------


class TrainState(train_state.TrainState):
    graphdef: nnx.GraphDef[NnxMLP]


def functional_state(model, b2=0.98):
    """As flax's lm1b_nnx builds it: split off the parameters, TrainState.create, every leaf an array."""
    graphdef, params = nnx.split(model, nnx.Param)
    state = TrainState.create(apply_fn=graphdef.apply, params=params, tx=tx(b2), graphdef=graphdef)
    return jax.tree.map(jnp.asarray, state)


def functional_step(state, batch, learning_rate_fn, label_smoothing=0.0, dropout_rng=None):
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        module = nnx.merge(state.graphdef, params)
        pred = module(batch['x'], rngs=nnx.Rngs(dropout=dropout_rng))
        return jnp.mean((pred - batch['y']) ** 2)

    lr = learning_rate_fn(state.step + 1)
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {'loss': loss, 'learning_rate': lr}


jit_functional_step = jax.jit(functional_step, static_argnames=('learning_rate_fn', 'label_smoothing'))

# -- (c) linen + jax.jit: {'params', 'opt_state'}, no NNX model -------------------------------------


def linen_jit_state(variables, b2=0.98):
    return {'params': variables['params'], 'opt_state': tx(b2).init(variables['params'])}


def linen_jit_step(state, batch, dropout_rng, b2=0.98):
    count = state['opt_state'][0].count
    key = jax.random.fold_in(dropout_rng, count)

    def loss_fn(params):
        pred = LinenMLP().apply({'params': params}, batch['x'], rngs={'dropout': key})
        return jnp.mean((pred - batch['y']) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state['params'])
    updates, opt_state = tx(b2).update(grads, state['opt_state'], state['params'])
    new = {'params': optax.apply_updates(state['params'], updates), 'opt_state': opt_state}
    return new, {'loss': loss, 'learning_rate': learning_rate_fn(count + 1)}


BASE = dict(legacy_model=LinenMLP, make_data=make_data, legacy_state=legacy_state, step_form='state_rng',
            legacy_step=functools.partial(legacy_step, learning_rate_fn=learning_rate_fn), rng_arg='dropout_rng',
            loss='loss', init_args=lambda b: (b['x'], False), default_batch=8, rng_modes=('global',))  # fmt: skip
FUNCTIONAL = LoopPort(
    name='functional-nnx',
    nnx_model=lambda rngs: NnxMLP(rngs),
    new_state=functional_state,
    new_step=functools.partial(jit_functional_step, learning_rate_fn=learning_rate_fn, label_smoothing=0.0),
    **BASE,
)
LINEN_JIT = LoopPort(name='linen-jit', new_state=linen_jit_state, new_step=jax.jit(linen_jit_step), **BASE)
SLIPS = {  # Adam's b2 left at optax's default 0.999 on the new side, where the pmap side says 0.98
    'functional-nnx': dataclasses.replace(FUNCTIONAL, new_state=functools.partial(functional_state, b2=0.999)),
    'linen-jit': dataclasses.replace(LINEN_JIT, new_state=functools.partial(linen_jit_state, b2=0.999),
                                     new_step=jax.jit(functools.partial(linen_jit_step, b2=0.999))),
}  # fmt: skip


@pytest.fixture(scope='module')
def results():
    require_devices(2)
    # The fixed screen: the forms are the subject here, not the verdict (the slips get the measured one)
    return {port.name: harness.check(port, devices=2, verdict='screen', **QUICK) for port in (FUNCTIONAL, LINEN_JIT)}


@pytest.mark.parametrize('name', ['functional-nnx', 'linen-jit'])
def test_each_new_side_matches_as_written_and_its_slip_does_not(results, name):
    result = results[name]
    assert result.report.match, [leaf for leaf in result.report.leaves if not leaf.ok]
    names = {leaf.name for leaf in result.report.leaves}
    assert {'params/Dense_0/kernel', 'opt_state/0/nu/Dense_1/bias', 'metrics/learning_rate'} <= names, names
    assert not any(n.endswith('/value') for n in names), names  # nnx.Variables read as their arrays
    said = render.header(result, 'cpu')  # a new side with no NNX model is not called NNX
    assert (' vs NNX new_step x K on ' in said) == (name == 'functional-nnx'), said
    assert (' vs new_step x K (linen, jax.jit) on ' in said) == (name == 'linen-jit'), said
    slipped = harness.check(SLIPS[name], devices=2, diagnose=False, **QUICK)
    assert not slipped.report.match
    # judged by a measured floor: the twin builds the new side as the run does (linen's variables
    # where the port has no NNX model), not the fixed screen's 'unmeasured'
    assert slipped.report.floor is not None and slipped.verdict.twin == Twins(DRAWS), words.lines(slipped.verdict)
    assert any(leaf.name.startswith('opt_state/0/nu/') and not leaf.ok for leaf in slipped.report.leaves)


def test_the_counter_is_read_where_it_lives(results):
    """A TrainState's own ``step``; a dict's, its optimizer state's ``count``, and the report says so."""
    assert 'step/step' in {leaf.name for leaf in results['functional-nnx'].report.leaves}
    assert 'step/step' in {leaf.name for leaf in results['linen-jit'].report.leaves}
    assert 'step: the new train state has no step field; its counter is opt_state/0/count' in (
        results['linen-jit'].notes
    )
    notes = results['functional-nnx'].notes
    said = {(n.subject, n.skip, n.side) for n in notes if isinstance(n, states.Uncompared)}
    assert ('graphdef', states.Skip.STATIC, 'new') in said, notes


def test_the_preflight_hands_the_step_its_real_pytree():
    """A TrainState's plain-array ``step`` reaches the traced step as an array (a tracer), never as a
    ShapeDtypeStruct: what ``jax.jit`` would hand it. No training runs."""
    seen = []

    def step(state, batch, learning_rate_fn, label_smoothing=0.0, dropout_rng=None):
        seen.append(state.step)  # fold_in(dropout_rng, state.step) inside needs an array
        return functional_step(state, batch, learning_rate_fn, label_smoothing, dropout_rng)

    port = dataclasses.replace(FUNCTIONAL, new_step=functools.partial(step, learning_rate_fn=learning_rate_fn))
    config = RunConfig(workload=port.name, devices=2, available=len(jax.devices()), batch_size=8,
                       rng_mode='global', **QUICK)  # fmt: skip
    preflight.check(kinds.of(port), config)
    assert seen and all(isinstance(s, jax.Array) for s in seen), seen


def test_the_new_side_is_read_without_groups():
    model = NnxMLP(nnx.Rngs(0))
    groups = new_side.read_groups(functional_state(model))
    assert set(groups['params']) == {'Dense_0', 'Dense_1'} and set(groups['params']['Dense_0']) == {'kernel', 'bias'}
    assert isinstance(groups['params']['Dense_0']['kernel'], jax.Array) and groups['step'] == {'step': 0}
    variables = LinenMLP().init(jax.random.PRNGKey(0), jnp.ones((1, FEATURES)), False)
    groups = new_side.read_groups(linen_jit_state(variables))
    assert int(groups['step']['step']) == 0 and 'Dense_0' in groups['params']
    with pytest.raises(TypeError, match='give the port new_groups='):
        new_side.read_groups({'weights': groups['params']})
    # a tuple (params, opt_state), as the pmap side reads one (AlgoPerf keeps its state so on both sides)
    pair = new_side.read_groups((variables['params'], tx().init(variables['params'])))
    assert jax.tree.structure(pair) == jax.tree.structure(groups) and int(pair['step']['step']) == 0
    with pytest.raises(TypeError, match=r'or be a tuple \(params, opt_state\); got tuple'):
        new_side.read_groups((variables['params'], None, None))


def test_a_tuple_new_state_is_run_as_written():
    """The user's step gets its tuple back as it returned it; the report reads it as the dict form."""

    def tuple_step(state, batch, dropout_rng, b2=0.98):
        new, out = linen_jit_step({'params': state[0], 'opt_state': state[1]}, batch, dropout_rng, b2)
        return (new['params'], new['opt_state']), out

    def tuple_state(variables):
        state = linen_jit_state(variables)
        return state['params'], state['opt_state']

    port = dataclasses.replace(LINEN_JIT, name='linen-jit-tuple', new_state=tuple_state, new_step=jax.jit(tuple_step))
    result = harness.check(port, devices=2, verdict='screen', **QUICK)
    assert result.report.match, [leaf for leaf in result.report.leaves if not leaf.ok]
    assert {'params/Dense_0/kernel', 'opt_state/0/nu/Dense_1/bias'} <= {leaf.name for leaf in result.report.leaves}
    # the negative control: the same step with Adam's b2 at optax's default, 0.999
    slipped = dataclasses.replace(port, new_step=jax.jit(functools.partial(tuple_step, b2=0.999)))
    assert not harness.check(slipped, devices=2, diagnose=False, **QUICK).report.match


def test_the_old_field_names_build_the_same_port_and_warn_with_the_new_name():
    with pytest.warns(DeprecationWarning, match='LoopPort field nnx_state is now new_state') as said:
        old = LoopPort(name='old-names', nnx_model=lambda rngs: NnxMLP(rngs), nnx_state=functional_state,
                       nnx_step=FUNCTIONAL.new_step, **BASE)  # fmt: skip
    assert any('nnx_step is now new_step' in str(w.message) for w in said)
    with pytest.warns(DeprecationWarning, match='use new_state='):
        assert old.new_state is functional_state and old.nnx_state is functional_state
    with pytest.warns(DeprecationWarning, match='use new_step='):
        assert old.new_step is FUNCTIONAL.new_step and old.nnx_step is FUNCTIONAL.new_step
    other = functools.partial(functional_state, b2=0.9)
    with pytest.warns(DeprecationWarning):
        assert dataclasses.replace(old, nnx_state=other).new_state is other
        assert dataclasses.replace(old, new_state=other).nnx_state is other
    assert dataclasses.replace(old, name='renamed').new_state is functional_state
    with warnings.catch_warnings():  # the new names warn of nothing (the control)
        warnings.simplefilter('error')
        LoopPort(name='new-names', nnx_model=lambda rngs: NnxMLP(rngs), new_state=functional_state,
                 new_step=FUNCTIONAL.new_step, **BASE)  # fmt: skip


def pinned_step(inputs: bool = True):
    """``linen_jit_step`` as benchmark code jits it: shardings on a mesh of every device, built once; with
    ``inputs=False`` pinned by its ``out_shardings`` alone (a vision codebase's first jit trainer)."""
    mesh = Mesh(np.array(jax.devices()), ('batch',))
    replicated, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P('batch'))
    if not inputs:
        return jax.jit(linen_jit_step, out_shardings=(replicated, replicated))
    return jax.jit(linen_jit_step, in_shardings=(replicated, rows, replicated), out_shardings=(replicated, replicated))


def test_the_new_step_gets_its_key_as_it_takes_it():
    """By keyword where ``functools.partial`` left it keyword-only; third where it is the third
    parameter (a ``jax.jit`` with ``in_shardings`` takes no keyword arguments); as ``new_rng_arg`` says."""
    assert adapters.new_rng_keyword(FUNCTIONAL) == 'dropout_rng'
    assert adapters.new_rng_keyword(dataclasses.replace(LINEN_JIT, new_step=pinned_step())) is None
    assert adapters.new_rng_keyword(dataclasses.replace(LINEN_JIT, new_rng_arg='key')) == 'key'


@pytest.mark.parametrize('inputs', [True, False], ids=['in-and-out-shardings', 'out-shardings-only'])
def test_a_step_pinned_to_every_device_run_on_fewer_is_the_ports_one_line(inputs):
    """Not 'a bug in this suite' (exit 3): the port's, exit 2, with the two ways to run it. No pmap runs.
    Pinned by its ``out_shardings`` alone, JAX says 'incompatible devices' instead: the same line."""
    require_devices(4)
    port = dataclasses.replace(LINEN_JIT, new_step=pinned_step(inputs))
    config = RunConfig(workload=port.name, devices=2, batch_size=8, rng_mode='global', **QUICK)
    fed = made.make(port, config)
    calls, rng = fed.calls, fed.rng
    setup = kinds.of(port).new_setup(config, fed)
    _, args = setup.call_args(rng, calls[0])
    seen = len(jax.devices())
    with pytest.raises(ConfigError, match=f'new_step is a jax.jit pinned to its own shardings .* --devices {seen}'):
        setup.call(args)


def test_a_port_without_an_nnx_model_keeps_linen_names_and_needs_its_new_state():
    with pytest.raises(ConfigError, match='names pairs linen with NNX names'):
        dataclasses.replace(LINEN_JIT, names={'Dense_0': 'fc1'})
    with pytest.raises(ConfigError, match='new_state is missing'):
        LoopPort(name='no-state', new_step=LINEN_JIT.new_step, **BASE)


def created_outside_jit(model):
    """lm1b_nnx's state as its ``TrainState.create`` line builds it, outside any ``jax.jit``: ``step`` stays
    the Python int ``0`` (flax's own example converts it only because its set-up is jitted)."""
    graphdef, params = nnx.split(model, nnx.Param)
    return TrainState.create(apply_fn=graphdef.apply, params=params, tx=tx(), graphdef=graphdef)


def rsqrt_schedule(init_value: float, shift: int = 0):
    def schedule(count):
        return init_value * (count + shift) ** -0.5 * shift**0.5

    return schedule


# lm1b_nnx's create_learning_rate_schedule: a linear warmup, then rsqrt; a Python step 0 raises in the rsqrt
# ('0.0 cannot be raised to a negative power'), which jax.jit never hands it
LM1B_SCHEDULE = optax.join_schedules(
    [optax.linear_schedule(0.0, 0.05, transition_steps=2), rsqrt_schedule(0.05, shift=2)], boundaries=[2]
)


def lm1b_step(state, batch, learning_rate_fn, label_smoothing=0.0, dropout_rng=None):
    """flax's examples/lm1b_nnx ``train_step`` as upstream writes it, not jitted here (upstream jits it where it
    calls it): the learning rate of ``state.step`` before the update."""
    lr = learning_rate_fn(state.step)
    new_state, metrics = functional_step(state, batch, learning_rate_fn, label_smoothing, dropout_rng)
    return new_state, {'loss': metrics['loss'], 'learning_rate': lr}


def test_a_train_state_created_outside_jit_with_a_python_step_is_placed_and_matches():
    """It ended in exit 3: placing the state read ``.dtype`` of the int; then (issue 51) lm1b_nnx's own step,
    handed over as upstream writes it (not jitted, a warmup-rsqrt schedule of ``state.step``), exit 2
    'new_step raised ZeroDivisionError: 0.0 cannot be raised to a negative power ... this is in the port':
    upstream jits it, so its schedule never sees a Python 0. A Python scalar of the state is handed to the
    step as ``jax.jit`` hands it, an array; the runs match."""
    require_devices(2)
    assert created_outside_jit(NnxMLP(nnx.Rngs(0))).step == 0  # the form under test: a plain int
    with pytest.raises(ZeroDivisionError):  # upstream's schedule on a Python 0: what jax.jit never gives it
        LM1B_SCHEDULE(0)
    lm1b = dataclasses.replace(
        FUNCTIONAL,
        name='lm1b-step-as-written',
        new_state=created_outside_jit,
        new_step=functools.partial(lm1b_step, learning_rate_fn=LM1B_SCHEDULE),
        legacy_step=functools.partial(legacy_step, learning_rate_fn=lambda step: LM1B_SCHEDULE(step - 1)),
    )  # the pmap side reports the rate of its updated step: of the step before it, as lm1b_step does
    # lm1b's port is the plain functional one with its state created outside jit (and its schedule): the one check
    result = harness.check(lm1b, devices=2, verdict='screen', **QUICK)
    assert result.outcome is Outcome.MATCH, words.lines(result.verdict)
    assert {'step/step', 'metrics/learning_rate'} <= {leaf.name for leaf in result.report.leaves}


def resharded_state(variables):
    """Upstream's own state code, which needs concrete arrays: a reshard helper that rebuilds every leaf
    from its single-device shards (``jax.make_array_from_single_device_arrays``), as a vision codebase's
    first jit trainer does. Under ``jax.eval_shape`` it raises ('requires a list of concrete arrays')."""

    def reshard(a):
        a = jnp.asarray(a)
        return jax.make_array_from_single_device_arrays(a.shape, a.sharding, [s.data for s in a.addressable_shards])

    return jax.tree.map(reshard, linen_jit_state(variables))


def test_a_new_state_that_needs_concrete_arrays_is_built_for_real_by_the_preflight():
    """It ended in exit 2 ('new_state raised ValueError: ... requires a list of concrete arrays'), for code
    that runs as it is in upstream's own trainer: traced abstractly first, the pre-flight builds it for
    real where tracing cannot (docs/port.md). A new_state that is wrong when run for real is still the
    port's one line (the control)."""
    require_devices(2)
    port = dataclasses.replace(LINEN_JIT, name='resharded', new_state=resharded_state)
    result = harness.check(port, devices=2, verdict='screen', **QUICK)
    assert result.outcome is Outcome.MATCH, words.lines(result.verdict)

    def broken(variables):
        resharded_state(variables)
        raise KeyError('opt_state')  # wrong for real too

    with pytest.raises(preflight.PreflightError, match=r"new_state raised KeyError: 'opt_state' at test_new_sides.py"):
        harness.check(dataclasses.replace(port, new_state=broken), devices=2, **QUICK)
