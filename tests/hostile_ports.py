"""Broken ports, each one realistic mistake: the example's good port (``examples/mlp_port``) with
one field replaced. A case is a function of no arguments returning the port (``loading.load``
calls it), since a port whose field is wrong of its kind refuses to be built at all.

``CASES``: name -> (the port field its one line must name, the commands it is tried with).
"""

import dataclasses
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, 'examples', 'mlp_port'))
import my_port  # noqa: E402  (a user's port, as a user's module)

old, new = my_port.old, my_port.new
LOOP, MODEL = my_port.LOOP, my_port.MODEL
AXIS = old.AXIS
CASES: dict[str, tuple[str, tuple[str, ...]]] = {}
ALL = ('run', 'pytest')
EVERY = ('run', 'explain', 'bench', 'pytest')  # a sample of the traced mistakes, through every command
STATES = ('run', 'pytest', 'migrate')  # build-time mistakes reach checkpoint migrate too


def case(field: str, commands: tuple[str, ...] = ALL):
    """Registers a broken port under its function's name, with the field its line must name."""

    def register(fn):
        CASES[fn.__name__] = (field, commands)
        return fn

    return register


def loop(**fields):
    return dataclasses.replace(LOOP, **fields)


def model(**fields):
    return dataclasses.replace(MODEL, **fields)


# -- the user's own pmap step (legacy_step) ------------------------------------------------------


def _grads_and_loss(state, batch, key, axis=AXIS):
    loss_fn = lambda p: jnp.mean(old.per_example_loss(p, batch, key))  # noqa: E731
    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return jax.lax.pmean(loss, axis), jax.lax.pmean(grads, axis)


def _apply(state, grads):
    updates, opt_state = old.make_tx().update(grads, state.opt_state, state.params)
    return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state)


def step_drops_rng(carry, batch):
    rng, state = carry
    loss, grads = _grads_and_loss(state, batch, rng)
    return _apply(state, grads), loss  # the carry lost its rng


def step_pmean_other_axis(carry, batch):
    rng, state = carry
    rng, key = jax.random.split(rng)
    loss, grads = _grads_and_loss(state, batch, key, axis='data')  # the port says 'batch'
    return (rng, _apply(state, grads)), loss


def step_per_example_loss(carry, batch):
    rng, state = carry
    rng, key = jax.random.split(rng)
    _, grads = _grads_and_loss(state, batch, key)
    return (rng, _apply(state, grads)), old.per_example_loss(state.params, batch, key)  # not the mean


def step_float_counter(carry, batch):
    rng, state = carry
    rng, key = jax.random.split(rng)
    loss, grads = _grads_and_loss(state, batch, key)
    return (rng, _apply(state, grads).replace(step=state.step + 1.0)), loss  # int32 -> float32


def step_raises(carry, batch):
    rng, state = carry
    x, y = batch
    raise ValueError(f'expected 3 batch fields, got {len(batch)}')


def step_metrics_as_loss(carry, batch):
    rng, state = carry
    rng, key = jax.random.split(rng)
    loss, grads = _grads_and_loss(state, batch, key)
    return (rng, _apply(state, grads)), {'loss': loss, 'step': state.step}


def step_of_renamed_state(carry, batch):
    rng, state = carry
    params, opt_state = state['weights'], state['moments']
    rng, key = jax.random.split(rng)
    loss_fn = lambda p: jnp.mean(old.per_example_loss(p, batch, key))  # noqa: E731
    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = old.make_tx().update(jax.lax.pmean(grads, AXIS), opt_state, params)
    state = {'weights': optax.apply_updates(params, updates), 'moments': opt_state}
    return (rng, state), jax.lax.pmean(loss, AXIS)


def step_three_arguments(state, batch, rng):
    return state, batch


# AlgoPerf's update function (its MNIST submission's ``pmapped_update_params``): already jax.pmap'd, its
# workload and optimizer update static and broadcast (in_axes None), the rest mapped
@functools.partial(jax.pmap, axis_name=AXIS, in_axes=(None, None, 0, 0), static_broadcasted_argnums=(0, 1))
def pmapped_update_params(workload, opt_update_fn, carry, batch):
    rng, state = carry
    rng, key = jax.random.split(rng)
    loss, grads = _grads_and_loss(state, batch, key)
    updates, opt_state = opt_update_fn(grads, state.opt_state, state.params)
    state = state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state)
    return (rng, state), loss


@case('legacy_state', (*EVERY, 'migrate'))
def renamed_legacy_state():  # no .params, no .opt_state, no legacy_groups= (a tuple (params, opt_state) reads)
    renamed = lambda v: {'weights': v['params'], 'moments': old.make_tx().init(v['params'])}  # noqa: E731
    return loop(legacy_state=renamed, legacy_step=step_of_renamed_state)


@case('legacy_step')
def legacy_step_three_arguments():
    return loop(legacy_step=step_three_arguments)


@case('legacy_step')
def legacy_step_pmapped_with_its_static_arguments_bound():  # was 'legacy_step raised IndexError' (issue 51)
    return loop(legacy_step=functools.partial(pmapped_update_params, 'mnist', old.make_tx().update))


@case('legacy_step')
def legacy_step_pmapped_as_is():
    return loop(legacy_step=pmapped_update_params)


@case('legacy_step', EVERY)
def legacy_step_drops_rng():
    return loop(legacy_step=step_drops_rng)


@case('legacy_step', EVERY)
def legacy_step_pmean_other_axis():
    return loop(legacy_step=step_pmean_other_axis)


@case('legacy_step')
def port_axis_name_differs():
    return loop(axis_name='data')


@case('legacy_step', EVERY)
def legacy_step_per_example_loss():
    return loop(legacy_step=step_per_example_loss)


@case('legacy_step')
def legacy_step_float_counter():
    return loop(legacy_step=step_float_counter)


@case('legacy_step')
def legacy_step_raises():
    return loop(legacy_step=step_raises)


@case('legacy_step')
def legacy_step_returns_metrics_dict():
    return loop(legacy_step=step_metrics_as_loss)


@case('legacy_step')
def legacy_step_not_callable():
    return loop(legacy_step='old.train_step')


# -- the user's own new side (new_call, new_state; built here by their old names, new_call=, new_state=) --


def _losses(train_state, key, batch_KxG):
    return new.train_calls(*train_state, key, batch_KxG)


@case('new_call', EVERY)
def nnx_call_returns_none():
    return loop(new_call=lambda ts, key, batch: None)


@case('new_call')
def nnx_call_returns_mean_loss():
    return loop(new_call=lambda ts, key, batch: (ts, jnp.mean(_losses(ts, key, batch))))


@case('new_call', EVERY)
def nnx_call_losses_Kx2():
    return loop(new_call=lambda ts, key, batch: (ts, jnp.stack([_losses(ts, key, batch)] * 2, axis=1)))


@case('new_call')
def nnx_call_raises():
    def call(ts, key, batch):
        model, optimizer = ts
        return ts, model.missing_method(batch)

    return loop(new_call=call)


@case('new_call')
def nnx_call_returns_only_losses():
    return loop(new_call=_losses)


@case('new_call')
def nnx_call_returns_metrics_too():
    return loop(new_call=lambda ts, key, batch: (ts, _losses(ts, key, batch), {'lr': 0.1}))


@case('new_call')
def nnx_call_is_the_jitted_function():
    return loop(new_call=new.train_calls)  # (model, optimizer, key, batch): four arguments


@case('new_call')
def nnx_call_returns_another_state():
    return loop(new_call=lambda ts, key, batch: (ts[0], _losses(ts, key, batch)))


@case('new_call')
def nnx_call_not_callable():
    return loop(new_call=None)


@case('new_state', (*EVERY, 'migrate'))
def nnx_state_model_only():
    return loop(new_state=lambda m: m, new_call=lambda m, key, batch: (m, jnp.zeros(batch[0].shape[0])))


@case('new_state', STATES)
def nnx_state_a_dict():
    state = lambda m: {'model': m, 'opt': nnx.Optimizer(m, new.make_tx(), wrt=nnx.Param)}  # noqa: E731
    return loop(new_state=state, new_call=lambda ts, k, b: (ts, new.train_calls(ts['model'], ts['opt'], k, b)))


@case('new_state', STATES)
def nnx_state_raises():
    return loop(new_state=lambda m: (m, nnx.Optimizer(m, new.make_tx())))  # wrt= is required


@case('new_groups', STATES)
def nnx_groups_returns_a_list():
    return loop(new_groups=lambda ts: [ts[0]])


@case('new_groups', STATES)
def nnx_groups_without_params():
    return loop(new_groups=lambda ts: {'weights': nnx.to_pure_dict(nnx.state(ts[0], nnx.Param))})


@case('legacy_groups', STATES)
def legacy_groups_raises():
    return loop(legacy_groups=lambda state: {'params': state['params']})


@case('legacy_groups', STATES)
def legacy_groups_params_nested_once_more():
    return loop(legacy_groups=lambda s: {'params': {'params': s.params}, 'opt_state': s.opt_state})


@case('legacy_state', STATES)
def legacy_state_raises():
    return loop(legacy_state=lambda v: old.create_state(v['parms']))


@case('legacy_state', STATES)
def legacy_state_wrong_arity():
    return loop(legacy_state=lambda variables, tx: old.create_state(variables))


# -- make_data ----------------------------------------------------------------------------------


def _data(transform):
    def make_data(rng, n_steps, batch):
        return transform(*old.make_data(rng, n_steps, batch))

    return make_data


@case('make_data', EVERY)
def data_batch_first():
    return loop(make_data=_data(lambda x, y: (np.swapaxes(x, 0, 1), np.swapaxes(y, 0, 1))))


@case('make_data', EVERY)
def data_one_step_short():
    return loop(make_data=_data(lambda x, y: (x[:-1], y[:-1])))


@case('make_data', EVERY)
def data_ragged_labels():
    return loop(make_data=_data(lambda x, y: (x, y[:, :-1])))


@case('make_data')
def data_nested_lists():
    return loop(make_data=_data(lambda x, y: (x.tolist(), y.tolist())))


@case('make_data')
def data_random_state_methods():  # pmap-era data code written for np.random.RandomState
    def make_data(rng, n_steps, batch):
        return {'x': rng.randn(n_steps, batch, 4).astype('float32'), 'y': rng.randint(0, 2, (n_steps, batch))}

    return loop(make_data=make_data)


@case('make_data')
def data_generator():
    def make_data(rng, n_steps, batch):
        x, y = old.make_data(rng, n_steps, batch)
        yield from zip(x, y, strict=True)

    return loop(make_data=make_data)


@case('make_data')
def data_strings():
    return loop(make_data=_data(lambda x, y: (x, y.astype(str))))


@case('make_data')
def data_python_scalar_leaf():
    return loop(make_data=_data(lambda x, y: (x, y, 0.5)))


@case('make_data')
def data_raises():
    return loop(make_data=lambda rng, n_steps, batch: old.make_data(rng, batch))


@case('make_data')
def data_none():
    return loop(make_data=lambda rng, n_steps, batch: None)


@case('make_data')
def data_flat_examples():
    return loop(make_data=_data(lambda x, y: (x.reshape(-1, x.shape[-1]), y.reshape(-1, 1))))


@case('make_data')
def data_wrong_arity():
    return loop(make_data=lambda rng, batch: old.make_data(rng, 4, batch))


@case('make_data', ('run',))
def model_data_batch_first():
    return model(make_data=_data(lambda x, y: (np.swapaxes(x, 0, 1), np.swapaxes(y, 0, 1))))


# -- the port's own fields ----------------------------------------------------------------------


@case('rng_modes', (*EVERY, 'migrate'))
def rng_modes_a_string():
    return loop(rng_modes=('global'))  # noqa: UP034 -- the missing comma is the mistake


@case('rng_modes', STATES)
def rng_modes_unknown():
    return loop(rng_modes=('per_device',))


@case('rng_modes', STATES)
def rng_modes_empty():
    return loop(rng_modes=())


@case('names', STATES)
def names_an_int():
    return loop(names=2)


@case('names', STATES)
def names_dict_of_modules():
    return loop(names={'Dense_0': new.MLP})


@case('names', STATES)
def names_misspelt():
    return loop(names={'Dense_0': 'fc1', 'LayerNorm_0': 'nrom', 'Dense_1': 'fc2'})


@case('legacy_model', STATES)
def legacy_model_an_instance():
    return loop(legacy_model=old.MLP())


@case('legacy_model', STATES)
def legacy_model_needs_arguments():
    return loop(legacy_model=lambda features: old.MLP(features))


@case('nnx_model', (*EVERY, 'migrate'))
def nnx_model_the_class():
    return loop(nnx_model=new.MLP)  # rngs is keyword-only


@case('nnx_model', STATES)
def nnx_model_an_instance():
    return loop(nnx_model=new.MLP(rngs=nnx.Rngs(0)))


@case('nnx_model', STATES)
def nnx_model_raises():
    return loop(nnx_model=lambda rngs: new.MLP(rngs=rngs, hidden=32))


@case('init_args', STATES)
def init_args_not_a_tuple():
    return loop(init_args=lambda batch: batch[0])


@case('legacy_model', STATES)
def init_args_missing_train():
    return loop(init_args=lambda batch: (batch[0],))  # MLP.__call__(x, train): train missing


@case('axis_name', STATES)
def axis_name_none():
    return loop(axis_name=None)


@case('default_batch', STATES)
def default_batch_zero():
    return loop(default_batch=0)


@case('skip', STATES)
def skip_a_string():
    return loop(skip='dynamic_scale')


# -- a model port's losses, optimizer and noise -------------------------------------------------


def _linen_losses(m, params, model_state, batch, noise):
    return my_port.linen_loss(m, params, model_state, batch, noise)


@case('legacy_loss', EVERY)
def legacy_loss_scalar_mean():
    return model(legacy_loss=lambda *a: jnp.mean(_linen_losses(*a)))


@case('legacy_loss')
def legacy_loss_three_values():
    return model(legacy_loss=lambda m, p, s, b, n: (_linen_losses(m, p, s, b, n), s, {'acc': 0.0}))


@case('legacy_loss')
def legacy_loss_keeps_feature_axis():
    return model(legacy_loss=lambda m, p, s, b, n: (m.apply({'params': p}, b[0], train=True) - b[1]) ** 2)


@case('legacy_loss')
def legacy_loss_reads_a_dict_batch():
    return model(legacy_loss=lambda m, p, s, b, n: jnp.mean((m.apply({'params': p}, b['x'], True) - b['y']) ** 2, -1))


@case('nnx_loss')
def nnx_loss_scalar_sum():
    return model(nnx_loss=lambda m, b, n: jnp.sum(new.per_example_loss(m, b)))


@case('nnx_loss')
def nnx_loss_two_arguments():
    return model(nnx_loss=lambda m, b: new.per_example_loss(m, b))


@case('nnx_loss', EVERY)
def nnx_loss_returns_aux():
    return model(nnx_loss=lambda m, b, n: (new.per_example_loss(m, b), {'aux': 0.0}))


@case('make_tx')
def make_tx_not_optax():
    return model(make_tx=lambda scale: lambda grads: grads)


@case('make_tx')
def make_tx_no_arguments():
    return model(make_tx=lambda: optax.adam(1e-3))


@case('make_tx')
def make_tx_raises():
    return model(make_tx=lambda scale: optax.adam(learning_rate=1e-3 * scale, beta=0.9))


@case('noise')
def noise_wrong_arity():
    return model(noise=lambda key: {})


@case('noise')
def noise_raises():
    return model(noise=lambda key, spec: {'z': jax.random.normal(key, spec['x'].shape)})


@case('ema_rate')
def ema_rate_above_one():
    return model(ema_rate=1.5)


@case('eval_data')
def eval_data_not_callable():
    return model(eval_data={'x': np.zeros((4, 8)), 'y': np.zeros(4)})


# -- not a port: --workload module:NAME names the user's model, or a factory whose own code raises ---

MLP = case('MLP', EVERY)(new.MLP)  # the NNX model class named where the port belongs


@case('port_with_misspelt_field', (*EVERY, 'migrate'))
def port_with_misspelt_field():
    return dataclasses.replace(LOOP, legacy_stp=old.train_step)  # legacy_step


def step_raises_long(carry, batch):
    """A step whose error is JAX-like: long, several lines, the culprit named in its last clause."""
    raise ValueError('Sharding passed to jit does not match the sharding on the respective arg. Got jit sharding: '
                     + 'NamedSharding(' + 'x' * 600 + '),\narg sharding: NamedSharding(mesh=Mesh(...)) for arg type: '
                     'uint32[2,2]')  # fmt: skip


@case('legacy_step')
def legacy_step_raises_long():
    return loop(legacy_step=step_raises_long)


# -- mistakes that show only while training: reported with the frame, after the pre-flight ------


class _FlakyLogger:
    """A host-side logger inside the NNX call that fails on its second call (eager code: not traced)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, ts, key, batch_KxG):
        self.calls += 1
        if self.calls > 2:  # the pre-flight's trace, then the first real call, pass
            raise RuntimeError('metrics server refused the connection')
        return ts, _losses(ts, key, batch_KxG)


@case('new_call', ('run',))
def nnx_call_fails_while_training():
    return loop(new_call=functools.partial(_FlakyLogger.__call__, _FlakyLogger()))


# -- good ports that once failed in the suite's own code ----------------------------------------


def keyless_loop():
    """A loop port whose NNX call ignores its key (a model without dropout): ``jax.jit`` drops the
    unused input, which once made explain exit 3 ('57 inputs but 56 input shardings')."""
    return loop(new_call=lambda ts, key, batch: (ts, _losses(ts, jnp.zeros_like(key), batch)))


class Trainer(nnx.Module):
    """An NNX train state with its own attribute names: the comparison reads it through new_groups=."""

    def __init__(self, model: nnx.Module):
        self.net = model
        self.opt = nnx.Optimizer(model, new.make_tx(), wrt=nnx.Param)


def grouped_loop():
    """The loop port with a train state that is not (model, optimizer): new_groups= says where things are."""
    from equivalence.core.state import convert

    return loop(
        new_state=Trainer,
        new_call=lambda t, key, batch: (t, new.train_calls(t.net, t.opt, key, batch)),
        new_groups=lambda t: convert.nnx_groups(t.net, t.opt),
    )
