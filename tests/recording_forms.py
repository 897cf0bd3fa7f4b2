"""One linen network and its NNX port in the forms real ports take, for the recording's tests
(``test_recording.py``): called plainly; its forward pass vmapped over each device's rows
(``nnx.vmap``, as docs/randomness.md shows for per-device keys); its block under ``nnx.remat``; its blocks
stacked and run by ``nnx.scan`` (linen's ``nn.scan`` on the pmap side); and the linen network itself
wrapped by ``nnx.bridge.ToNNX``. Each form is a correct port; ``SLIPS`` plant one LayerNorm epsilon. The
linen block returns ``(h, h)``, its NNX port ``h``: an output one side alone gives is no difference.
``per_replica``: a loop port whose pmap step clips each device's gradient before its pmean, and whose new
step (functional NNX under ``jax.jit``) reproduces it with ``jax.vmap(jax.value_and_grad(...))`` over the
D groups of rows (google-research/diffusion_distillation's step and its port, issue 51)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from flax.nnx import bridge
from flax.training import train_state

from equivalence import LoopPort, ModelPort
from equivalence.core.port import workloads

FEATURES, WIDTH, DEVICES = 20, 16, 2


class LinenBlock(nn.Module):
    epsilon: float = 1e-6

    @nn.compact
    def __call__(self, x, _=None):
        h = nn.relu(nn.LayerNorm(epsilon=self.epsilon, name='norm')(nn.Dense(WIDTH, name='fc')(x)))
        return h, h  # two outputs, where the NNX block gives one (google-research/vdm's ResnetBlock does so)


class LinenNet(nn.Module):
    scan: bool = False
    epsilon: float = 1e-6

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(WIDTH, name='embed')(x)
        if self.scan:
            blocks = nn.scan(LinenBlock, variable_axes={'params': 0}, split_rngs={'params': True}, length=2)
            x, _ = blocks(self.epsilon, name='blocks')(x, None)
        else:
            x, _ = LinenBlock(self.epsilon, name='block')(x)
        return nn.Dense(1, name='head')(x)


class NnxBlock(nnx.Module):
    def __init__(self, epsilon: float = 1e-6, *, rngs: nnx.Rngs):
        self.fc = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.norm = nnx.LayerNorm(WIDTH, epsilon=epsilon, rngs=rngs)

    def __call__(self, x):
        return nnx.relu(self.norm(self.fc(x)))


class NnxNet(nnx.Module):
    def __init__(self, form: str = 'plain', epsilon: float = 1e-6, *, rngs: nnx.Rngs):
        self.form = form
        self.embed, self.head = nnx.Linear(FEATURES, WIDTH, rngs=rngs), nnx.Linear(WIDTH, 1, rngs=rngs)
        if form == 'scan':
            self.blocks = nnx.vmap(lambda r: NnxBlock(epsilon, rngs=r), in_axes=0, out_axes=0)(rngs.fork(split=2))
        else:
            self.block = NnxBlock(epsilon, rngs=rngs)

    def __call__(self, x):
        x = self.embed(x)
        if self.form == 'scan':
            x = nnx.scan(lambda b, h: (b(h), None), in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))(self.blocks, x)[0]
        elif self.form == 'remat':
            x = nnx.remat(lambda b, h: b(h))(self.block, x)
        else:
            x = self.block(x)
        return self.head(x)


def squared(out, y):
    return jnp.mean((out - y) ** 2, axis=-1)


def per_device_rows(model, x):
    """The forward pass vmapped over each device's rows, ``[D, B / D, ...]``, as a port with per-device
    keys writes it (docs/randomness.md)."""
    rows = x.reshape(DEVICES, -1, *x.shape[1:])
    return nnx.vmap(lambda m, r: m(r), in_axes=(None, 0))(model, rows).reshape(x.shape[0], -1)


def bridged(epsilon: float, rngs: nnx.Rngs):
    model = bridge.ToNNX(LinenNet(epsilon=epsilon), rngs=rngs)
    return bridge.lazy_init(model, jnp.zeros((1, FEATURES)))


BLOCK_NAMES = {'embed': 'embed', 'head': 'head', 'block/fc': 'block/fc', 'block/norm': 'block/norm'}
SCAN_NAMES = {'embed': 'embed', 'head': 'head', 'blocks/fc': 'blocks/fc', 'blocks/norm': 'blocks/norm'}


def port(form: str, epsilon: float = 1e-6) -> ModelPort:
    """The network in ``form`` ('plain', 'vmap', 'remat', 'scan', 'bridge'); ``epsilon``: the NNX LayerNorms'."""
    if form == 'bridge':
        model = lambda rngs: bridged(epsilon, rngs)  # noqa: E731
        names = None
    else:
        model = lambda rngs: NnxNet('plain' if form == 'vmap' else form, epsilon, rngs=rngs)  # noqa: E731
        names = SCAN_NAMES if form == 'scan' else BLOCK_NAMES
    forward = per_device_rows if form == 'vmap' else (lambda m, x: m(x))
    return ModelPort(
        name=f'recording-{form}',
        legacy_model=lambda: LinenNet(scan=form == 'scan'),
        nnx_model=model,
        legacy_loss=lambda m, params, state, batch, noise: squared(m.apply({'params': params}, batch['x']), batch['y']),
        nnx_loss=lambda m, batch, noise: squared(forward(m, batch['x']), batch['y']),
        make_data=workloads.mlp_data,
        make_tx=lambda lr_scale=1.0: optax.adam(1e-2 * lr_scale),
        init_args=lambda batch: (batch['x'],),
        names=names,
        default_batch=8,
    )


FORMS = ('plain', 'vmap', 'remat', 'scan', 'bridge')


# -- per-replica gradients: pmap clips each device's; jax.vmap(jax.value_and_grad) over D groups of rows --

CLIP = optax.clip_by_global_norm(0.5)  # stateless: each replica's gradient clipped before the mean


def replica_loss(apply, params, x, y):
    return jnp.mean(squared(apply(params, x), y))


def pmap_step(state, batch):
    apply = lambda q, x: state.apply_fn({'params': q}, x)  # noqa: E731
    loss, grads = jax.value_and_grad(replica_loss, argnums=1)(apply, state.params, batch['x'], batch['y'])
    grads, _ = CLIP.update(grads, CLIP.init(None))
    return state.apply_gradients(grads=jax.lax.pmean(grads, 'batch')), jax.lax.pmean(loss, 'batch')


class NnxTrainState(train_state.TrainState):
    graphdef: nnx.GraphDef


def functional_state(model):
    graphdef, params = nnx.split(model, nnx.Param)
    state = NnxTrainState.create(apply_fn=graphdef.apply, params=params, tx=optax.adam(1e-2), graphdef=graphdef)
    return jax.tree.map(jnp.asarray, state)


@jax.jit
def per_replica_step(state, batch):
    """Each of the D groups of rows is one replica: its loss and gradient by ``jax.vmap(jax.value_and_grad)``,
    clipped, then averaged (the pmap step's pmean)."""
    rows = lambda a: a.reshape(DEVICES, -1, *a.shape[1:])  # noqa: E731
    loss = lambda p, x, y: replica_loss(lambda q, x: nnx.merge(state.graphdef, q)(x), p, x, y)  # noqa: E731
    losses, grads = jax.vmap(jax.value_and_grad(loss), in_axes=(None, 0, 0))(
        state.params, rows(batch['x']), rows(batch['y'])
    )
    grads = jax.vmap(lambda g: CLIP.update(g, CLIP.init(None))[0])(grads)
    return state.apply_gradients(grads=jax.tree.map(lambda g: g.mean(0), grads)), losses.mean()


def per_replica(epsilon: float = 1e-6) -> LoopPort:
    """The loop port of per-replica gradients; ``epsilon``: the NNX LayerNorm's."""
    return LoopPort(
        name='recording-per-replica',
        legacy_model=LinenNet,
        nnx_model=lambda rngs: NnxNet(epsilon=epsilon, rngs=rngs),
        make_data=workloads.mlp_data,
        legacy_state=lambda v: train_state.TrainState.create(
            apply_fn=LinenNet().apply, params=v['params'], tx=optax.adam(1e-2)
        ),
        legacy_step=pmap_step,
        step_form='state',
        new_state=functional_state,
        new_step=per_replica_step,
        init_args=lambda batch: (batch['x'],),
        names=BLOCK_NAMES,
        default_batch=8,
        rng_modes=('global',),
    )
