"""The location corpus: small loop ports of one NeRF-like step in the structures real ports take, each with
one-constant slips whose true place is known (``SLIPS``, each with its ``Truth``), and the correct port (the
negative control); ``CORPUS``: what the tests run, and what each case must do.

The pmap step (``pmap_step``) is the user's own: each device samples its rays' points from its own key, a
proposal MLP and a NeRF MLP (the second fed the first's weights), a data loss, an interlevel term behind a
``stop_gradient`` and a distortion term, each term returned as a metric, and each MLP's gradient clipped by
its own norm (``optax.multi_transform``) before Adam. The NNX step runs the forward pass per group of rows
(group d: pmap device d's rows and key), in one of the structures (``STRUCTURES``):

- ``vmap``: ``nnx.vmap(in_axes=(None, 0, 0))`` over the groups, as docs/port.md recommends, with 16 rows a
  device (a recording keeps each device's first 8);
- ``loop``: a Python loop over the groups instead (``loop-reversed``: the last group first), each MLP's hidden
  layers kept in a list (``prop_mlp/layers/0``, one level deeper than linen's ``prop_mlp/Dense_0``, beside
  ``prop_mlp/Dense_2``), paired through the port's ``names``;
- ``scan``: the MLPs' hidden layers stacked and run by ``nnx.scan`` (linen's ``nn.scan`` on the pmap side), the
  model over the whole batch at once (``vmap-scan``: per group, vmapped).

Each slip changes one constant of the NNX side (``Slip``); its place is the stage and the place ``where:``
must name (``Truth``), or may leave unsaid: a place said must be the true one.
"""

import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

from equivalence import LoopPort

AXIS, DEVICES, ROWS = 'batch', 2, 16  # rows a device: more than a recording keeps (8)
WIDTH, SAMPLES, LAYERS, NEAR, FAR = 8, 4, 2, 2.0, 6.0
WEIGHTS = {'data': 1.0, 'interlevel': 1.0, 'distortion': 0.01}
CLIP, LR, EPS = 1e-2, 1e-2, 1e-4  # each MLP's gradient clipped to 1e-2; Adam's eps makes the clipping show


# -- the pmap side: linen, as the user wrote it --


class LinenLayer(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        return nn.relu(nn.Dense(WIDTH, name='Dense_0')(x)), None


class LinenMLP(nn.Module):
    """Points ``[R, S, F]`` -> (density ``[R, S]``, features ``[R, S, out - 1]``)."""

    out: int
    scan: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(WIDTH, name='Dense_0')(x))
        if self.scan:
            layers = nn.scan(LinenLayer, variable_axes={'params': 0}, split_rngs={'params': True}, length=LAYERS)
            x, _ = layers(name='layers')(x, None)
        else:
            x = nn.relu(nn.Dense(WIDTH, name='Dense_1')(x))
        raw = nn.Dense(self.out, name='Dense_2')(x)
        return nn.softplus(raw[..., 0]), raw[..., 1:]


def composite(density, t):
    """Alpha-compositing weights ``[R, S]`` of each ray's samples."""
    delta = jnp.diff(t, axis=-1, append=t[..., -1:] + 1.0)
    alpha = 1 - jnp.exp(-density * delta)
    trans = jnp.cumprod(jnp.concatenate([jnp.ones_like(alpha[..., :1]), 1 - alpha[..., :-1]], -1), -1)
    return alpha * trans


class LinenNerf(nn.Module):
    scan: bool = False

    @nn.compact
    def __call__(self, pts, t):
        w_p = composite(LinenMLP(1, self.scan, name='prop_mlp')(pts)[0], t)
        density, raw_rgb = LinenMLP(4, self.scan, name='nerf_mlp')(jnp.concatenate([pts, w_p[..., None]], -1))
        w = composite(density, t)
        return (w[..., None] * nn.sigmoid(raw_rgb)).sum(-2), w, w_p


def sample(rays: dict, key, near: float = NEAR):
    """Each ray's points ``[R, S, 3]`` at sorted depths ``t`` drawn from ``key``."""
    t = near + (FAR - near) * jnp.sort(jax.random.uniform(key, (rays['origins'].shape[0], SAMPLES)), -1)
    return rays['origins'][:, None] + t[..., None] * rays['dirs'][:, None], t


def terms(rgb, w, w_p, t, target, stop: bool = True, weights: dict = WEIGHTS) -> dict:
    """The loss's terms, each weighted and a mean over the rows, as upstream reports them (the loss is their sum):
    data, interlevel (the NeRF's weights held fixed), distortion."""
    held = jax.lax.stop_gradient(w) if stop else w
    distortion = (w[..., :, None] * w[..., None, :] * jnp.abs(t[..., :, None] - t[..., None, :])).sum((-1, -2))
    raw = {
        'data': jnp.mean((rgb - target) ** 2),
        'interlevel': jnp.mean(jax.nn.relu(held - w_p) ** 2),
        'distortion': jnp.mean(distortion),
    }
    return {k: weights[k] * v for k, v in raw.items()}


def total(losses: dict):
    return sum(losses[k] for k in sorted(losses))


def per_mlp(params) -> Any:
    """Each leaf's MLP (the params' first key): ``optax.multi_transform``'s labels, for a dict or an ``nnx.State``."""
    return jax.tree_util.tree_map_with_path(lambda path, _: str(getattr(path[0], 'key', path[0])), params)


def make_tx(clip: str = 'per-mlp', value: float = CLIP, lr: float = LR):
    clipping = {
        'per-mlp': optax.multi_transform(
            {'prop_mlp': optax.clip_by_global_norm(value), 'nerf_mlp': optax.clip_by_global_norm(value)}, per_mlp
        ),
        'global': optax.clip_by_global_norm(value),
        'none': optax.identity(),
    }[clip]
    return optax.chain(clipping, optax.adam(lr, eps=EPS))


def pmap_step(state, batch, rng):
    """The user's pmapped step (the suite pmaps it over ``AXIS``): this device's rays sampled from its key."""
    pts, t = sample(batch, rng)

    def loss_fn(params):
        rgb, w, w_p = state.apply_fn({'params': params}, pts, t)
        losses = terms(rgb, w, w_p, t, batch['rgb'])
        return total(losses), losses

    (loss, losses), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=jax.lax.pmean(grads, AXIS))
    return state, jax.lax.pmean({'loss': loss, 'losses': losses}, AXIS)


def make_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict:
    dirs = rng.normal(size=(n_steps, batch, 3))
    return {
        'origins': rng.normal(size=(n_steps, batch, 3)).astype(np.float32) * 0.5,
        'dirs': (dirs / np.linalg.norm(dirs, axis=-1, keepdims=True)).astype(np.float32),
        'rgb': rng.uniform(size=(n_steps, batch, 3)).astype(np.float32),
    }


# -- the new side: NNX, written blind --


class Slip(NamedTuple):
    """One constant of the NNX side, changed (the defaults: the correct port)."""

    activation: Any = jax.nn.softplus  # each MLP's density activation
    layer_activation: Any = jax.nn.relu  # the activation of each scanned layer (``scan``)
    dtype: Any = None  # the density Dense's dtype (the prop MLP's last layer)
    near: float = NEAR  # the near plane rays are sampled from
    fold: int | None = None  # each group's key folded with this first
    weights: tuple = tuple(sorted(WEIGHTS.items()))  # the loss terms' weights
    stop: bool = True  # the interlevel term's stop_gradient
    clip: str = 'per-mlp'  # how the gradients are clipped
    clip_value: float = CLIP
    padding: float = 0.0  # the colour's padding, in the model's own code after its last submodule call


class NnxLayer(nnx.Module):
    def __init__(self, activation, rngs: nnx.Rngs):
        self.activation = activation
        self.Dense_0 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return self.activation(self.Dense_0(x))


class NnxMLP(nnx.Module):
    def __init__(self, fin: int, out: int, scan: bool, slip: Slip, dtype=None, listed=False, *, rngs: nnx.Rngs):
        self.scan, self.activation, self.listed = scan, slip.activation, listed
        if listed:  # the hidden layers in a list, one level deeper than linen's Dense_0, Dense_1
            self.layers = nnx.List([nnx.Linear(fin, WIDTH, rngs=rngs), nnx.Linear(WIDTH, WIDTH, rngs=rngs)])
        else:
            self.Dense_0 = nnx.Linear(fin, WIDTH, rngs=rngs)
        if scan:
            self.layers = nnx.vmap(lambda r: NnxLayer(slip.layer_activation, r), in_axes=0, out_axes=0)(
                rngs.fork(split=LAYERS)
            )
        elif not listed:
            self.Dense_1 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.Dense_2 = nnx.Linear(WIDTH, out, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        for layer in self.layers if self.listed else [self.Dense_0]:
            x = nnx.relu(layer(x))
        if self.scan:
            x = nnx.scan(lambda layer, h: (layer(h), None), in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))(
                self.layers, x
            )[0]
        elif not self.listed:
            x = nnx.relu(self.Dense_1(x))
        raw = self.Dense_2(x).astype(jnp.float32)
        return self.activation(raw[..., 0]), raw[..., 1:]


class NnxNerf(nnx.Module):
    def __init__(self, scan: bool, slip: Slip, listed: bool = False, *, rngs: nnx.Rngs):
        self.prop_mlp = NnxMLP(3, 1, scan, slip, slip.dtype, listed, rngs=rngs)
        self.nerf_mlp = NnxMLP(4, 4, scan, slip, listed=listed, rngs=rngs)
        self.padding = slip.padding

    def __call__(self, pts, t):
        w_p = composite(self.prop_mlp(pts)[0], t)
        density, raw_rgb = self.nerf_mlp(jnp.concatenate([pts, w_p[..., None]], -1))
        w = composite(density, t)
        rgb = nnx.sigmoid(raw_rgb) * (1 + 2 * self.padding) - self.padding
        return (w[..., None] * rgb).sum(-2), w, w_p


def new_step(structure: str, slip: Slip):
    """The NNX step: each group of rows sampled with its key (group d: pmap device d's rows and key), the forward
    pass in ``structure``: per group, vmapped (``vmap``; ``vmap-scan``: its layers scanned) or in a Python loop
    (``loop``; ``loop-reversed``: the last group first, a correct port too), or over the whole batch at once
    (``scan``, its layers scanned)."""

    def sampled(rays, key):
        return sample(rays, key if slip.fold is None else jax.random.fold_in(key, slip.fold), slip.near)

    def group(model, rays, key):
        pts, t = sampled(rays, key)
        return terms(*model(pts, t), t, rays['rgb'], slip.stop, dict(slip.weights))

    def whole(model, groups, keys):  # the model over every row at once; the loss's terms per group
        pts, t = jax.vmap(sampled)(groups, keys)
        rows = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731 -- [D, B / D, ...] -> [B, ...]
        out = model(rows(pts), rows(t))
        out = [a.reshape(*t.shape[:2], *a.shape[1:]) for a in out]  # back to [D, B / D, ...]
        each = lambda rgb, w, w_p, t, y: terms(rgb, w, w_p, t, y, slip.stop, dict(slip.weights))  # noqa: E731
        return jax.vmap(each)(*out, t, groups['rgb'])

    @nnx.jit
    def step(ts, batch, keys):
        model, optimizer = ts
        d = keys.shape[0]
        groups = jax.tree.map(lambda a: a.reshape(d, -1, *a.shape[1:]), batch)

        def loss_fn(model):
            if structure.startswith('loop'):
                order = range(d)[::-1] if structure == 'loop-reversed' else range(d)
                each = [group(model, jax.tree.map(lambda a, i=i: a[i], groups), keys[i]) for i in order]
                per_group = jax.tree.map(lambda *x: jnp.stack(x), *each)
            elif structure == 'scan':
                per_group = whole(model, groups, keys)
            else:
                per_group = nnx.vmap(group, in_axes=(None, 0, 0))(model, groups, keys)
            losses = jax.tree.map(jnp.mean, per_group)  # each group's mean, averaged: the pmap side's pmean
            return total(losses), losses

        (loss, losses), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        return {'loss': loss, 'losses': losses}

    return step


STRUCTURES = ('vmap', 'loop', 'loop-reversed', 'scan', 'vmap-scan')
LISTED = {f'{mlp}/Dense_{i}': f'{mlp}/layers/{i}' for mlp in ('prop_mlp', 'nerf_mlp') for i in (0, 1)}  # ``loop``'s


def port(structure: str, name: str = 'correct') -> LoopPort:
    """The corpus's port of ``structure`` with slip ``name`` ('correct': none)."""
    slip, scan = SLIPS[name][0] if name in SLIPS else Slip(), structure.endswith('scan')
    tx, listed = make_tx(), structure.startswith('loop')
    return LoopPort(
        name=f'corpus-{structure}-{name}',
        legacy_model=functools.partial(LinenNerf, scan),
        nnx_model=lambda rngs: NnxNerf(scan, slip, listed, rngs=rngs),
        names=LISTED if listed else None, make_data=make_data, legacy_step=pmap_step, step_form='state_rng',
        legacy_state=lambda v: train_state.TrainState.create(apply_fn=LinenNerf(scan).apply, params=v['params'], tx=tx),
        new_state=lambda model: (model, nnx.Optimizer(model, make_tx(slip.clip, slip.clip_value), wrt=nnx.Param)),
        new_step=new_step(structure, slip),
        init_args=lambda batch: sample({k: v[:1] for k, v in batch.items()}, jax.random.key(0)),
        axis_name=AXIS, loss='loss', default_batch=DEVICES * ROWS, rng_modes=('per-device',),
    )  # fmt: skip


# -- the truth: where each slip's two sides part --


class Truth(NamedTuple):
    """The places a slip's location may name, each ``(its kind, a part of its NNX place)`` ('' any place), the
    first where the corpus says it is placed; anything else it names is a wrong place. 'Not located' is never
    wrong."""

    places: tuple[tuple[str, str], ...]


SLIPS: dict[str, tuple[Slip, Truth]] = {
    # the density activation, inside each MLP's __call__, after its submodules: the MLP's own code
    'relu-density': (Slip(activation=jax.nn.relu), Truth((('between', 'prop_mlp (inside)'),))),
    # the density Dense in bfloat16: that Dense computes something else
    'bf16-density': (Slip(dtype=jnp.bfloat16), Truth((('module', 'prop_mlp/Dense_2'),))),
    # the near plane: the code that samples the points the first Dense is fed
    'near-plane': (Slip(near=2.5), Truth((('between', '(the inputs) → prop_mlp/Dense_0'),))),
    # each group's key folded: the step's own random draws
    'key-folded': (Slip(fold=1), Truth((('randomness', "the step's own random draws"),))),
    # the scanned layers' activation (``scan``): each layer's own code, after its Dense; or, coarser, the code
    # between the Dense before the scan and the one after it
    'gelu-layer': (
        Slip(layer_activation=jax.nn.gelu),
        Truth((('between', 'prop_mlp/layers (inside)'), ('between', 'prop_mlp/Dense_0 → prop_mlp/Dense_2'))),
    ),
    # a loss term's weight: the loss
    'distortion-weight': (Slip(weights=tuple(sorted({**WEIGHTS, 'distortion': 0.02}.items()))), Truth((('loss', ''),))),
    # the interlevel term without its stop_gradient: the same loss value, another gradient, into the NeRF MLP only
    'interlevel-no-stop': (Slip(stop=False), Truth((('backward', 'nerf_mlp/'), ('loss', '')))),
    # clipping by the global norm, or not at all, instead of each MLP's own: the update rule
    'clip-global': (Slip(clip='global'), Truth((('update', ''),))),
    'clip-none': (Slip(clip='none'), Truth((('update', ''),))),
    # the colour's padding, in the model's own code after its last submodule call, before its output; not the loss
    'rgb-padding': (Slip(padding=1e-3), Truth((('between', '(the model) (inside)'),))),
}
CORRECT = Truth(())  # the correct port: no place

# What the corpus runs, (structure, slip), and what each must do beyond naming no wrong place: 'placed' (at its
# truth's first place), or '' (the rule alone: 'not located' allowed). Each mechanism runs on the structures it
# depends on (the forward pass's rows on all three, the draws, the loss and the update rule on vmap alone), to
# keep within the suite's budget; every slip here was measured on every structure: none placed wrong, all placed
# but 'clip-none' (not located: the per-leaf factor's reading). ('loop', 'bf16-density'), placed, is held by the
# loop's rgb-padding: both read a call joined over the groups.
CORPUS: dict[tuple[str, str], str] = {
    ('vmap', 'correct'): '',
    ('vmap', 'relu-density'): 'placed',
    ('vmap', 'bf16-density'): 'placed',
    ('vmap', 'near-plane'): 'placed',
    ('vmap', 'key-folded'): 'placed',
    ('vmap', 'distortion-weight'): 'placed',
    ('vmap', 'interlevel-no-stop'): 'placed',
    ('vmap', 'clip-global'): '',  # the update rule, with another cause; the cause is the test below's
    ('loop', 'correct'): '',
    ('loop', 'rgb-padding'): 'placed',  # the model paired though its MLPs nest deeper; its calls joined over the groups
    ('loop-reversed', 'bf16-density'): '',  # its groups in another order than the devices': not located
    ('scan', 'correct'): '',
    ('scan', 'gelu-layer'): 'placed',
    # the scanned layers under the vmap over the groups call back once a group in no known order: left out, and
    # the Dense after them compared
    ('vmap-scan', 'bf16-density'): 'placed',
}
# Where the cause is the update rule's or a loss term's, the word the location's line says once it names it, placed
# or not (the clipping; the loss term whose metric alone parts): an expected failure until that attribution lands.
CAUSES = {'clip-global': 'clip', 'clip-none': 'clip', 'distortion-weight': 'distortion'}
