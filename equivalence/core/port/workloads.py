"""The built-in workloads: model ports (``equivalence.core.port.ports.ModelPort``) like any user's.

Each entry names the mirrored model and loss of both packages, its synthetic data and
its optimizer. The harness, CLI and tests iterate over ``WORKLOADS``; adding a workload
means adding the two mirrored modules and one entry here. ``get`` also takes a user's
port by name, ``package.module:NAME``.
"""

import jax.numpy as jnp
import numpy as np
import optax

from equivalence.core.port import loading, ports
from equivalence.core.port.config import ConfigError
from equivalence.core.port.ports import ModelPort
from legacy_pmap import losses as legacy_losses
from legacy_pmap import models as legacy_models
from nnx_sharded import losses as nnx_losses
from nnx_sharded import models as nnx_models


def mlp_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict[str, np.ndarray]:
    """Regression targets from a fixed random two-layer teacher, plus noise."""
    w_FxT, v_Tx1 = rng.normal(size=(20, 8)) / np.sqrt(20), rng.normal(size=(8, 1))
    x = rng.normal(size=(n_steps, batch, 20))
    y = np.tanh(x @ w_FxT) @ v_Tx1 + 0.1 * rng.normal(size=(n_steps, batch, 1))
    return {'x': x.astype(np.float32), 'y': y.astype(np.float32)}


def wide_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict[str, np.ndarray]:
    """8 regression targets from a fixed random teacher on 64 features."""
    w_FxT, v_TxO = rng.normal(size=(64, 32)) / 8.0, rng.normal(size=(32, 8)) / np.sqrt(32)
    x = rng.normal(size=(n_steps, batch, 64))
    y = np.tanh(x @ w_FxT) @ v_TxO + 0.05 * rng.normal(size=(n_steps, batch, 8))
    return {'x': x.astype(np.float32), 'y': y.astype(np.float32)}


def wide_tx(lr_scale: float = 1.0) -> optax.GradientTransformation:
    """Adam with its default eps 1e-8. In its first steps Adam moves a weight by about
    lr * g / (|g| + eps); where a batch's per-example gradients cancel to |g| ~ 1e-7, the
    float32 rounding of that sum, which fsdp and tp order differently from pmap's per-device
    sums, is a relative error of ~1e-3 that the division carries into the weight. Measured at
    D=8, 20 steps, largest parameter difference from pmap under fsdp / tp / fsdp-tp: 7.8e-6 /
    1.0e-5 / 9.9e-6 (seed 0); the twin run (NNX on 1 device, same keys) differs from the checked
    NNX run by 3.2e-6 / 5.5e-6 / 7.1e-6 on the same leaves: reduction order, not a slip. cnn: up
    to 1.9e-5 under tp (hidden/kernel), twin 1.4e-5. The verdict holds each leaf to its measured
    floor (``equivalence.core.compare.rule``), and every strategy matches at D=8 (wide seeds 0, 1;
    cnn seeds 0, 3 and --rng global seed 3), so wide keeps the setting real code uses. cnn keeps
    eps 1e-5: with 1e-8 and per-device keys seed 5 at D=8 under dp and fsdp was a false MISMATCH,
    the pmap side's own chaos, which no legacy twin could measure while it drew other masks on
    another device count (68 of 70 runs matched, seeds 0-9). The legacy twin now draws with the
    run's per-device keys (``legacy_rows``) and both MATCH (docs/verdict.md)."""
    return optax.adam(1e-3 * lr_scale)


def ring_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict[str, np.ndarray]:
    """2-D mixture of 8 Gaussians on a circle of radius 2, the classic toy density."""
    angle = 2 * np.pi * rng.integers(0, 8, size=(n_steps, batch)) / 8
    centres = 2.0 * np.stack([np.cos(angle), np.sin(angle)], axis=-1)
    x = centres + 0.2 * rng.normal(size=centres.shape)
    return {'x': x.astype(np.float32)}


DIGITS_TEST = 297  # held out of load_digits' 1,797 images; 1,500 remain for training


def _digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's 8x8 digits (shipped inside the package: nothing is downloaded),
    scaled to [0, 1], in a fixed shuffled order so the held-out split never changes."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("the cnn workload needs scikit-learn: pip install -e '.[data]'") from None
    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))
    x = (digits.images[order] / 16.0).astype(np.float32)[..., None]
    return x, digits.target[order].astype(np.int32)


def digits_data(rng: np.random.Generator, n_steps: int, batch: int) -> dict[str, np.ndarray]:
    """Training batches drawn through shuffled epochs of the 1,500 training images."""
    x, y = _digits()
    x, y = x[DIGITS_TEST:], y[DIGITS_TEST:]
    epochs = -(-n_steps * batch // len(y))
    idx = np.concatenate([rng.permutation(len(y)) for _ in range(epochs)])[: n_steps * batch]
    idx = idx.reshape(n_steps, batch)
    return {'x': x[idx], 'y': y[idx]}


def digits_eval() -> dict[str, np.ndarray]:
    x, y = _digits()
    return {'x': x[:DIGITS_TEST], 'y': y[:DIGITS_TEST]}


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


WORKLOADS: dict[str, ModelPort] = {
    'mlp': ModelPort(
        name='mlp',
        summary='regression MLP 20->30->1, L2 loss, Adam',
        legacy_model=legacy_models.MLP,
        nnx_model=lambda rngs: nnx_models.MLP(rngs=rngs),
        legacy_loss=legacy_losses.mlp_loss,
        nnx_loss=nnx_losses.mlp_loss,
        noise=legacy_losses.no_noise,
        init_args=lambda b: (b['x'],),
        make_data=mlp_data,
        make_tx=mlp_tx,
        ema_rate=None,
        default_batch=64,
    ),
    'wide': ModelPort(
        name='wide',
        summary='wide MLP 64->256->256->8, GELU, Adam: every layer shards on 8 devices in every strategy',
        legacy_model=legacy_models.WideMLP,
        nnx_model=lambda rngs: nnx_models.WideMLP(rngs=rngs),
        legacy_loss=legacy_losses.wide_loss,
        nnx_loss=nnx_losses.wide_loss,
        noise=legacy_losses.no_noise,
        init_args=lambda b: (b['x'],),
        make_data=wide_data,
        make_tx=wide_tx,
        default_batch=64,
    ),
    'score': ModelPort(
        name='score',
        summary='denoising score matching (VE SDE), warmup, clipping, Adam, EMA',
        legacy_model=legacy_models.ScoreNet,
        nnx_model=lambda rngs: nnx_models.ScoreNet(rngs=rngs),
        legacy_loss=legacy_losses.score_loss,
        nnx_loss=nnx_losses.score_loss,
        noise=legacy_losses.score_noise,
        init_args=lambda b: (b['x'], jnp.ones(b['x'].shape[:1])),
        make_data=ring_data,
        make_tx=score_tx,
        ema_rate=0.999,
        default_batch=128,
    ),
    'cnn': ModelPort(
        name='cnn',
        summary='conv classifier with BatchNorm and Dropout on scikit-learn digits, Adam',
        legacy_model=legacy_models.CNN,
        nnx_model=lambda rngs: nnx_models.CNN(rngs=rngs),
        legacy_loss=legacy_losses.cnn_loss,
        nnx_loss=nnx_losses.cnn_loss,
        noise=legacy_losses.cnn_noise,
        init_args=lambda b: (b['x'], False),
        make_data=digits_data,
        make_tx=lambda lr_scale=1.0: optax.adam(3e-3 * lr_scale, eps=1e-5),  # eps: see wide_tx
        ema_rate=None,
        default_batch=64,
        eval_data=digits_eval,
        legacy_predict=legacy_losses.cnn_predict,
        nnx_predict=nnx_losses.cnn_predict,
    ),
}


def get(name: str) -> ports.Port:
    """A built-in workload, or a user's port named ``package.module:NAME``."""
    if ':' in name:
        return loading.load(name)
    if name not in WORKLOADS:
        choices = ', '.join(WORKLOADS)
        raise ConfigError(f'unknown workload {name!r}; choose one of {choices}, or a port as package.module:NAME')
    return WORKLOADS[name]
