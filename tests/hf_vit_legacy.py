"""Legacy side: Hugging Face's FlaxViTForImageClassification (hf_vit_modeling.py) trained by a pmap-era step in the
style of HF's examples/flax/vision/run_image_classification.py: a flax TrainState, `jax.pmap(train_step, 'batch')`,
grads pmean'd over 'batch', AdamW with a linear warmup + linear decay schedule, one-hot cross-entropy.

Two departures from that script, both from its sibling run_*_flax scripts: the dropout key is the step's third
argument, one per device (`dropout_rngs = jax.random.split(rng, jax.local_device_count())`, as run_clm_flax and
run_mlm_flax pass it) rather than a field of the TrainState, and AdamW has run_clm_flax's weight-decay mask (no decay
on biases and LayerNorm scales). Dropout is ON: hidden 0.1, attention 0.1."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import traverse_util
from flax.training import train_state
from flax.training.common_utils import onehot
from hf_vit_modeling import FlaxViTForImageClassification, FlaxViTForImageClassificationModule, ViTConfig

CONFIG = ViTConfig(
    image_size=16,
    patch_size=4,
    num_channels=3,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    num_labels=10,
    hidden_act='gelu',
    hidden_dropout_prob=0.1,
    attention_probs_dropout_prob=0.1,
    layer_norm_eps=1e-12,
)
LEARNING_RATE, WARMUP_STEPS, TOTAL_STEPS = 1e-3, 2, 20
B1, B2, EPS, WEIGHT_DECAY = 0.9, 0.999, 1e-8, 0.05

# HF's model wrapper, weights supplied by the train state (do_init=False): its __call__ takes NCHW pixel_values,
# transposes them to NHWC and applies the module with `not train` and rngs={'dropout': dropout_rng}.
hf_model = FlaxViTForImageClassification(CONFIG, do_init=False)


def model():
    return FlaxViTForImageClassificationModule(CONFIG)


def init_args(batch):
    """HF's init_weights applies the module to NHWC pixels (the wrapper transposes NCHW before apply)."""
    return (jnp.transpose(jnp.asarray(batch['pixel_values'], jnp.float32), (0, 2, 3, 1)),)


def create_learning_rate_fn(num_train_steps, num_warmup_steps, learning_rate):
    """run_image_classification's schedule (there in epochs x steps_per_epoch)."""
    warmup_fn = optax.linear_schedule(init_value=0.0, end_value=learning_rate, transition_steps=num_warmup_steps)
    decay_fn = optax.linear_schedule(
        init_value=learning_rate, end_value=0, transition_steps=num_train_steps - num_warmup_steps
    )
    return optax.join_schedules(schedules=[warmup_fn, decay_fn], boundaries=[num_warmup_steps])


linear_decay_lr_schedule_fn = create_learning_rate_fn(TOTAL_STEPS, WARMUP_STEPS, LEARNING_RATE)


def decay_mask_fn(params):
    """run_clm_flax's decay_mask_fn."""
    flat_params = traverse_util.flatten_dict(params)
    layer_norm_candidates = ['layernorm', 'layer_norm', 'ln']
    layer_norm_named_params = {
        layer[-2:]
        for layer_norm_name in layer_norm_candidates
        for layer in flat_params.keys()
        if layer_norm_name in ''.join(layer).lower()
    }
    flat_mask = {path: (path[-1] != 'bias' and path[-2:] not in layer_norm_named_params) for path in flat_params}
    return traverse_util.unflatten_dict(flat_mask)


def make_tx():
    return optax.adamw(
        learning_rate=linear_decay_lr_schedule_fn,
        b1=B1,
        b2=B2,
        eps=EPS,
        weight_decay=WEIGHT_DECAY,
        mask=decay_mask_fn,
    )


def create_train_state(params):
    return train_state.TrainState.create(apply_fn=hf_model.__call__, params=params, tx=make_tx())


def loss_fn(logits, labels):
    loss = optax.softmax_cross_entropy(logits, onehot(labels, logits.shape[-1]))
    return loss.mean()


def train_step(state, batch, dropout_rng):
    batch = dict(batch)

    def compute_loss(params):
        labels = batch.pop('labels')
        logits = state.apply_fn(**batch, params=params, dropout_rng=dropout_rng, train=True)[0]
        loss = loss_fn(logits, labels)
        return loss

    grad_fn = jax.value_and_grad(compute_loss)
    loss, grad = grad_fn(state.params)
    grad = jax.lax.pmean(grad, 'batch')

    new_state = state.apply_gradients(grads=grad)

    metrics = {'loss': loss, 'learning_rate': linear_decay_lr_schedule_fn(state.step)}
    metrics = jax.lax.pmean(metrics, axis_name='batch')
    return new_state, metrics


p_train_step = jax.pmap(train_step, 'batch', donate_argnums=(0,))


def make_data(rng, n_steps, batch, num_labels=CONFIG.num_labels, image_size=CONFIG.image_size):
    """Synthetic NCHW images: a class-specific template (fixed RandomState) plus noise, as the DataLoader gives."""
    templates = np.random.RandomState(1234).normal(size=(num_labels, 3, image_size, image_size))
    labels = rng.integers(0, num_labels, size=(n_steps, batch))
    pixels = templates[labels] + rng.normal(size=(n_steps, batch, 3, image_size, image_size))
    return {'pixel_values': pixels.astype(np.float32), 'labels': labels.astype(np.int32)}


if __name__ == '__main__':  # the legacy loop, as the script runs it
    from flax import jax_utils
    from flax.training.common_utils import shard

    rng = jax.random.PRNGKey(0)
    rng, init_rng = jax.random.split(rng)
    params = FlaxViTForImageClassification(CONFIG, seed=0).params
    state = jax_utils.replicate(create_train_state(params))
    dropout_rngs = jax.random.split(rng, jax.local_device_count())
    data = make_data(np.random.default_rng(0), 10, 8 * jax.local_device_count())
    for i in range(10):
        step_rngs = jax.vmap(jax.random.split)(dropout_rngs)
        dropout_rngs, rngs_now = step_rngs[:, 0], step_rngs[:, 1]
        state, metrics = p_train_step(state, shard({k: v[i] for k, v in data.items()}), rngs_now)
        print(i, jax_utils.unreplicate(metrics))
