"""A NeRF-like pmap step, small (the structure of a neural-rendering codebase's own ``train_step``): a proposal MLP
and a NeRF MLP, each device drawing its rays' samples from its own key, a data loss, an interlevel loss (the NeRF
level behind a ``stop_gradient``) and a distortion loss returned term by term as metrics, Adam with a delayed
exponential decay of the learning rate, and the gradients clipped by norm per MLP. Its NNX port runs the MLPs on
the global batch and the sampling per group of rows (one group per pmap device, from that device's key).

``PORTS`` holds the correct port and one-constant slips of the NNX side: each is what a ``where:`` must place
(or not) without contradicting the check's own evidence (``test_update_rule``)."""

import dataclasses
import re
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

from equivalence import LoopPort

AXIS, NEAR, FAR, SAMPLES, WIDTH, FREQS, BACKGROUND = 'batch', 2.0, 6.0, 8, 16, 2, 1.0
# the proposal sparser than the NeRF at the start: the interlevel loss, and the proposal's gradients, from step 1
PROP_BIAS, NERF_BIAS = -1.0, 1.0
INTERLEVEL, DISTORTION, MAX_NORM = 1.0, 0.01, 1e-3  # the loss weights, the clip's norm (per MLP)
IN = 3 + 6 * FREQS  # a position, encoded


def encode(x):
    scales = 2.0 ** jnp.arange(FREQS)
    xb = (x[..., None, :] * scales[:, None]).reshape(*x.shape[:-1], -1)
    return jnp.concatenate([x, jnp.sin(xb), jnp.cos(xb)], -1)


def lr_fn(step, lr_init=1e-2, lr_final=1e-4, max_steps=100, delay_steps=8, delay_mult=0.1):
    """The delayed exponential decay (``learning_rate_decay`` of the codebase): a sine ramp from ``delay_mult``."""
    delay = delay_mult + (1 - delay_mult) * jnp.sin(0.5 * jnp.pi * jnp.clip(step / delay_steps, 0, 1))
    t = jnp.clip(step / max_steps, 0, 1)
    return delay * jnp.exp(jnp.log(lr_init) * (1 - t) + jnp.log(lr_final) * t)


def make_tx():
    return optax.adam(lr_fn, b1=0.9, b2=0.999, eps=1e-6)


# The sampling, the rendering and the losses: pure functions both sides call.
def stratified(key, n: int):
    """Each ray's interval edges between NEAR and FAR, jittered: ``[n, SAMPLES + 1]``."""
    t = jnp.linspace(NEAR, FAR, SAMPLES + 1)
    mids = (t[1:] + t[:-1]) / 2
    lower, upper = jnp.concatenate([t[:1], mids]), jnp.concatenate([mids, t[-1:]])
    return lower + (upper - lower) * jax.random.uniform(key, (n, SAMPLES + 1))


def resample(key, t, w):
    """Edges drawn from the weights ``w`` of the intervals ``t`` (inverse CDF, stratified)."""
    w = w + 1e-3
    cdf = jnp.concatenate([jnp.zeros_like(w[..., :1]), jnp.cumsum(w, -1) / w.sum(-1, keepdims=True)], -1)
    u = (jnp.arange(SAMPLES + 1) + jax.random.uniform(key, t.shape)) / (SAMPLES + 1)
    return jax.vmap(jnp.interp)(jnp.clip(u, 0, 1 - 1e-6), cdf, t)


def points(origins, directions, t):
    mid = (t[..., 1:] + t[..., :-1]) / 2
    return (origins[:, None] + directions[:, None] * mid[..., None]) / FAR


def weights(density, t):
    tau = density * (t[..., 1:] - t[..., :-1])
    trans = jnp.exp(-jnp.concatenate([jnp.zeros_like(tau[..., :1]), jnp.cumsum(tau[..., :-1], -1)], -1))
    return (1 - jnp.exp(-tau)) * trans


def render(w, rgb):
    return (w[..., None] * rgb).sum(-2) + (1 - w.sum(-1, keepdims=True)) * BACKGROUND


def outer(t0, t1, y1):
    """The sum of ``y1`` over the intervals of ``t1`` that overlap each interval of ``t0`` (its envelope)."""
    cy1 = jnp.concatenate([jnp.zeros_like(y1[..., :1]), jnp.cumsum(y1, -1)], -1)
    i = jnp.arange(t1.shape[-1])
    ge = t0[..., None, :] >= t1[..., :, None]
    lo = jnp.max(jnp.where(ge, i[:, None], 0), -2)
    hi = jnp.min(jnp.where(~ge, i[:, None], t1.shape[-1] - 1), -2)
    take = lambda idx: jnp.take_along_axis(cy1, idx, -1)  # noqa: E731
    return take(hi)[..., 1:] - take(lo)[..., :-1]


def interlevel(t_nerf, w_nerf, t_prop, w_prop, stop: bool = True):
    """The proposal's weights must bound the NeRF's: the NeRF level is a target, behind ``stop_gradient``."""
    if stop:
        t_nerf, w_nerf = jax.lax.stop_gradient(t_nerf), jax.lax.stop_gradient(w_nerf)
    w_outer = outer(t_nerf, t_prop, w_prop)
    return jnp.mean(jnp.sum(jnp.maximum(0, w_nerf - w_outer) ** 2 / (w_nerf + 1e-7), -1))


def distortion(t, w):
    ut = (t[..., 1:] + t[..., :-1]) / 2
    inter = jnp.sum(w * jnp.sum(w[..., None, :] * jnp.abs(ut[..., :, None] - ut[..., None, :]), -1), -1)
    return jnp.mean(inter + jnp.sum(w**2 * (t[..., 1:] - t[..., :-1]), -1) / 3)


@dataclasses.dataclass(frozen=True)
class Losses:
    """The step's loss terms, each a setting a port may slip: the weights, the interlevel's stop_gradient."""

    distortion: float = DISTORTION
    stop: bool = True

    def __call__(self, rgb, history, target):
        (t0, w0), (t1, w1) = history
        terms = {
            'data': jnp.mean((rgb - target) ** 2),
            'interlevel': INTERLEVEL * interlevel(t1, w1, t0, w0, self.stop),
            'distortion': self.distortion * distortion(t1, w1),
        }
        return sum(terms.values()), terms


def clip_per_mlp(grads: dict, max_norm: float = MAX_NORM) -> dict:
    """Each MLP's gradients clipped by their own norm, as the codebase's ``clip_gradients`` does."""
    return {k: clip_by_norm(g, max_norm) for k, g in grads.items()}


def clip_by_norm(grads, max_norm: float = MAX_NORM):
    norm = jnp.sqrt(sum(jnp.sum(g**2) for g in jax.tree.leaves(grads)))  # the codebase's own tree norm
    mult = jnp.minimum(1, max_norm / (jnp.finfo(jnp.float32).eps + norm))
    return jax.tree.map(lambda g: mult * g, grads)


# The pmap side: linen.
class LinenMLP(nn.Module):
    density_activation: Callable = nn.softplus
    rgb: bool = True
    bias: float = NERF_BIAS

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(WIDTH)(encode(x)))
        density = self.density_activation(nn.Dense(1)(h)[..., 0] + self.bias)
        return density, nn.sigmoid(nn.Dense(3)(h)) if self.rgb else None


class PropMLP(LinenMLP):
    rgb: bool = False
    bias: float = PROP_BIAS


class NerfMLP(LinenMLP):
    pass


class LinenModel(nn.Module):
    nerf_bias: float = NERF_BIAS

    @nn.compact
    def __call__(self, key, origins, directions):
        k0, k1 = jax.random.split(key)
        t0 = stratified(k0, origins.shape[0])
        w0 = weights(PropMLP()(points(origins, directions, t0))[0], t0)
        t1 = jax.lax.stop_gradient(resample(k1, t0, w0))
        density, rgb = NerfMLP(bias=self.nerf_bias)(points(origins, directions, t1))
        w1 = weights(density, t1)
        return render(w1, rgb), ((t0, w0), (t1, w1))


class LateLinenModel(LinenModel):
    """The NeRF as sparse as the proposal at the start: the interlevel loss, and the proposal's gradients, are 0 on
    step 1 and bite from step 2 (the weights the NeRF learned on step 1 then exceed the proposal's bound)."""

    nerf_bias: float = PROP_BIAS


def pmap_step(state, batch, rng):
    """The codebase's step, as ``jax.pmap(train_step, axis_name='batch')`` runs it: this device's rays."""
    rng, key = jax.random.split(rng)

    def loss_fn(params):
        rgb, history = state.apply_fn({'params': params}, key, batch['origins'], batch['directions'])
        return Losses()(rgb, history, batch['rgb'])

    (loss, terms), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    grads = clip_per_mlp(jax.lax.pmean(grads, AXIS))
    state = state.apply_gradients(grads=grads)
    return state, jax.lax.pmean({'loss': loss, 'losses': terms}, AXIS)


# The NNX side.
class NnxMLP(nnx.Module):
    def __init__(self, rgb: bool, density_activation: Callable, bias: float, *, rngs: nnx.Rngs):
        heads = [nnx.Linear(WIDTH, 3, rngs=rngs)] if rgb else []
        self.layers = nnx.List([nnx.Linear(IN, WIDTH, rngs=rngs), nnx.Linear(WIDTH, 1, rngs=rngs), *heads])
        self.density_activation, self.bias = density_activation, bias

    def __call__(self, x):
        h = nnx.relu(self.layers[0](encode(x)))
        density = self.density_activation(self.layers[1](h)[..., 0] + self.bias)
        return density, nnx.sigmoid(self.layers[2](h)) if len(self.layers) > 2 else None


class NnxModel(nnx.Module):
    def __init__(self, density_activation: Callable, per_group: bool, nerf_bias: float, *, rngs: nnx.Rngs):
        self.prop_mlp = NnxMLP(False, density_activation, PROP_BIAS, rngs=rngs)
        self.nerf_mlp = NnxMLP(True, density_activation, nerf_bias, rngs=rngs)
        self.per_group = per_group  # the whole forward pass run per group under nnx.vmap, as docs/port.md shows

    def one(self, key, origins, directions):
        """One group's rows from its key: what a pmap device computes."""
        k0, k1 = jax.random.split(key)
        t0 = stratified(k0, origins.shape[0])
        w0 = weights(self.prop_mlp(points(origins, directions, t0))[0], t0)
        t1 = jax.lax.stop_gradient(resample(k1, t0, w0))
        density, rgb = self.nerf_mlp(points(origins, directions, t1))
        w1 = weights(density, t1)
        return render(w1, rgb), ((t0, w0), (t1, w1))

    def __call__(self, keys, origins, directions):
        """``keys``: one a group of rows (a pmap device's): its samples drawn from it, as that device does."""
        groups = keys.shape[0]
        if self.per_group:
            split = lambda a: a.reshape(groups, -1, *a.shape[1:])  # noqa: E731
            out = nnx.vmap(lambda m, k, o, d: m.one(k, o, d), in_axes=(None, 0, 0, 0))(
                self, keys, split(origins), split(directions)
            )
            return jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), out)
        grouped = lambda a: a.reshape(groups, -1, *a.shape[1:])  # noqa: E731
        flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
        k = jax.vmap(jax.random.split)(keys)
        t0 = flat(jax.vmap(lambda key: stratified(key, origins.shape[0] // groups))(k[:, 0]))
        w0 = weights(self.prop_mlp(points(origins, directions, t0))[0], t0)
        t1 = jax.lax.stop_gradient(flat(jax.vmap(resample)(k[:, 1], grouped(t0), grouped(w0))))
        density, rgb = self.nerf_mlp(points(origins, directions, t1))
        w1 = weights(density, t1)
        return render(w1, rgb), ((t0, w0), (t1, w1))


def new_step(losses: Losses = Losses(), clip: Callable = clip_per_mlp):
    @nnx.jit
    def step(ts, batch, keys):
        model, optimizer = ts
        keys = jax.vmap(jax.random.split)(keys)[:, 1]  # each device's `rng, key = split(rng)`

        def loss_fn(model):
            rgb, history = model(keys, batch['origins'], batch['directions'])
            return losses(rgb, history, batch['rgb'])

        (loss, terms), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, nnx.State(clip(dict(grads))))
        return {'loss': loss, 'losses': terms}

    return step


def make_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict:
    """Rays from a sphere of radius 4 towards the origin, and a colour of their direction."""
    origins = rng.normal(size=(n_steps, batch, 3))
    origins = 4 * origins / np.linalg.norm(origins, axis=-1, keepdims=True)
    directions = -origins / 4 + 0.1 * rng.normal(size=origins.shape)
    directions /= np.linalg.norm(directions, axis=-1, keepdims=True)
    rgb = 0.5 + 0.5 * np.sin(3 * directions)
    return {k: v.astype(np.float32) for k, v in (('origins', origins), ('directions', directions), ('rgb', rgb))}


def names(path: str) -> str:
    """linen's ``PropMLP_0/Dense_1`` -> NNX's ``prop_mlp/layers/1``."""
    path = re.sub(r'^PropMLP_0', 'prop_mlp', re.sub(r'^NerfMLP_0', 'nerf_mlp', path))
    return re.sub(r'Dense_(\d+)', r'layers/\1', path)


def by_value(grads: dict, max_val: float = 1e-4) -> dict:
    return jax.tree.map(lambda g: jnp.clip(g, -max_val, max_val), grads)


def port(name: str = 'nerf-like', late: bool = False, activation: Callable = nnx.softplus, per_group: bool = False,
         losses: Losses = Losses(), clip: Callable = clip_per_mlp) -> LoopPort:  # fmt: skip
    """The NeRF-like step's port: the NNX side with its density ``activation``, run ``per_group`` (under
    ``nnx.vmap``, 16 rays a group), its ``losses`` and ``clip``; ``late``: the interlevel loss bites from step 2."""
    legacy = LateLinenModel if late else LinenModel
    bias = PROP_BIAS if late else NERF_BIAS
    return LoopPort(
        name=name,
        legacy_model=legacy,
        nnx_model=lambda rngs: NnxModel(activation, per_group, bias, rngs=rngs),
        make_data=make_data,
        legacy_state=lambda v: train_state.TrainState.create(
            apply_fn=legacy().apply, params=v['params'], tx=make_tx()
        ),  # fmt: skip
        legacy_step=pmap_step,
        step_form='state_rng',
        loss='loss',
        new_state=lambda model: (model, nnx.Optimizer(model, make_tx(), wrt=nnx.Param)),
        new_step=new_step(losses, clip),
        init_args=lambda batch: (jax.random.key_data(jax.random.key(0)), batch['origins'], batch['directions']),
        names=names,
        axis_name=AXIS,
        default_batch=32 if per_group else 16,
        rng_modes=('per-device',),
    )


# One-constant slips of the NNX side. Every port of one pmap side keeps its name: a reference of it checks them all.
SLIPS = {
    'correct': {},
    'relu-density': {'activation': nnx.relu},  # the density's softplus a relu: the forward pass
    'interlevel-no-stop': {'losses': Losses(stop=False)},  # the interlevel loss trains the NeRF too: the backward pass
    'distortion-weight': {'losses': Losses(distortion=DISTORTION / 10)},  # one loss term's weight
    'clip-global': {'clip': clip_by_norm},  # the gradients clipped by their global norm, not per MLP
    'clip-none': {'clip': lambda grads: grads},  # not clipped
    'clip-by-value': {'clip': by_value},  # clipped by value, not by norm per MLP
}
PORTS = {name: port(**slip) for name, slip in SLIPS.items()}
CORRECT = PORTS['correct']
# The forward pass under nnx.vmap, 16 rays a group (a recording keeps each device's first 8 rows)
PER_GROUP = {name: port(per_group=True, **SLIPS[name]) for name in ('correct', 'relu-density')}
LATE = {name: port('nerf-like-late', late=True, **SLIPS[name]) for name in ('correct', 'interlevel-no-stop')}
LATE_PORT, PER_GROUP_PORT = LATE['correct'], PER_GROUP['correct']  # recorded as `update_rule_ports:LATE_PORT`
