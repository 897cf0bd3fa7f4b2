"""The same Vision Transformer ported to NNX, as a team would write it (not part of the suite).

Modules own their submodules by attribute (``embedding``, ``encoder/blocks/0``, ``head``); the
head is zero-initialised as before; the dropout key is handed to the model by ``nnx.reseed``; one
``nnx.jit`` step over the model and its ``nnx.Optimizer`` on the global batch, no ``pmean``. The
optimizer is the same optax chain, momentum in bfloat16 unless told otherwise. The sizes are the
constructor's arguments, the linen model's fields under the same names (``image_size`` besides: the
position embedding is built before any image is seen); the defaults are the shrunk model.
"""

import functools
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

NUM_CLASSES, IMAGE_SIZE, PATCH, HIDDEN, HEADS, MLP_DIM, LAYERS, DROPOUT = 10, 8, 4, 16, 2, 32, 2, 0.1
BASE_LR, WARMUP_STEPS, TOTAL_STEPS, GRAD_NORM_CLIP = 0.03, 2, 20, 1.0


class MlpBlock(nnx.Module):
    def __init__(self, dim: int, mlp_dim: int, *, rngs: nnx.Rngs, approximate_gelu: bool = True):
        init = dict(kernel_init=nnx.initializers.xavier_uniform(), bias_init=nnx.initializers.normal(1e-6))
        self.fc1, self.fc2 = nnx.Linear(dim, mlp_dim, **init, rngs=rngs), nnx.Linear(mlp_dim, dim, **init, rngs=rngs)
        self.drop = nnx.Dropout(DROPOUT, rngs=rngs)
        self.approximate_gelu = approximate_gelu

    def __call__(self, x):
        return self.drop(self.fc2(self.drop(nnx.gelu(self.fc1(x), approximate=self.approximate_gelu))))


class EncoderBlock(nnx.Module):
    def __init__(self, hidden: int, heads: int, mlp_dim: int, *, rngs: nnx.Rngs, approximate_gelu: bool = True):
        self.norm1, self.norm2 = nnx.LayerNorm(hidden, rngs=rngs), nnx.LayerNorm(hidden, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=hidden, decode=False, dropout_rate=0.0,
                                           kernel_init=nnx.initializers.xavier_uniform(), rngs=rngs)  # fmt: skip
        self.drop = nnx.Dropout(DROPOUT, rngs=rngs)
        self.mlp = MlpBlock(hidden, mlp_dim, rngs=rngs, approximate_gelu=approximate_gelu)

    def __call__(self, x):
        x = x + self.drop(self.attn(self.norm1(x)))
        return x + self.mlp(self.norm2(x))


class Encoder(nnx.Module):
    def __init__(self, tokens: int, hidden: int, heads: int, mlp_dim: int, layers: int, *, rngs: nnx.Rngs,
                 slip_in_block: int | None = None):  # fmt: skip
        self.pos_embedding = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (1, tokens, hidden)))
        self.drop = nnx.Dropout(DROPOUT, rngs=rngs)
        self.blocks = nnx.List([EncoderBlock(hidden, heads, mlp_dim, rngs=rngs, approximate_gelu=i != slip_in_block)
                                for i in range(layers)])  # fmt: skip
        self.encoder_norm = nnx.LayerNorm(hidden, rngs=rngs)

    def __call__(self, x):
        x = self.drop(x + self.pos_embedding[...])
        for block in self.blocks:
            x = block(x)
        return self.encoder_norm(x)


class VisionTransformer(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, slip_in_block: int | None = None, num_classes: int = NUM_CLASSES,
                 image_size: int = IMAGE_SIZE, patch_size: int = PATCH, hidden_size: int = HIDDEN,
                 num_layers: int = LAYERS, mlp_dim: int = MLP_DIM, num_heads: int = HEADS):  # fmt: skip
        p, tokens = patch_size, 1 + (image_size // patch_size) ** 2  # the class token and the patches
        self.embedding = nnx.Conv(3, hidden_size, (p, p), strides=(p, p), padding='VALID', rngs=rngs)
        self.cls = nnx.Param(jnp.zeros((1, 1, hidden_size)))
        self.encoder = Encoder(tokens, hidden_size, num_heads, mlp_dim, num_layers, rngs=rngs,
                               slip_in_block=slip_in_block)  # fmt: skip
        self.head = nnx.Linear(hidden_size, num_classes, kernel_init=nnx.initializers.zeros, rngs=rngs)

    def __call__(self, images):
        x = self.embedding(images)
        n, h, w, c = x.shape
        x = x.reshape(n, h * w, c)
        x = jnp.concatenate([jnp.tile(self.cls[...], (n, 1, 1)), x], axis=1)
        return self.head(self.encoder(x)[:, 0])


def learning_rate_fn(step):
    progress = jnp.clip((step - WARMUP_STEPS) / float(TOTAL_STEPS - WARMUP_STEPS), 0.0, 1.0)
    return BASE_LR * 0.5 * (1.0 + jnp.cos(jnp.pi * progress)) * jnp.minimum(1.0, step / WARMUP_STEPS)


def create_optimizer(model: VisionTransformer, accumulator_dtype='bfloat16', head_lr: float = 1.0) -> nnx.Optimizer:
    """``head_lr``: the head's updates scaled by it (a slip where it is not 1: upstream has one learning rate)."""
    tx = optax.chain(
        optax.clip_by_global_norm(GRAD_NORM_CLIP),
        optax.sgd(learning_rate=learning_rate_fn, momentum=0.9, accumulator_dtype=accumulator_dtype),
        *([optax.masked(optax.scale(head_lr), head_only)] if head_lr != 1.0 else []),
    )
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


def head_only(params):
    return jax.tree_util.tree_map_with_path(lambda path, _: getattr(path[0], 'key', None) == 'head', params)


def step(model: VisionTransformer, optimizer: nnx.Optimizer, batch, rng):
    nnx.reseed(model, dropout=rng)

    def loss_fn(model):
        logits = model(batch['image'])
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * batch['label'], axis=1))

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


train_step = nnx.jit(step)  # one step a call, as upstream's host loop calls its pmapped update_fn


# The real sizes' loop, K steps in one compiled call, as `python -m equivalence.bench` advises: the train state split
# once and carried as a plain dict of arrays (no object graph walked, no nnx.State flattened on every call),
# `jax.jit(lax.scan)` over it with the state donated (updated in place, not copied every step).
@flax.struct.dataclass
class SplitState:
    graphdef: Any = flax.struct.field(pytree_node=False)  # static: the structure of (model, optimizer)
    state: dict  # nnx.to_pure_dict of their arrays

    @property
    def model(self) -> VisionTransformer:
        return nnx.merge(self.graphdef, self.state)[0]

    @property
    def optimizer(self) -> nnx.Optimizer:
        return nnx.merge(self.graphdef, self.state)[1]


def split_state(model: VisionTransformer, optimizer: nnx.Optimizer) -> SplitState:
    graphdef, state = nnx.split((model, optimizer))
    return SplitState(graphdef, nnx.to_pure_dict(state))


@functools.partial(jax.jit, donate_argnums=0)
def train_steps(ts: SplitState, batch_KxG, rng):
    """K steps in one compiled call, the key chained from step to step as upstream's ``update_fn`` returns it."""

    def one(carry, batch):
        state, rng = carry
        model, optimizer = nnx.merge(ts.graphdef, state)
        _, next_rng = jax.random.split(rng)
        loss = step(model, optimizer, batch, rng)
        return (nnx.to_pure_dict(nnx.state((model, optimizer))), next_rng), loss

    (state, _), losses_K = jax.lax.scan(one, (ts.state, rng), batch_KxG)
    return ts.replace(state=state), losses_K
