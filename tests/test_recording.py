"""The first step recorded module by module agrees with itself on a correct port, whatever the form of its
forward pass (issue 40): plain (test_locate's and test_where's); vmapped over each device's rows
(``nnx.vmap``); a block under ``nnx.remat``; stacked blocks under ``nnx.scan`` against linen's
``nn.scan``; and the linen network itself inside ``nnx.bridge.ToNNX``. Every linen module call is paired
and agrees, and nothing is located; the negative control, one LayerNorm epsilon in the same form, is
located at that LayerNorm. Recorded before the fix, the vmapped form named a place on the correct port
(each device's rows recorded in no fixed order, one kept), and the scanned one named the code feeding
the second block."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import recording_forms as forms
from conftest import require_devices

from equivalence.core import harness, kinds, preflight
from equivalence.core.locate import hidden, locate
from equivalence.core.locate.first_step import Recorder
from equivalence.core.port.config import RunConfig
from equivalence.core.record import pruned
from equivalence.core.run import inputs as made


def recorder(port) -> Recorder:
    require_devices(forms.DEVICES)
    config = RunConfig(workload=port.name, devices=forms.DEVICES, steps_per_call=1, calls=1, batch_size=8,
                       rng_mode=port.rng_modes[0], available=forms.DEVICES)  # fmt: skip
    kind = kinds.of(port)
    fed = made.make(port, config, preflight.check(kind, config))
    return Recorder(kind, config, fed, 1)


def located(port) -> locate.Location:
    rec = recorder(port)
    return locate.locate(rec.kind, rec.config, rec.inputs, rec)


def held(port) -> list:
    """The failing leaves of the MATCH's check module by module, which records the forward pass alone."""
    leaves, said = hidden.first_step_leaves(recorder(port), locate.Seen(noisy=frozenset({'head/bias'})))
    assert said.reproduced, said  # its recording reproduces the run
    return [(x.path, x.ok) for x in leaves]


@functools.cache
def checked_vmap():
    """The vmapped form's whole check, located on MATCH (``locate=True``): its location is the form's correct one."""
    require_devices(forms.DEVICES)
    return harness.check(forms.port('vmap'), devices=forms.DEVICES, steps_per_call=1, calls=1, locate=True)


# 'plain' (the linen and NNX networks as they are) is test_locate's (the correct port located nowhere, every
# module agreeing; the LayerNorm epsilon located at that LayerNorm) and test_where's (its forward pass alone
# held, on the mlp example's loop): here the forms that wrap it
@pytest.mark.parametrize('form', [f for f in forms.FORMS if f != 'plain'])
def test_each_form_of_the_forward_pass_is_recorded_as_it_ran(form):
    # the vmapped form's correct port: located by its whole check (the test below), as the verdict records it
    correct = checked_vmap().verdict.location if form == 'vmap' else located(forms.port(form))
    assert correct.kind == 'none' and not correct.notes, correct.lines()  # every call paired (no note)
    assert len(correct.modules) == 6 and all(m.input_ok and m.output_ok for m in correct.modules), correct.modules
    slip = located(forms.port(form, epsilon=1e-2))
    assert (slip.kind, slip.new.rpartition('/')[2]) == ('module', 'norm'), slip.line()
    before = slip.modules[: slip.first]
    assert before and all(m.input_ok and m.output_ok for m in before), slip.lines()
    # the forward pass alone, recorded as a MATCH's check records it, parts nowhere, and at the slip
    assert held(forms.port(form)) == []
    assert [(p.rpartition('/')[0].rpartition('/')[2], ok) for p, ok in held(forms.port(form, epsilon=1e-2))] == [
        ('norm', False)
    ]


def test_the_vmapped_forward_recorded_reproduces_its_run_and_locates_nothing_on_match():
    """Through the whole check (``locate=True``): the recording's first losses are the run's (a recording
    that did not reproduce them would name no place), and the MATCH is located nowhere, every module call
    paired and agreeing (the test above reads the same location)."""
    result = checked_vmap()
    assert result.outcome.label == 'MATCH' and result.verdict.location.kind == 'none', result.verdict.lines()


def test_per_replica_gradients_by_vmap_of_value_and_grad_are_recorded_as_they_ran():
    """A new step that takes each replica's gradient with ``jax.vmap(jax.value_and_grad(...))`` (its module
    calls hand the recording jax 0.10's ``LinearizeTracer`` above a ``vmap``'s ``BatchTracer``): the correct
    port is located nowhere, every call paired and agreeing; the LayerNorm epsilon is located at that
    LayerNorm. Before issue 51 the recording raised ``UnexpectedTracerError``."""
    correct = located(forms.per_replica())
    assert correct.kind == 'none', correct.lines()
    assert len(correct.modules) == 6 and all(m.input_ok and m.output_ok for m in correct.modules), correct.modules
    slip = located(forms.per_replica(epsilon=1e-2))
    assert (slip.kind, slip.new.rpartition('/')[2]) == ('module', 'norm'), slip.line()


def test_the_recorded_forward_pass_compiles_at_level_2_unless_xla_flags_chose_a_level(monkeypatch):
    """``pruned.options``: level 2 (not XLA's 3) for a program run once, but a level chosen in ``XLA_FLAGS``
    is kept (the suite's tests choose 1; a user may choose 3). No JAX runs."""
    monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8')
    assert pruned.options() == {'xla_backend_optimization_level': 2}
    monkeypatch.setenv('XLA_FLAGS', '--xla_backend_optimization_level=3')
    assert pruned.options() == {}


def test_the_forward_pass_alone_is_compiled_without_the_backward_pass_and_the_update():
    """``pruned.call``: the forward check's program keeps the loss and the recording's callbacks, nothing else.
    A host function in the update that JAX may drop (``pure_callback``, no effect) runs in the whole call (the
    control) and in a scan of two steps, whose second step reads the update; in one step of it, never."""
    require_devices(2)
    ran = []

    def step(w, x):
        def loss(w):
            y = jnp.tanh(x @ w)
            jax.debug.callback(lambda v: ran.append('forward'), y)
            return jnp.mean(y**2)

        value, g = jax.value_and_grad(loss)(w)
        g = jax.pure_callback(lambda g: (ran.append('update'), g)[1], jax.ShapeDtypeStruct(g.shape, g.dtype), g)
        return w - 0.1 * jax.lax.pmean(g, 'batch'), jax.lax.pmean(value, 'batch')

    program = jax.pmap(functools.partial(jax.lax.scan, step), axis_name='batch', devices=jax.devices()[:2])
    w = jnp.ones((2, 3, 3))
    for k, pruned_ran in ((1, ['forward'] * 2), (2, ['forward', 'update'] * 4)):  # 2 devices x k steps
        xs = jnp.arange(2 * k * 12.0).reshape(2, k, 4, 3) / 24
        _, whole = program(w, xs)
        jax.effects_barrier()
        assert sorted(ran) == sorted(['forward', 'update'] * 2 * k)
        ran.clear()
        losses = pruned.call(program, (w, xs), lambda out: out[1])
        jax.effects_barrier()
        assert sorted(ran) == sorted(pruned_ran), (k, ran)
        np.testing.assert_array_equal(losses, whole)
        ran.clear()
