"""The registry: a workload is data, not a code path.

Each entry names the mirrored model and loss of both packages, its synthetic data and
its optimizer. The harness, CLI and tests iterate over ``WORKLOADS``; adding a workload
means adding the two mirrored modules and one entry here.
"""

import dataclasses
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import optax

from legacy_pmap import losses as legacy_losses
from legacy_pmap import models as legacy_models
from nnx_sharded import losses as nnx_losses
from nnx_sharded import models as nnx_models


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    summary: str
    legacy_model: Callable  # () -> linen Module
    nnx_model: Callable  # (rngs) -> nnx Module
    legacy_loss: Callable  # (model, params, model_state, batch, noise) -> (losses_B, model_state)
    nnx_loss: Callable  # (model, batch, noise) -> losses_B
    legacy_noise: Callable  # (key, x_shape) -> noise dict
    nnx_noise: Callable  # (key, x_shape) -> noise dict
    init_args: Callable  # (batch of 1) -> positional args of the linen init call
    make_data: Callable  # (np Generator, n_steps, global_batch) -> {name: [N, G, ...]}
    make_tx: Callable  # (lr_scale) -> optax transformation
    ema_rate: float | None  # EMA of the parameters each step, or None
    default_batch: int  # global batch when --batch-size is not given


def mlp_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict[str, np.ndarray]:
    """Regression targets from a fixed random two-layer teacher, plus noise."""
    w_FxT, v_Tx1 = rng.normal(size=(20, 8)) / np.sqrt(20), rng.normal(size=(8, 1))
    x = rng.normal(size=(n_steps, batch, 20))
    y = np.tanh(x @ w_FxT) @ v_Tx1 + 0.1 * rng.normal(size=(n_steps, batch, 1))
    return {'x': x.astype(np.float32), 'y': y.astype(np.float32)}


def ring_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict[str, np.ndarray]:
    """2-D mixture of 8 Gaussians on a circle of radius 2, the classic toy density."""
    angle = 2 * np.pi * rng.integers(0, 8, size=(n_steps, batch)) / 8
    centres = 2.0 * np.stack([np.cos(angle), np.sin(angle)], axis=-1)
    x = centres + 0.2 * rng.normal(size=centres.shape)
    return {'x': x.astype(np.float32)}


def mlp_tx(lr_scale: float = 1.0) -> optax.GradientTransformation:
    return optax.adam(1e-3 * lr_scale)


def score_tx(lr_scale: float = 1.0, lr: float = 2e-3, warmup: int = 10, clip: float = 1.0):
    """score_sde's optimize_fn: lr * min(step / warmup, 1) read *before* the step is
    counted (the first update has lr 0), global-norm clipping of the averaged gradient,
    then Adam(0.9, 0.999, 1e-8). Warmup is 10 steps, not 5000, so a short run sees it end.
    """
    peak = lr * lr_scale
    schedule = lambda count: peak * jnp.minimum(count / warmup, 1.0)  # noqa: E731
    return optax.chain(optax.clip_by_global_norm(clip), optax.adam(schedule, b1=0.9, b2=0.999, eps=1e-8))


WORKLOADS: dict[str, Workload] = {
    'mlp': Workload(
        name='mlp',
        summary='regression MLP 20->30->1, L2 loss, Adam',
        legacy_model=legacy_models.MLP,
        nnx_model=lambda rngs: nnx_models.MLP(rngs=rngs),
        legacy_loss=legacy_losses.mlp_loss,
        nnx_loss=nnx_losses.mlp_loss,
        legacy_noise=legacy_losses.no_noise,
        nnx_noise=nnx_losses.no_noise,
        init_args=lambda b: (b['x'],),
        make_data=mlp_data,
        make_tx=mlp_tx,
        ema_rate=None,
        default_batch=64,
    ),
    'score': Workload(
        name='score',
        summary='denoising score matching (VE SDE), warmup, clipping, Adam, EMA',
        legacy_model=legacy_models.ScoreNet,
        nnx_model=lambda rngs: nnx_models.ScoreNet(rngs=rngs),
        legacy_loss=legacy_losses.score_loss,
        nnx_loss=nnx_losses.score_loss,
        legacy_noise=legacy_losses.score_noise,
        nnx_noise=nnx_losses.score_noise,
        init_args=lambda b: (b['x'], jnp.ones(b['x'].shape[:1])),
        make_data=ring_data,
        make_tx=score_tx,
        ema_rate=0.999,
        default_batch=128,
    ),
}


def get(name: str) -> Workload:
    from equivalence.config import ConfigError

    if name not in WORKLOADS:
        raise ConfigError(f'unknown workload {name!r}; choose one of {", ".join(WORKLOADS)}')
    return WORKLOADS[name]
