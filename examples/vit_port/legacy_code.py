"""A research group's pmap-era Vision Transformer training code, written as the ViT papers' code
was (linen era): patch embedding by a strided ``nn.Conv``, a class token, learned position
embeddings, pre-LayerNorm encoder blocks with dropout 0.1, a **zero-initialised head**, and
``update_fn(params, opt_state, batch, rng)`` pmapped with ``axis_name='batch'``, the gradient
``pmean``'d by hand; SGD with momentum 0.9, gradient clipping at global norm 1, a warmup + cosine
schedule, and the momentum kept in **bfloat16** (``accumulator_dtype='bfloat16'``, the usual
memory saving; ``make_tx(accumulator_dtype=None)`` keeps it in float32). Its sizes are the model's
fields, as vit_jax's configs set them: the defaults are shrunk to 8x8 images, patch 4, 2 layers, so that
it trains on a CPU in seconds; ``my_port.py`` sets ViT-S and ViT-B depth and width. Not part of the suite.

One line differs from such code as found: it binds the dropout key to the device
(``fold_in(rng, lax.axis_index('batch'))``), so its masks depend on the device count and no
global-batch port can draw them; the team dropped the line before porting (both sides draw from
the key they are given: docs/randomness.md).
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

NUM_CLASSES, IMAGE_SIZE, PATCH, HIDDEN, HEADS, MLP_DIM, LAYERS, DROPOUT = 10, 8, 4, 16, 2, 32, 2, 0.1
BASE_LR, WARMUP_STEPS, TOTAL_STEPS, GRAD_NORM_CLIP = 0.03, 2, 20, 1.0


class MlpBlock(nn.Module):
    mlp_dim: int
    dropout_rate: float = DROPOUT

    @nn.compact
    def __call__(self, inputs, *, deterministic):
        x = nn.Dense(self.mlp_dim, kernel_init=nn.initializers.xavier_uniform(),
                     bias_init=nn.initializers.normal(stddev=1e-6))(inputs)  # fmt: skip
        x = nn.Dropout(rate=self.dropout_rate)(nn.gelu(x), deterministic=deterministic)
        out = nn.Dense(inputs.shape[-1], kernel_init=nn.initializers.xavier_uniform(),
                       bias_init=nn.initializers.normal(stddev=1e-6))(x)  # fmt: skip
        return nn.Dropout(rate=self.dropout_rate)(out, deterministic=deterministic)


class Encoder1DBlock(nn.Module):
    mlp_dim: int
    num_heads: int
    dropout_rate: float = DROPOUT

    @nn.compact
    def __call__(self, inputs, *, deterministic):
        x = nn.LayerNorm()(inputs)
        x = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, kernel_init=nn.initializers.xavier_uniform(),
                                            broadcast_dropout=False, deterministic=deterministic,
                                            dropout_rate=0.0)(x, x)  # fmt: skip
        x = nn.Dropout(rate=self.dropout_rate)(x, deterministic=deterministic) + inputs
        y = nn.LayerNorm()(x)
        return x + MlpBlock(mlp_dim=self.mlp_dim, dropout_rate=self.dropout_rate)(y, deterministic=deterministic)


class Encoder(nn.Module):
    num_layers: int
    mlp_dim: int
    num_heads: int
    dropout_rate: float = DROPOUT

    @nn.compact
    def __call__(self, x, *, train):
        pos = self.param('pos_embedding', nn.initializers.normal(stddev=0.02), (1, x.shape[1], x.shape[2]))
        x = nn.Dropout(rate=self.dropout_rate)(x + pos, deterministic=not train)
        for lyr in range(self.num_layers):
            x = Encoder1DBlock(self.mlp_dim, self.num_heads, self.dropout_rate,
                               name=f'encoderblock_{lyr}')(x, deterministic=not train)  # fmt: skip
        return nn.LayerNorm(name='encoder_norm')(x)


class VisionTransformer(nn.Module):
    num_classes: int = NUM_CLASSES
    hidden_size: int = HIDDEN
    patch_size: int = PATCH  # vit_jax: patches.size
    num_layers: int = LAYERS  # vit_jax: the transformer config's fields
    mlp_dim: int = MLP_DIM
    num_heads: int = HEADS

    @nn.compact
    def __call__(self, inputs, train):  # keyword-only upstream (*, train); the suite's init passes it by position
        p = self.patch_size
        x = nn.Conv(self.hidden_size, (p, p), strides=(p, p), padding='VALID', name='embedding')(inputs)
        n, h, w, c = x.shape
        x = jnp.reshape(x, [n, h * w, c])
        cls = self.param('cls', nn.initializers.zeros, (1, 1, c))
        x = jnp.concatenate([jnp.tile(cls, [n, 1, 1]), x], axis=1)
        x = Encoder(self.num_layers, self.mlp_dim, self.num_heads, name='Transformer')(x, train=train)
        return nn.Dense(self.num_classes, name='head', kernel_init=nn.initializers.zeros)(x[:, 0])


def create_learning_rate_schedule(total_steps=TOTAL_STEPS, base=BASE_LR, warmup_steps=WARMUP_STEPS):
    """Linear warmup, then cosine decay to 0."""

    def step_fn(step):
        progress = jnp.clip((step - warmup_steps) / float(total_steps - warmup_steps), 0.0, 1.0)
        lr = base * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
        return lr * jnp.minimum(1.0, step / warmup_steps)

    return step_fn


def make_tx(accumulator_dtype='bfloat16', lr_scale: float = 1.0) -> optax.GradientTransformation:
    lr_fn = create_learning_rate_schedule()
    return optax.chain(
        optax.clip_by_global_norm(GRAD_NORM_CLIP),
        optax.sgd(learning_rate=lambda step: lr_fn(step) * lr_scale, momentum=0.9, accumulator_dtype=accumulator_dtype),
    )


def make_update_fn(*, apply_fn, tx):
    """The data-parallel update step, pmapped."""

    def update_fn(params, opt_state, batch, rng):
        _, new_rng = jax.random.split(rng)
        dropout_rng = rng  # found as fold_in(rng, lax.axis_index('batch')): see the module docstring

        def cross_entropy_loss(*, logits, labels):
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.sum(logp * labels, axis=1))

        def loss_fn(params, images, labels):
            logits = apply_fn(dict(params=params), rngs=dict(dropout=dropout_rng), inputs=images, train=True)
            return cross_entropy_loss(logits=logits, labels=labels)

        loss, g = jax.value_and_grad(loss_fn)(params, batch['image'], batch['label'])
        g = jax.tree.map(lambda x: jax.lax.pmean(x, axis_name='batch'), g)
        updates, opt_state = tx.update(g, opt_state)
        params = optax.apply_updates(params, updates)
        loss = jax.lax.pmean(loss, axis_name='batch')
        return params, opt_state, loss, new_rng

    return jax.pmap(update_fn, axis_name='batch', donate_argnums=(0,))


def make_data(rng: np.random.Generator, n_steps: int, batch: int, image_size: int = IMAGE_SIZE,
              num_classes: int = NUM_CLASSES) -> dict:  # fmt: skip
    """``{'image': [n_steps, batch, S, S, 3], 'label': [n_steps, batch, classes]}`` (one-hot): class blobs."""
    label = rng.integers(0, num_classes, size=(n_steps, batch))
    means = rng.normal(size=(num_classes, 1, 1, 3))
    image = means[label] + rng.normal(size=(n_steps, batch, image_size, image_size, 3))
    return {'image': image.astype(np.float32), 'label': np.eye(num_classes, dtype=np.float32)[label]}
