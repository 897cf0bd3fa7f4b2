"""The same language model ported to NNX the way flax's own ``examples/lm1b_nnx`` is written
(not part of the suite): functional NNX under ``jax.jit``. The parameters are split off the
module into an ``nnx.State`` and kept, with the module's ``graphdef``, in a flax ``TrainState``;
the loss merges the module back (``nnx.merge(state.graphdef, params)``) and hands it the dropout
key at call time (``rngs=nnx.Rngs(dropout=dropout_rng)``); ``state.apply_gradients`` updates it;
no ``psum``: the metrics are sums over the global batch.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import common_utils, train_state

VOCAB, EMB, MLP, DROPOUT = 16, 16, 32, 0.1
LEARNING_RATE, WARMUP_STEPS, LABEL_SMOOTHING = 0.05, 4, 0.1


class LanguageModel(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, deterministic: bool = False):
        self.embed = nnx.Embed(VOCAB, EMB, rngs=rngs)
        self.norm = nnx.LayerNorm(EMB, rngs=rngs)
        self.hidden = nnx.Linear(EMB, MLP, rngs=rngs)
        self.head = nnx.Linear(MLP, VOCAB, rngs=rngs)
        self.dropout = nnx.Dropout(DROPOUT, deterministic=deterministic)

    def __call__(self, inputs, rngs: nnx.Rngs | None = None):
        y = self.dropout(self.embed(jnp.pad(inputs, ((0, 0), (1, 0)))[:, :-1]), rngs=rngs)
        y = self.dropout(nnx.relu(self.hidden(self.norm(y))), rngs=rngs)
        return self.head(y)


class TrainState(train_state.TrainState):
    graphdef: nnx.GraphDef[LanguageModel]


def create_learning_rate_schedule(learning_rate: float, warmup_steps: int):
    def step_fn(step):
        return learning_rate * jnp.minimum(1.0, step / warmup_steps) / jnp.sqrt(jnp.maximum(step, warmup_steps))

    return step_fn


learning_rate_fn = create_learning_rate_schedule(LEARNING_RATE, WARMUP_STEPS)


def _to_array(x):
    return x if isinstance(x, jax.Array) else jnp.asarray(x)


def create_train_state(model: LanguageModel, b2: float = 0.98) -> TrainState:
    """As lm1b_nnx's ``setup_initial_state`` builds it (less the mesh): every leaf an array."""
    tx = optax.adamw(learning_rate_fn, b1=0.9, b2=b2, eps=1e-9, weight_decay=0.0)
    graphdef, params = nnx.split(model, nnx.Param)
    state = TrainState.create(apply_fn=graphdef.apply, params=params, tx=tx, graphdef=graphdef)
    return jax.tree.map(_to_array, state)


def compute_weighted_cross_entropy(logits, targets, weights=None, label_smoothing=0.0):
    vocab_size = logits.shape[-1]
    confidence = 1.0 - label_smoothing
    low_confidence = (1.0 - confidence) / (vocab_size - 1)
    normalizing_constant = -(confidence * jnp.log(confidence) + (vocab_size - 1) * low_confidence * jnp.log(
        low_confidence + 1e-20))  # fmt: skip
    soft_targets = common_utils.onehot(targets, vocab_size, on_value=confidence, off_value=low_confidence)
    loss = -jnp.sum(soft_targets * nnx.log_softmax(logits), axis=-1)
    loss = loss - normalizing_constant
    normalizing_factor = np.prod(targets.shape)
    if weights is not None:
        loss = loss * weights
        normalizing_factor = weights.sum()
    return loss.sum(), normalizing_factor


def compute_metrics(logits, labels, weights, label_smoothing=0.0):
    loss, weight_sum = compute_weighted_cross_entropy(logits, labels, weights, label_smoothing)
    acc = jnp.sum(jnp.equal(jnp.argmax(logits, axis=-1), labels) * weights)
    return {'loss': loss, 'accuracy': acc, 'denominator': weight_sum}


def train_step(state: TrainState, batch, learning_rate_fn, label_smoothing=0.0, dropout_rng=None):
    """Perform a single training step."""
    inputs = batch['inputs']
    weights = jnp.where(inputs > 0, 1, 0).astype(jnp.float32)
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        module = nnx.merge(state.graphdef, params)
        module.set_attributes(deterministic=False)
        logits = module(inputs, rngs=nnx.Rngs(dropout=dropout_rng))
        loss, weight_sum = compute_weighted_cross_entropy(logits, inputs, weights, label_smoothing)
        return loss / weight_sum, logits

    lr = learning_rate_fn(state.step)
    (_, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    new_state = state.apply_gradients(grads=grads)
    metrics = compute_metrics(logits, inputs, weights)
    metrics['learning_rate'] = lr
    return new_state, metrics


jit_train_step = jax.jit(train_step, static_argnames=('learning_rate_fn', 'label_smoothing'), donate_argnums=0)
