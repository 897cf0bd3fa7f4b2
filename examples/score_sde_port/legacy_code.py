"""A team's score_sde training code, as it stands before the port (not part of the suite).

yang-song/score_sde's pattern, shrunk to 8x8 images so that it trains on a CPU in seconds:

- a DDPM-style UNet in linen (``models/ddpm.py``, ``layers.py``): a sinusoidal time embedding
  through two ``Dense``, a residual block (``GroupNorm`` with ``min(C // 4, 32)`` groups, as NCSN++
  takes them, the time embedding added, ``Dropout``, a 1x1 ``Dense`` skip where the channels change),
  a strided-conv downsampling, a self-attention block at 4x4 and a nearest-neighbour upsampling with
  a skip connection; auto-named submodules (``ResnetBlock_0/GroupNorm_0``, ...); initialisers left
  at flax's defaults;
- the continuous VP SDE's denoising score-matching loss (``losses.py``, ``get_sde_loss_fn``): random
  times, noise, and the dropout key drawn from the step's key, ``losses = (score * std + z)**2``;
- its training step (``losses.py``, ``get_step_fn``; ``run_lib.py``): ``value_and_grad``, ``pmean`` of
  the gradients, ``optimize_fn`` (``lr * min(step / warmup, 1)`` with the step *before* it is
  counted, so the first update has lr 0; global-norm clipping after the pmean; Adam), the EMA of the
  parameters, ``step + 1``, ``pmean`` of the loss; fused over steps and devices as
  ``jax.pmap(functools.partial(jax.lax.scan, train_step), axis_name='batch', donate_argnums=1)``,
  called as ``p_train_step((next_rng, pstate), batch)`` with per-device keys
  (``rng, *next_rng = random.split(rng, n_dev + 1)``).

``flax.optim`` is gone: ``optax.scale_by_adam`` stands in for ``flax.optim.Adam`` (the same moments),
and ``optimize_fn`` applies ``params - lr * direction`` as its ``apply_gradient(grad, learning_rate=lr)``.
"""

import functools
import math
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

IMAGE, NF, DROPOUT = (8, 8, 1), 8, 0.1
LR, WARMUP, GRAD_CLIP, EMA_RATE = 2e-3, 4, 1.0, 0.999
BETA_MIN, BETA_MAX, EPS = 0.1, 20.0, 1e-5  # the VP SDE; times drawn in [EPS, 1]
ADAM = optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8)  # flax.optim.Adam's defaults in score_sde's config

act = nn.swish


def get_timestep_embedding(timesteps, embedding_dim: int, max_positions=10000):
    half_dim = embedding_dim // 2
    emb = math.log(max_positions) / (half_dim - 1)
    emb = jnp.exp(jnp.arange(half_dim, dtype=jnp.float32) * -emb)
    emb = timesteps[:, None] * emb[None, :]
    return jnp.concatenate([jnp.sin(emb), jnp.cos(emb)], axis=1)


class ResnetBlock(nn.Module):
    out_ch: int
    dropout: float = DROPOUT

    @nn.compact
    def __call__(self, x, temb, train: bool):
        C = x.shape[-1]
        h = act(nn.GroupNorm(num_groups=min(C // 4, 32))(x))
        h = nn.Conv(self.out_ch, (3, 3))(h)
        h += nn.Dense(self.out_ch)(act(temb))[:, None, None, :]
        h = act(nn.GroupNorm(num_groups=min(self.out_ch // 4, 32))(h))
        h = nn.Dropout(self.dropout)(h, deterministic=not train)
        h = nn.Conv(self.out_ch, (3, 3))(h)
        if C != self.out_ch:
            x = nn.Dense(self.out_ch)(x)  # NIN: a 1x1 projection of the channels
        return x + h


class AttnBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        B, H, W, C = x.shape
        h = nn.GroupNorm(num_groups=min(C // 4, 32))(x)
        q, k, v = nn.Dense(C)(h), nn.Dense(C)(h), nn.Dense(C)(h)
        w = jnp.einsum('bhwc,bHWc->bhwHW', q, k) * (int(C) ** (-0.5))
        w = jax.nn.softmax(jnp.reshape(w, (B, H, W, H * W)), axis=-1)
        h = jnp.einsum('bhwHW,bHWc->bhwc', jnp.reshape(w, (B, H, W, H, W)), v)
        return x + nn.Dense(C)(h)


class UNet(nn.Module):
    nf: int = NF

    @nn.compact
    def __call__(self, x, labels, train: bool):
        temb = get_timestep_embedding(labels, self.nf)
        temb = nn.Dense(self.nf * 4)(temb)
        temb = nn.Dense(self.nf * 4)(act(temb))
        h = nn.Conv(self.nf, (3, 3))(x)
        skip = ResnetBlock(self.nf * 2)(h, temb, train)  # 8x8, nf -> 2 nf
        h = nn.Conv(self.nf * 2, (3, 3), strides=(2, 2))(skip)  # 4x4
        h = AttnBlock()(h)
        B, H, W, C = h.shape
        h = nn.Conv(self.nf * 2, (3, 3))(jax.image.resize(h, (B, H * 2, W * 2, C), 'nearest')) + skip
        h = act(nn.GroupNorm(num_groups=min(h.shape[-1] // 4, 32))(h))
        return nn.Conv(x.shape[-1], (3, 3))(h)


# -- the SDE and the loss (losses.py, sde_lib.py) ---------------------------------------------------


def marginal_prob(x, t):
    log_mean_coeff = -0.25 * t**2 * (BETA_MAX - BETA_MIN) - 0.5 * t * BETA_MIN
    mean = jnp.exp(log_mean_coeff)[:, None, None, None] * x
    std = jnp.sqrt(1.0 - jnp.exp(2.0 * log_mean_coeff))
    return mean, std


def batch_mul(a, b):
    return a[:, None, None, None] * b


def loss_fn(rng, params, states, batch):
    data = batch['image']
    rng, step_rng = jax.random.split(rng)
    t = jax.random.uniform(step_rng, (data.shape[0],), minval=EPS, maxval=1.0)
    rng, step_rng = jax.random.split(rng)
    z = jax.random.normal(step_rng, data.shape)
    mean, std = marginal_prob(data, t)
    perturbed_data = mean + batch_mul(std, z)
    rng, step_rng = jax.random.split(rng)
    # get_score_fn (VP, continuous): the model conditioned on t * 999, its output over -std
    model_out = UNet().apply({'params': params, **states}, perturbed_data, t * 999, train=True,
                             rngs={'dropout': step_rng})  # fmt: skip
    score = -batch_mul(1.0 / std, model_out)
    losses = jnp.square(batch_mul(std, score) + z)
    losses = jnp.mean(losses.reshape((losses.shape[0], -1)), axis=-1)  # reduce_mean=True
    return jnp.mean(losses), states


# -- the train state and the step (utils.py, losses.py) --------------------------------------------


@flax.struct.dataclass
class State:
    step: int
    params: Any
    opt_state: Any  # flax.optim.Adam's moments: optax.scale_by_adam's state
    lr: float
    model_state: Any
    ema_rate: float
    params_ema: Any


def create_state(variables: dict) -> State:
    params = variables['params']
    return State(step=0, params=params, opt_state=ADAM.init(params), lr=LR, model_state={}, ema_rate=EMA_RATE,
                 params_ema=params)  # fmt: skip


def optimize_fn(state: State, grad, warmup=WARMUP, grad_clip=GRAD_CLIP):
    """score_sde's optimization_manager: warmup on the step before it is counted, then clipping, then Adam."""
    lr = state.lr
    if warmup > 0:
        lr = lr * jnp.minimum(state.step / warmup, 1.0)
    if grad_clip >= 0:
        grad_norm = jnp.sqrt(sum([jnp.sum(jnp.square(x)) for x in jax.tree.leaves(grad)]))
        clipped_grad = jax.tree.map(lambda x: x * grad_clip / jnp.maximum(grad_norm, grad_clip), grad)
    else:
        clipped_grad = grad
    direction, opt_state = ADAM.update(clipped_grad, state.opt_state)  # apply_gradient(grad, learning_rate=lr)
    return jax.tree.map(lambda p, d: p - lr * d, state.params, direction), opt_state


def train_step(carry_state, batch):
    """score_sde's step_fn on one device: ``((rng, state), batch) -> ((rng, state), loss)``."""
    (rng, state) = carry_state
    rng, step_rng = jax.random.split(rng)
    grad_fn = jax.value_and_grad(loss_fn, argnums=1, has_aux=True)
    (loss, new_model_state), grad = grad_fn(step_rng, state.params, state.model_state, batch)
    grad = jax.lax.pmean(grad, axis_name='batch')
    new_params, new_opt_state = optimize_fn(state, grad)
    new_params_ema = jax.tree.map(lambda p_ema, p: p_ema * state.ema_rate + p * (1.0 - state.ema_rate),
                                  state.params_ema, new_params)  # fmt: skip
    step = state.step + 1
    new_state = state.replace(step=step, params=new_params, opt_state=new_opt_state, model_state=new_model_state,
                              params_ema=new_params_ema)  # fmt: skip
    loss = jax.lax.pmean(loss, axis_name='batch')
    return (rng, new_state), loss


p_train_step = jax.pmap(functools.partial(jax.lax.scan, train_step), axis_name='batch', donate_argnums=1)


def make_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict:
    """``{'image': [n_steps, batch, 8, 8, 1]}`` in [-1, 1] (score_sde's centred scaler applied): random blobs."""
    yy, xx = np.mgrid[0:8, 0:8] / 7.0
    centre = rng.random(size=(n_steps, batch, 2, 1, 1))
    width = 0.1 + 0.3 * rng.random(size=(n_steps, batch, 1, 1))
    blob = np.exp(-((yy - centre[:, :, 0]) ** 2 + (xx - centre[:, :, 1]) ** 2) / width)
    return {'image': (2 * blob[..., None] - 1).astype(np.float32)}
