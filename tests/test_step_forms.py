"""Real steps as teams wrote them, without wrappers: each accepted form matches, and each has a
negative control (the same port with one slip) that the suite catches. The not-compared listing
of a flax TrainState, and the refusals of forms that do not fit together."""

import dataclasses
import functools
import os
import re
import types

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import ROOT, require_devices
from flax import nnx
from flax.training import train_state

from equivalence import LoopPort
from equivalence.core import harness, kinds
from equivalence.core.compare.findings import Twins
from equivalence.core.port.config import ConfigError
from equivalence.core.report import render, words
from equivalence.core.run import adapters, step_side
from equivalence.core.run.nudge import DRAWS
from equivalence.core.state import states
from equivalence.core.state.states import Skip

AXIS, FEATURES, HIDDEN = 'batch', 4, 8
QUICK = {'steps_per_call': 2, 'calls': 2}


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        h = nn.Dropout(0.2, deterministic=not train)(nn.relu(nn.Dense(HIDDEN)(x)))
        return nn.Dense(1)(h)


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, rate: float = 0.2):
        self.Dense_0, self.Dense_1 = nnx.Linear(FEATURES, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, 1, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)

    def __call__(self, x):
        return self.Dense_1(self.drop(nnx.relu(self.Dense_0(x))))


class KeyedState(train_state.TrainState):
    rng: jax.Array = None  # the key inside the state


def make_data(rng, n_steps, batch):
    x = rng.normal(size=(n_steps, batch, FEATURES)).astype('float32')
    return {'x': x, 'y': x.sum(-1, keepdims=True).astype('float32')}


def tx(lr=0.05):
    return optax.sgd(lr, momentum=0.9)


def legacy_state(variables, rng=None):
    return KeyedState.create(apply_fn=LinenMLP().apply, params=variables['params'], tx=tx(), rng=rng)


def train_step(state, batch, rng=None, scale=1.0):
    """A flax-examples step: ``(state, batch[, rng]) -> (state, metrics)``; ``scale`` bound by partial."""
    if rng is None and state.rng is not None:  # the key inside the state
        new_rng, rng = jax.random.split(state.rng)
        state = state.replace(rng=new_rng)
    rngs = {'dropout': jax.random.fold_in(rng, state.step)} if rng is not None else None

    def loss_fn(params):
        pred = state.apply_fn({'params': params}, batch['x'], train=rng is not None, rngs=rngs)
        return jnp.mean((pred - batch['y']) ** 2) * scale, jnp.mean(jnp.abs(pred - batch['y']))

    (loss, mae), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=jax.lax.pmean(grads, AXIS))
    return state, jax.lax.pmean({'loss': loss, 'mae': mae, 'denominator': jnp.float32(2.0)}, AXIS)


def tuple_step(state, batch):
    """The original question's state: a plain tuple ``(params, opt_state)``."""
    params, opt_state = state
    loss_fn = lambda p: jnp.mean((LinenMLP().apply({'params': p}, batch['x'], False) - batch['y']) ** 2)  # noqa: E731
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx().update(jax.lax.pmean(grads, AXIS), opt_state, params)
    metrics = {'loss': jax.lax.pmean(loss, AXIS), 'mae': loss, 'denominator': jnp.float32(2.0)}  # mae: no pmean
    return (optax.apply_updates(params, updates), opt_state), metrics


def dict_step(state, batch):
    """linen + ``jax.jit``'s state: a dict of params and optax state, no counter (a benchmark's port)."""
    params = state['params']

    def loss_fn(p):
        error = LinenMLP().apply({'params': p}, batch['x'], False) - batch['y']
        return jnp.mean(error**2), jnp.mean(jnp.abs(error))

    (loss, mae), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx().update(jax.lax.pmean(grads, AXIS), state['opt_state'], params)
    metrics = jax.lax.pmean({'loss': loss, 'mae': mae, 'denominator': jnp.float32(2.0)}, AXIS)
    return {'params': optax.apply_updates(params, updates), 'opt_state': opt_state}, metrics


def dict_state(variables):
    return {'params': variables['params'], 'opt_state': tx().init(variables['params'])}


def carry_step(carry, batch):
    """score_sde's form, returning a metrics dict."""
    rng, state = carry
    rng, step_rng = jax.random.split(rng)
    state, metrics = train_step(state, batch, step_rng)
    return (rng, state), metrics


# -- the NNX side ----------------------------------------------------------------------------------


def nnx_state(model, lr=0.05):
    return model, nnx.Optimizer(model, tx(lr), wrt=nnx.Param)


def nnx_step_plain(ts, batch, key=None, scale=1.0):
    model, optimizer = ts[:2]
    if key is None and len(ts) == 3:  # the key inside the state
        new, key = jax.random.split(ts[2][...])
        ts[2][...] = new
    if key is not None:
        nnx.reseed(model, dropout=jax.random.fold_in(key, optimizer.step[...]))
    model.train() if key is not None else model.eval()

    def loss_fn(m):
        pred = m(batch['x'])
        return jnp.mean((pred - batch['y']) ** 2) * scale, jnp.mean(jnp.abs(pred - batch['y']))

    (loss, mae), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)
    return {'loss': loss, 'mae': mae, 'denominator': jnp.float32(2.0)}


nnx_train_step = nnx.jit(nnx_step_plain)


@nnx.jit
def nnx_fused(ts, keys, batch_KxG):
    @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
    def body(ts, key, batch):
        return ts, nnx_step_plain(ts, batch, key)

    _, metrics_K = body(ts, keys, batch_KxG)
    return ts, metrics_K


def nnx_carry_call(ts, key, batch_KxG):
    keys = []
    for _ in range(jax.tree.leaves(batch_KxG)[0].shape[0]):
        key, step_key = jax.random.split(key)
        keys.append(step_key)
    return nnx_fused(ts, jnp.stack(keys), batch_KxG)


def three_outputs_step(state, batch):
    """``(state, metrics, logs)``: a trainer's step that returns what it logs beside its metrics (issue 60)."""
    state, metrics = train_step(state, batch)
    return state, metrics, {'learning_rate': jnp.float32(0.05)}


def nnx_three_outputs(ts, batch):
    """The new side's twin of ``three_outputs_step``: ``(train_state, metrics, logs)``."""
    return ts, nnx_train_step(ts, batch), {'learning_rate': jnp.float32(0.05)}


BASE = dict(name='forms', legacy_model=LinenMLP, nnx_model=lambda rngs: NnxMLP(rngs), make_data=make_data,
            legacy_state=legacy_state, new_state=nnx_state, init_args=lambda b: (b['x'], False), default_batch=8,
            rng_modes=('global',))  # fmt: skip
KEY0 = jax.random.PRNGKey(7)
FORMS = {
    'state, steps, no key': LoopPort(**BASE, legacy_step=train_step, step_form='state', loss='loss',
                                     new_step=nnx_train_step),  # fmt: skip
    'state_rng, steps, partial': LoopPort(**BASE, legacy_step=functools.partial(train_step, scale=2.0),
                                          step_form='state_rng', loss=lambda m: m['loss'] / m['denominator'],
                                          new_step=functools.partial(nnx_train_step, scale=2.0)),  # fmt: skip
    'state_rng, scan, fused nnx': LoopPort(**BASE, legacy_step=train_step, step_form='state_rng',
                                           legacy_loop='scan', loss='loss', new_call=nnx_fused),  # fmt: skip
    'key in state': LoopPort(**{**BASE, 'legacy_state': functools.partial(legacy_state, rng=KEY0),
                                'new_state': lambda m: (*nnx_state(m), nnx.Variable(KEY0))},
                             legacy_step=train_step, step_form='state', loss='loss', new_step=nnx_train_step),
    'tuple state': LoopPort(**{**BASE, 'legacy_state': lambda v: (v['params'], tx().init(v['params']))},
                            legacy_step=tuple_step, step_form='state', loss='loss', new_step=nnx_train_step),
    'carry with metrics': LoopPort(**BASE, legacy_step=carry_step, loss='loss', new_call=nnx_carry_call),
    'three outputs': LoopPort(**BASE, legacy_step=three_outputs_step, step_form='state', loss='loss',
                              new_step=nnx_three_outputs),
    # As teams hand them over: the step already pmapped (p_train_step), the state a dict.
    'dict state, pmapped step': LoopPort(**{**BASE, 'legacy_state': dict_state},
                                         legacy_step=jax.pmap(dict_step, axis_name=AXIS), step_form='state',
                                         loss='loss', new_step=nnx_train_step),
}  # fmt: skip
NO_COUNTER = ('tuple state', 'dict state, pmapped step')  # pmap states that hold no step counter


def _slip(port: LoopPort) -> LoopPort:
    """The same port with the NNX learning rate 1% high: a slip every form must catch."""
    slipped = lambda m: (*nnx_state(m, lr=0.0505), *port.new_state(m)[2:])  # noqa: E731
    return dataclasses.replace(port, new_state=slipped)


@pytest.fixture(scope='module')
def results():
    require_devices(2)
    # The fixed screen: the forms are the subject here, not the verdict (each slip gets the measured one)
    return {name: harness.check(port, devices=2, verdict='screen', **QUICK) for name, port in FORMS.items()}


@pytest.mark.parametrize('form', list(FORMS))
def test_each_step_form_matches_its_slip_does_not(results, form):
    result = results[form]
    assert result.report.match, [leaf for leaf in result.report.leaves if not leaf.ok]
    groups = {leaf.group for leaf in result.report.leaves}
    assert {'metrics', 'losses', 'params', 'opt_state', 'step' if form not in NO_COUNTER else 'losses'} <= groups
    assert {'metrics/loss'} <= {leaf.name for leaf in result.report.leaves}
    assert ('metrics/mae' in {leaf.name for leaf in result.report.leaves}) == (form != 'tuple state')
    assert isinstance(result.notes[0], adapters.Ran), result.notes  # how the step ran, first
    slipped = harness.check(_slip(FORMS[form]), devices=2, diagnose=False, **QUICK)
    assert not slipped.report.match
    # judged by a measured floor: the twin runs this form's step as the run does
    assert slipped.report.floor is not None and slipped.verdict.twin == Twins(DRAWS), words.lines(slipped.verdict)


def test_a_step_that_takes_no_key_is_not_said_to_get_per_device_keys(results):
    """The header said 'rng per-device' for a port whose key lives in its train state; a step handed its key
    says its mode (the control)."""
    assert 'rng none handed (the step keeps its key in its state)' in render.header(
        results['state, steps, no key'], 'cpu'
    )
    assert ', rng global,' in render.header(results['state_rng, scan, fused nnx'], 'cpu')


def skipped(notes: list) -> set:
    """``(subject, why)`` of each ``not compared`` line of a result's notes (``states.Uncompared``)."""
    return {(n.subject, n.skip) for n in notes if isinstance(n, states.Uncompared)}


def test_a_step_returning_more_than_state_and_out_is_run_and_what_follows_out_said_not_compared(results):
    """``(state, metrics, logs)`` was refused ('returned a tuple of 3', issue 60); now its logs, on each side,
    are one ``not compared`` line, and the metrics are compared (the form's MATCH and slip: above)."""
    assert {
        ('legacy_step outputs after the second (1)', Skip.EXTRA_OUTPUT),
        ('new_step outputs after the second (1)', Skip.EXTRA_OUTPUT),
    } <= skipped(results['three outputs'].notes)
    assert not {s for _, s in skipped(results['state, steps, no key'].notes)} & {Skip.EXTRA_OUTPUT}  # the control


def test_a_flax_train_state_lists_what_it_does_not_compare(results):
    notes = results['key in state'].notes
    assert {('apply_fn', Skip.STATIC), ('tx', Skip.STATIC), ('rng', Skip.KEY)} <= skipped(notes), notes
    assert [n.legacy_loop for n in notes if isinstance(n, adapters.Ran)] == ['steps'], notes
    assert [n.legacy_loop for n in results['state_rng, scan, fused nnx'].notes if isinstance(n, adapters.Ran)] == [
        'scan'
    ]
    # The report's header says how each side ran, not the suite's own pmap(scan) loop.
    assert ': legacy pmap(step) x K vs NNX ' in render.header(results['key in state'], 'cpu')
    fused = results['state_rng, scan, fused nnx']
    assert ': legacy pmap(scan) vs NNX new_call on 2 ' in render.header(fused, 'cpu')
    for form in NO_COUNTER:
        assert ('step', Skip.NO_STEP) in skipped(results[form].notes), results[form].notes
    # A metric the step does not pmean differs between devices: named, not compared as if global.
    assert ('metrics/mae', Skip.PER_DEVICE) in skipped(results['tuple state'].notes)


def test_artefacts_as_handed_over_are_read_and_said(results):
    """A dict state ``{'params', 'opt_state'}`` reads like a TrainState with no ``legacy_groups=`` (its
    other keys listed, not dropped), and a step already pmapped (``p_train_step``) runs what it wraps,
    which the report says."""
    notes = results['dict state, pmapped step'].notes
    ran = [(n.step, n.scanned, n.axis_name) for n in notes if isinstance(n, adapters.Wrapped)]
    assert ran == [('dict_step', False, 'batch')], notes
    groups = states.legacy_groups({'params': {'w': 1.0}, 'opt_state': (), 'rng': KEY0})
    assert groups['params'] == {'w': 1.0} and groups['step'] is None, groups
    assert skipped(states.legacy_not_compared({'params': {}, 'opt_state': (), 'rng': KEY0})) == {('rng', Skip.KEY)}


def test_a_pmapped_scan_is_run_as_the_step_it_wraps():
    """score_sde's own ``p_train_step = pmap(partial(lax.scan, train_step))`` given as a carry port's
    ``legacy_step``: the pre-flight passes it (it once said 'give the step itself'), and the suite runs
    ``train_step`` under its own pmap(scan), as it runs the step given bare."""
    from equivalence.core import preflight
    from equivalence.core.port.config import RunConfig

    p_train_step = jax.pmap(functools.partial(jax.lax.scan, carry_step), axis_name=AXIS, donate_argnums=1)
    port = dataclasses.replace(FORMS['carry with metrics'], legacy_step=p_train_step)
    preflight.check(kinds.of(port), RunConfig(workload=port.name, devices=2, batch_size=8, rng_mode='global', **QUICK))
    assert adapters.legacy_step(port) is carry_step
    [wrapped] = adapters.wrapped_notes(port)
    assert (wrapped.step, wrapped.scanned, wrapped.axis_name) == ('carry_step', True, 'batch'), wrapped


def keyed_step(state, batch, rng):
    """Upstream's ``(state, batch, rng)`` step, its key required."""
    return train_step(state, batch, rng)


def test_a_pmapped_keyed_step_without_step_form_is_told_the_step_form_that_runs_it():
    """``jax.pmap(step(state, batch, rng))`` handed over with no ``step_form`` was told to pass ``__wrapped__``
    called as the carry form, which it is not: the line names ``step_form='state_rng'``, and with it the port
    builds, passes the pre-flight and runs the step it wraps (the positive control)."""
    from equivalence.core import preflight
    from equivalence.core.port.config import RunConfig

    p_train_step = jax.pmap(keyed_step, axis_name=AXIS)
    with pytest.raises(ConfigError) as e:
        LoopPort(**BASE, legacy_step=p_train_step, loss='loss', new_call=nnx_carry_call)  # no step_form
    line = str(e.value)
    assert 'legacy_step (test_step_forms.py:' in line and "is keyed_step(state, batch, rng), already jax.pmap'd" in line
    assert "give step_form='state_rng'" in line and '__wrapped__' not in line and '\n' not in line, line
    port = LoopPort(**BASE, legacy_step=p_train_step, step_form='state_rng', loss='loss', new_step=nnx_train_step)
    preflight.check(kinds.of(port), RunConfig(workload=port.name, devices=2, batch_size=8, rng_mode='global', **QUICK))
    assert adapters.legacy_step(port) is keyed_step


def variables_state(variables):
    """``TrainState.create(params=variables)``: linen's whole variables, ``{'params': ...}``, as params."""
    return KeyedState.create(apply_fn=LinenMLP().apply, params=variables, tx=tx())


def variables_step(state, batch):
    """Upstream's step over such a state: ``apply_fn(state.params, ...)``; the momentum holds ``{'params': ...}``."""
    loss_fn = lambda v: jnp.mean((state.apply_fn(v, batch['x'], train=False) - batch['y']) ** 2)  # noqa: E731
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=jax.lax.pmean(grads, AXIS)), {'loss': jax.lax.pmean(loss, AXIS)}


def test_a_state_whose_params_are_linens_whole_variables_is_read_as_its_parameters():
    """The pre-flight refused it ('params' holds ``params/Dense_0/kernel``...), and its optimizer state's slots held
    a ``params`` level the new side's do not: both are read without that level, and the port matches."""
    port = LoopPort(**{**BASE, 'legacy_state': variables_state}, legacy_step=variables_step, step_form='state',
                    loss='loss', new_step=nnx_train_step)  # fmt: skip
    result = harness.check(port, devices=2, verdict='screen', **QUICK)
    assert result.report.match, [leaf for leaf in result.report.leaves if not leaf.ok]
    names = {leaf.name for leaf in result.report.leaves}
    assert {'params/Dense_0/kernel', 'opt_state/0/trace/Dense_0/kernel'} <= names, names


def _upstream_train_step(state, batch, rng, train_frac):
    """An upstream step taking ``train_frac`` (its loss weighed by it), returning its key as NeRF steps do."""
    return (*train_step(state, batch, rng, 1 - train_frac), jax.random.split(rng)[0])


@nnx.jit
def _nnx_train_step(model, optimizer, batch, rng, train_frac):
    return nnx_step_plain((model, optimizer), batch, rng, 1 - train_frac)


def _guide_block(marker: str) -> str:
    """The Python block of docs/port.md that follows ``marker``."""
    with open(os.path.join(ROOT, 'docs', 'port.md')) as f:
        return f.read().split(marker, 1)[1].split('```python\n', 1)[1].split('```', 1)[0]


def test_the_guides_step_number_from_the_state_runs_and_its_slip_is_caught():
    """docs/port.md's wrapper of an upstream step that takes ``train_frac`` (the step number) as an argument: each
    side reads it from its train state's counter, and the port matches; the same port with ``train_frac`` a
    constant on the new side, as a port without the step number had to write it, does not (the control)."""
    names = {'jnp': jnp, 'upstream_train_step': _upstream_train_step, 'nnx_train_step': _nnx_train_step}
    exec(_guide_block('<!-- tested: tests/test_step_forms.py -->'), names)
    names['MAX_STEPS'] = 4  # train_frac 0, 1/4, 1/2, 3/4 over the check's 4 steps
    port = LoopPort(**BASE, legacy_step=names['legacy_step'], step_form='state_rng', loss='loss',
                    new_step=names['new_step'])  # fmt: skip
    assert harness.check(port, devices=2, verdict='screen', **QUICK).report.match
    constant = dataclasses.replace(
        port, new_step=lambda ts, batch, rng: (ts, names['nnx_train_step'](*ts, batch, rng, 0.0))
    )
    assert not harness.check(constant, devices=2, verdict='screen', **QUICK).report.match


def test_a_step_that_takes_its_key_first_is_called_so():
    """google-research/vdm's ``train_step(self, base_rng, state, batch)``, bound: ``rng_arg`` naming the first
    parameter calls it ``legacy_step(rng, state, batch)`` (by keyword the state landed on the key: a port
    tried blind needed a wrapper); the pre-flight traces it so."""
    from equivalence.core import preflight
    from equivalence.core.port.config import RunConfig

    def first(base_rng, state, batch):
        return train_step(state, batch, base_rng)

    port = dataclasses.replace(FORMS['state_rng, scan, fused nnx'], legacy_step=first, rng_arg='base_rng')
    preflight.check(kinds.of(port), RunConfig(workload=port.name, devices=2, batch_size=8, rng_mode='global', **QUICK))
    seen = []
    spy = dataclasses.replace(port, legacy_step=lambda base_rng, state, batch: seen.append((base_rng, state, batch)))
    adapters.one_step(spy)('state', 'batch', 'key')
    assert seen == [('key', 'state', 'batch')]


def test_a_key_named_third_by_rng_arg_is_taken_by_that_name():
    """``train_step(state, batch, dropout_rng)`` with ``rng_arg='dropout_rng'`` (a GPT-2 port's, issue 59): the
    key is handed by name, as flax's wmt step takes it; building the port had refused it ('cannot be called as
    legacy_step(state, batch, dropout_rng=rng): missing a required argument'), binding the state and the batch
    alone."""

    def third(state, batch, dropout_rng):
        return train_step(state, batch, dropout_rng)

    port = dataclasses.replace(FORMS['state_rng, scan, fused nnx'], legacy_step=third, rng_arg='dropout_rng')
    seen = []
    spy = dataclasses.replace(
        port, legacy_step=lambda state, batch, dropout_rng: seen.append((state, batch, dropout_rng))
    )
    adapters.one_step(spy)('state', 'batch', 'key')
    assert seen == [('state', 'batch', 'key')]


def test_a_key_named_by_rng_arg_beside_other_arguments_is_passed_by_name():
    """google-research/diffusion_distillation's ``step_fn(base_rng, train, state, batch, learning_rate_mult=1.)``:
    with ``train`` bound (``functools.partial(step_fn, train=True)``, which leaves state and batch keyword-only),
    ``rng_arg='base_rng'`` hands the key by that name and the state and batch by theirs, the step's two other
    parameters without a default (it needed a wrapper: issue 51). With ``train`` unbound, which of three is the
    state the port cannot tell: one line, at build, saying to bind it."""
    from equivalence.core import preflight
    from equivalence.core.port.config import RunConfig

    def step_fn(base_rng, train, state, batch, learning_rate_mult=1.0):
        return train_step(state, batch, base_rng if train else None, scale=learning_rate_mult)

    port = dataclasses.replace(FORMS['state_rng, scan, fused nnx'], legacy_step=functools.partial(step_fn, train=True),
                               rng_arg='base_rng')  # fmt: skip
    preflight.check(kinds.of(port), RunConfig(workload=port.name, devices=2, batch_size=8, rng_mode='global', **QUICK))
    seen = []
    spy = dataclasses.replace(port, legacy_step=lambda base_rng, *, train=True, state, batch: seen.append(
        (base_rng, state, batch)))  # fmt: skip
    adapters.one_step(spy)('state', 'batch', 'key')
    assert seen == [('key', 'state', 'batch')]
    with pytest.raises(ConfigError, match=r'legacy_step .*takes train, state, batch besides its key base_rng: bind'):
        dataclasses.replace(port, legacy_step=step_fn)


def test_forms_that_do_not_fit_together_exit_2_before_any_work():
    port = FORMS['state, steps, no key']
    for bad, message in [
        (dict(step_form='scan'), "step_form 'scan' is not one of"),
        (dict(new_call=nnx_fused), 'exactly one of new_call'),
        (dict(step_form='carry', legacy_loop='steps'), "a 'carry' step returns its key chain"),
    ]:
        with pytest.raises(ConfigError, match=message):
            harness.check(dataclasses.replace(port, **bad), devices=2, **QUICK)
    with pytest.raises(ConfigError, match='explain reads one compiled call per side'):
        kinds.of(port).one_program_each('explain')  # its step runs once per step: no single program to read
    kinds.of(FORMS['state_rng, scan, fused nnx']).one_program_each('explain')


def _state_only(state, batch):
    return train_step(state, batch)[0]  # forgot the metrics


def _other_axis(state, batch):
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn({'params': p}, batch['x'], False) ** 2))(state.params)
    return state.apply_gradients(grads=jax.lax.pmean(grads, 'devices')), {'loss': jnp.float32(0.0)}


def _bare_step(ts):
    """The NNX groups read by hand, the counter left bare (the issue's functional-NNX port)."""
    from equivalence.core.state import convert

    return {**convert.find_nnx_groups(ts), 'step': ts[1].step[...]}


def _nnx_no_opt(ts, batch):
    return ts[0], nnx_step_plain(ts, batch)  # returns the model alone as the new train state


P_TRAIN_STEP = jax.pmap(train_step, axis_name=AXIS)  # upstream's own, pmapped where it is defined


def _adapter_of_a_pmapped_step(state, batch):
    """A small adapter around upstream's pmapped step (the direct form is recognised; this one is not)."""
    state, metrics = P_TRAIN_STEP(state, batch)
    return state, metrics


upstream = types.ModuleType('upstream_train')  # upstream's training module, its pmapped step an attribute
upstream.p_train_step = P_TRAIN_STEP


def _adapter_of_a_pmapped_attribute(state, batch):
    """The same, calling it through its module (``old_train.pmapped_train_step(...)``)."""
    return upstream.p_train_step(state, batch)


@pytest.mark.parametrize(
    'fields, line',
    [
        (dict(legacy_step=_state_only), 'legacy_step returned a KeyedState; expected legacy_step(state, batch)'),
        (
            dict(legacy_step=_adapter_of_a_pmapped_step),
            "legacy_step calls P_TRAIN_STEP, a jax.pmap'd function (test_step_forms.py:",
        ),
        (
            dict(legacy_step=_adapter_of_a_pmapped_attribute),
            "legacy_step calls upstream.p_train_step, a jax.pmap'd function (test_step_forms.py:",
        ),
        (dict(legacy_step=_other_axis), 'legacy_step raised NameError'),
        (dict(loss='los'), "loss 'los' is not in what legacy_step returns (metrics ['denominator', 'loss', 'mae'])"),
        (dict(loss=lambda m: m['loss'][:, None] * jnp.ones(3)), 'legacy_step gives an array of shape [2, 3]'),
        (dict(new_step=nnx.jit(_nnx_no_opt)), 'new_step returned a train state of another structure'),
        (
            dict(new_groups=_bare_step),
            "new_groups gives step as an array of shape []; expected the step group as {'step': counter}",
        ),
        (
            dict(legacy_groups=lambda s: {'params': s.params, 'opt_state': s.opt_state, 'step': s.step}),
            "legacy_groups gives step as an array of shape []; expected the step group as {'step': counter}",
        ),
        (
            dict(legacy_groups=lambda s: {'params': s.params, 'opt_state': s.opt_state, 'step': {'count': s.step}}),
            "legacy_groups gives step as a dict with keys ['count']; expected the step group as {'step': counter}",
        ),
        (
            dict(legacy_groups=lambda s: {'params': {'params': s.params}, 'opt_state': s.opt_state}),
            "legacy_groups 'params' holds 4 leaves, not the model's 4 parameters (missing ['Dense_0/bias', "
            "'Dense_0/kernel'], unexpected ['params/Dense_0/bias', 'params/Dense_0/kernel']); fix: give "
            "legacy_groups= whose 'params' is the model's parameters by module",
        ),
        (
            dict(legacy_groups=lambda s: {'params': s.params, 'model_state': {'Dense_0': {'mean': s.step}}}),
            "legacy_groups gives model_state as a dict with keys ['Dense_0']; expected linen's collections by name",
        ),
        (
            dict(
                legacy_state=lambda v: {'weights': v['params'], 'opt_state': tx().init(v['params'])},
                legacy_step=lambda s, b: (s, {'loss': jax.lax.pmean(jnp.mean(b['x']), AXIS)}),
            ),
            'legacy_state returns a dict, which the comparison cannot read by field or key name',
        ),
    ],
    ids=[
        'no metrics',
        'pmapped inside',
        'pmapped inside, by attribute',
        'axis name',
        'loss key',
        'loss shape',
        'nnx state',
        'nnx bare step',
        'legacy bare step',
        'legacy step key',
        'legacy params',
        'legacy model_state',
        'dict without params',
    ],
)
def test_a_mistake_in_a_real_step_is_one_line_before_any_training(fields, line, monkeypatch):
    """The pre-flight traces one step of each side as the adapters call them: exit 2 before training."""
    from equivalence.core import preflight

    def trained(*args, **kwargs):
        raise AssertionError('a training step ran before the mistake was reported')

    monkeypatch.setattr(step_side.StepLegacySetup, 'call', trained)
    monkeypatch.setattr(step_side.StepNewSetup, 'call', trained)
    port = dataclasses.replace(FORMS['state, steps, no key'], **fields)
    with pytest.raises(preflight.PreflightError) as e:
        harness.check(port, devices=2, **QUICK)
    text = str(e.value)
    assert line in text and '\n' not in text, text
    if 'pmap' in line:  # what to call instead
        called = line.split(' calls ', 1)[1].split(',', 1)[0]
        assert f'fix: call the function it wraps, {called}.__wrapped__, or give {called} itself' in text, text
    if 'NameError' in line:  # JAX's own words, then the user's frame, then the fix that fits the port
        assert 'unbound axis name: devices' in text and 'at test_step_forms.py:' in text, text
        assert "fix: the port declares axis_name='batch'" in text, text


@pytest.mark.parametrize(
    'fields, line',
    [
        (dict(loss=None), "legacy_step returns metrics ['denominator', 'loss', 'mae'], and the port gives no loss=: "),
        (dict(legacy_step=_adapter_of_a_pmapped_step), 'fix: call the function it wraps, P_TRAIN_STEP.__wrapped__'),
        (dict(axis_name='data'), "fix: the port declares axis_name='data': set axis_name='batch' or pmean over 'data'"),
    ],
    ids=['no loss=', 'pmapped inside', 'axis name'],
)
def test_record_refuses_the_pmap_sides_mistakes_that_run_refuses_before_recording(fields, line, tmp_path):
    """``record`` runs the pmap side's half of the pre-flight (issue 60: a step returning metrics with no ``loss=``,
    an ``axis_name`` its pmean does not name, a call of upstream's pmapped step inside it were each exit 3 after
    the pmap side ran): the line a check says, before anything is recorded; nothing written."""
    from equivalence.core import preflight
    from equivalence.core.port.config import RunConfig

    port = dataclasses.replace(FORMS['state, steps, no key'], **fields)
    config = RunConfig(workload=port.name, devices=2, batch_size=8, rng_mode=port.rng_modes[0], **QUICK)
    with pytest.raises(preflight.PreflightError) as checked:
        harness.check(port, devices=2, **QUICK)
    with pytest.raises(preflight.PreflightError) as recorded:
        harness.record(port, config, str(tmp_path / 'reference.npz'))
    assert line in str(recorded.value) and str(recorded.value) == str(checked.value), str(recorded.value)
    assert not list(tmp_path.iterdir())


def device_folding_step(state, batch):
    """google-research's form: the key kept in the train state, the device index folded into it (issue 60)."""
    return train_step(state, batch, jax.random.fold_in(state.rng, jax.lax.axis_index(AXIS)))


def test_global_keys_are_refused_for_a_step_whose_numbers_depend_on_its_device(monkeypatch):
    """A step that folds ``lax.axis_index`` into the key it draws from draws per device: under ``--rng global``
    its correct port MISMATCHed, blamed on randomness, while the header said no key is handed. The pre-flight
    reads it from the step's jaxpr and refuses global keys, before anything trains; per-device keys are accepted,
    and so is the same step without the fold under global keys (the controls)."""
    from equivalence.core import preflight
    from equivalence.core.port.config import RunConfig

    monkeypatch.setattr(step_side.StepLegacySetup, 'call', lambda *a: pytest.fail('a step ran'))
    keyed = dataclasses.replace(FORMS['key in state'], rng_modes=('per-device', 'global'))
    folding = dataclasses.replace(keyed, legacy_step=device_folding_step)
    with pytest.raises(preflight.PreflightError) as refused:
        harness.check(folding, devices=2, rng_mode='global', **QUICK)
    assert str(refused.value).startswith(
        "port 'forms': legacy_step draws its random numbers from a key its device index reaches "
        "(lax.axis_index('batch'), folded in): each pmap device draws its own, which global keys (--rng global) "
        'cannot give the new side; check it with per-device keys'
    ), str(refused.value)
    for port, mode in ((folding, 'per-device'), (keyed, 'global')):
        config = RunConfig(workload=port.name, devices=2, batch_size=8, rng_mode=mode, **QUICK)
        preflight.check(kinds.of(port), config)


def test_the_device_index_is_followed_into_jits_scans_and_conds():
    """What the refusal reads (``device_keys.by_device``), as values: a key the device index reaches, inside a
    jit, a scan or a cond; not a draw cut into the device's slice afterwards (the suite's own global draw), nor
    the index used for arithmetic beside a draw."""
    from equivalence.core.preflight import device_keys

    def by_device(fn) -> bool:
        key, x = jax.ShapeDtypeStruct((2,), jnp.uint32), jax.ShapeDtypeStruct((4,), jnp.float32)
        closed = jax.make_jaxpr(fn, axis_env=[(AXIS, 2)])(key, x)
        return device_keys.by_device(closed.jaxpr, [False, False])[0]

    folded = lambda k: jax.random.fold_in(k, jax.lax.axis_index(AXIS))  # noqa: E731
    assert by_device(lambda k, x: jax.jit(lambda k: jax.random.normal(folded(k), (4,)))(k) * x)
    assert by_device(lambda k, x: jax.lax.scan(lambda c, _: (c + jax.random.normal(folded(k), ()), None), 0.0,
                                               None, length=2)[0])  # fmt: skip
    assert by_device(lambda k, x: jax.lax.cond(x.sum() > 0, lambda: jax.random.normal(jax.jit(folded)(k), ()),
                                               lambda: 0.0))  # fmt: skip
    sliced = lambda k, x: jax.lax.dynamic_slice_in_dim(jax.random.normal(k, (8,)), jax.lax.axis_index(AXIS) * 4, 4)  # noqa: E731
    assert not by_device(sliced)
    assert not by_device(lambda k, x: jax.random.normal(k, (4,)) + x * jax.lax.axis_index(AXIS))
    # the pre-flight's screen: the step as traced under vmap, where the device index is an iota
    rows = jax.ShapeDtypeStruct((2, 2), jnp.uint32), jax.ShapeDtypeStruct((2, 4), jnp.float32)

    def screened(fn) -> bool:
        closed = jax.make_jaxpr(jax.vmap(fn, axis_name=AXIS))(*rows)
        return device_keys.by_device(closed.jaxpr, [False, False], device_keys.UNDER_VMAP)[0]

    assert screened(lambda k, x: jax.jit(lambda k: jax.random.normal(folded(k), (4,)))(k) * x)
    assert not screened(sliced)


def test_the_guide_maps_a_steps_signature_to_the_fields_of_each_form():
    """Choosing ``step_form``, ``rng_arg`` and ``new_step`` for ``train_step(state, batch, rng)`` took reading an
    example (issue 60): docs/port.md has a table from the signature to the fields, a row for each form."""
    from equivalence.core.port import step_forms

    with open(os.path.join(ROOT, 'docs', 'port.md')) as f:
        section = f.read().split("**From your step's signature to the fields.**", 1)[1].split('\n\n', 2)[1]
    rows = [row[2:].split(' | ') for row in section.splitlines() if row.startswith('| `')]
    assert {re.match(r"`'(\w+)'`", row[1]).group(1) for row in rows} >= set(step_forms.FORMS)
    assert ['`train_step(state, batch, rng) -> (state, metrics)`', "`'state_rng'`"] in [row[:2] for row in rows]


def test_a_loss_named_in_upstreams_own_metrics_class_is_read():
    """A step returning its metrics as upstream's own class (a ``flax.struct`` dataclass, as a NeRF codebase's
    ``Stats``, or a NamedTuple): ``loss='loss'`` reads that field, at the pre-flight and in the run; a name it lacks
    lists the fields. Before, only a dict's key was read: 'is not in what legacy_step returns (a Stats)'."""
    import typing

    import flax
    import numpy as np

    from equivalence.core.preflight import PreflightError
    from equivalence.core.preflight import steps as preflight_steps

    @flax.struct.dataclass
    class Stats:
        loss: jax.Array
        psnr: jax.Array

    class Tupled(typing.NamedTuple):
        loss: jax.Array
        psnr: jax.Array

    for cls in (Stats, Tupled):
        out_K = cls(loss=np.arange(2, dtype=np.float32), psnr=np.ones(2, np.float32))
        port = LoopPort(**BASE, legacy_step=train_step, step_form='state', loss='loss', new_step=nnx_train_step)
        preflight_steps.check_loss(port, 'legacy_step', out_K, 2)
        losses, metrics = adapters.read_output(port, out_K)
        assert losses.tolist() == [0.0, 1.0] and set(metrics) == {'loss', 'psnr'}, metrics
        wrong = dataclasses.replace(port, loss='los')
        with pytest.raises(PreflightError) as refused:
            preflight_steps.check_loss(wrong, 'legacy_step', out_K, 2)
        assert "metrics ['loss', 'psnr']" in str(refused.value)
