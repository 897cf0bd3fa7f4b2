"""The same team's NNX port of the score_sde trainer, in the form the migration asks about (not part
of the suite): an NNX UNet, ``nnx.Optimizer(model, tx, wrt=nnx.Param)``, an EMA of the parameters,
and K steps fused by ``nnx.jit(nnx.scan(...))`` over (model, optimizer, EMA) on a mesh.

- The optimizer is one optax chain: global-norm clipping, Adam, and the warmup as a schedule of
  optax's count, which is the number of updates before this one (score_sde's ``state.step``).
- No ``pmean``: the loss is the mean over the global batch, and the partitioner sums the gradients.
- score_sde's per-device keys are kept: the call takes the ``[D, 2]`` keys pmap's devices take, and
  each device's rows of the global batch draw their times, noise and dropout from that device's
  key, vmapped (``per_device_losses``): the numbers pmap drew, in one program.
"""

import jax
import jax.numpy as jnp
import legacy_code as old
import optax
from flax import nnx

act = nnx.swish


def groups(channels: int) -> int:
    return min(channels // 4, 32)


class ResnetBlock(nnx.Module):
    def __init__(self, in_ch: int, out_ch: int, temb_dim: int, *, rngs: nnx.Rngs, epsilon: float = 1e-6):
        self.norm1 = nnx.GroupNorm(in_ch, num_groups=groups(in_ch), epsilon=epsilon, rngs=rngs)
        self.conv1 = nnx.Conv(in_ch, out_ch, (3, 3), rngs=rngs)
        self.temb = nnx.Linear(temb_dim, out_ch, rngs=rngs)
        self.norm2 = nnx.GroupNorm(out_ch, num_groups=groups(out_ch), epsilon=epsilon, rngs=rngs)
        self.dropout = nnx.Dropout(old.DROPOUT, rngs=rngs)
        self.conv2 = nnx.Conv(out_ch, out_ch, (3, 3), rngs=rngs)
        self.skip = nnx.Linear(in_ch, out_ch, rngs=rngs) if in_ch != out_ch else None

    def __call__(self, x, temb, rngs):
        h = self.conv1(act(self.norm1(x)))
        h += self.temb(act(temb))[:, None, None, :]
        h = self.conv2(self.dropout(act(self.norm2(h)), rngs=rngs))
        return (x if self.skip is None else self.skip(x)) + h


class AttnBlock(nnx.Module):
    def __init__(self, ch: int, *, rngs: nnx.Rngs, epsilon: float = 1e-6):
        self.norm = nnx.GroupNorm(ch, num_groups=groups(ch), epsilon=epsilon, rngs=rngs)
        self.q, self.k, self.v, self.out = (nnx.Linear(ch, ch, rngs=rngs) for _ in range(4))

    def __call__(self, x):
        B, H, W, C = x.shape
        h = self.norm(x)
        w = jnp.einsum('bhwc,bHWc->bhwHW', self.q(h), self.k(h)) * (int(C) ** (-0.5))
        w = jax.nn.softmax(jnp.reshape(w, (B, H, W, H * W)), axis=-1)
        return x + self.out(jnp.einsum('bhwHW,bHWc->bhwc', jnp.reshape(w, (B, H, W, H, W)), self.v(h)))


class UNet(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, nf: int = old.NF, channels: int = old.IMAGE[-1], epsilon: float = 1e-6):
        self.nf = nf
        self.temb1, self.temb2 = nnx.Linear(nf, nf * 4, rngs=rngs), nnx.Linear(nf * 4, nf * 4, rngs=rngs)
        self.conv_in = nnx.Conv(channels, nf, (3, 3), rngs=rngs)
        self.block = ResnetBlock(nf, nf * 2, nf * 4, rngs=rngs, epsilon=epsilon)
        self.downsample = nnx.Conv(nf * 2, nf * 2, (3, 3), strides=(2, 2), rngs=rngs)
        self.attn = AttnBlock(nf * 2, rngs=rngs, epsilon=epsilon)
        self.upsample = nnx.Conv(nf * 2, nf * 2, (3, 3), rngs=rngs)
        self.norm_out = nnx.GroupNorm(nf * 2, num_groups=groups(nf * 2), epsilon=epsilon, rngs=rngs)
        self.conv_out = nnx.Conv(nf * 2, channels, (3, 3), rngs=rngs)

    def __call__(self, x, labels, rngs=None):
        temb = self.temb2(act(self.temb1(old.get_timestep_embedding(labels, self.nf))))
        skip = self.block(self.conv_in(x), temb, rngs)
        h = self.attn(self.downsample(skip))
        B, H, W, C = h.shape
        h = self.upsample(jax.image.resize(h, (B, H * 2, W * 2, C), 'nearest')) + skip
        return self.conv_out(act(self.norm_out(h)))


NAMES = {  # linen's auto-named submodules -> the NNX attributes
    'Dense_0': 'temb1', 'Dense_1': 'temb2', 'Conv_0': 'conv_in', 'ResnetBlock_0/GroupNorm_0': 'block/norm1',
    'ResnetBlock_0/Conv_0': 'block/conv1', 'ResnetBlock_0/Dense_0': 'block/temb',
    'ResnetBlock_0/GroupNorm_1': 'block/norm2', 'ResnetBlock_0/Conv_1': 'block/conv2',
    'ResnetBlock_0/Dense_1': 'block/skip', 'Conv_1': 'downsample', 'AttnBlock_0/GroupNorm_0': 'attn/norm',
    'AttnBlock_0/Dense_0': 'attn/q', 'AttnBlock_0/Dense_1': 'attn/k', 'AttnBlock_0/Dense_2': 'attn/v',
    'AttnBlock_0/Dense_3': 'attn/out', 'Conv_2': 'upsample', 'GroupNorm_0': 'norm_out', 'Conv_3': 'conv_out',
}  # fmt: skip


# -- the optimizer, the EMA and the fused loop ------------------------------------------------------


def warmup_schedule(count, warmup=old.WARMUP):
    return old.LR * jnp.minimum(count / warmup, 1.0)  # count: the updates before this one


def make_tx(schedule=warmup_schedule) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(old.GRAD_CLIP), optax.scale_by_adam(b1=0.9, b2=0.999, eps=1e-8),
                       optax.scale_by_learning_rate(schedule))  # fmt: skip


class TrainState(nnx.Module):
    """The model, its optimizer and the EMA of its parameters (a copy of the model)."""

    def __init__(self, model: UNet, tx: optax.GradientTransformation):
        self.model = model
        self.optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
        self.ema = nnx.clone(model)


def per_device_losses(model: UNet, image_G, keys_D):
    """score_sde's loss on each device's rows of the global batch, each drawn from its device's key."""
    d = keys_D.shape[0]

    def device_loss(model, data, rng):
        rng, step_rng = jax.random.split(rng)
        t = jax.random.uniform(step_rng, (data.shape[0],), minval=old.EPS, maxval=1.0)
        rng, step_rng = jax.random.split(rng)
        z = jax.random.normal(step_rng, data.shape)
        mean, std = old.marginal_prob(data, t)
        rng, step_rng = jax.random.split(rng)
        model_out = model(mean + old.batch_mul(std, z), t * 999, rngs=nnx.Rngs(dropout=step_rng))
        losses = jnp.square(old.batch_mul(std, -old.batch_mul(1.0 / std, model_out)) + z)
        return jnp.mean(jnp.mean(losses.reshape((losses.shape[0], -1)), axis=-1))

    rows = image_G.reshape(d, -1, *image_G.shape[1:])  # row d: pmap device d's examples
    return nnx.vmap(device_loss, in_axes=(None, 0, 0))(model, rows, keys_D)


def ema_update(ema: UNet, model: UNet, rate=old.EMA_RATE):
    rate = jnp.float32(rate)
    new = jax.tree.map(lambda e, p: e * rate + p * (1.0 - rate), nnx.state(ema, nnx.Param), nnx.state(model, nnx.Param))
    nnx.update(ema, new)


@nnx.jit
def train_calls(model: UNet, optimizer: nnx.Optimizer, ema: UNet, keys_D, batch_KxG):
    """K steps in one compiled call, from the devices' keys ``[D, 2]``; returns each step's loss."""

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
    def step(carry, batch):
        model, optimizer, ema, keys_D = carry
        split = jax.vmap(jax.random.split)(keys_D)  # each device's rng, step_rng = split(rng)
        keys_D, step_keys_D = split[:, 0], split[:, 1]
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(per_device_losses(m, batch['image'], step_keys_D)))(model)
        optimizer.update(model, grads)
        ema_update(ema, model)
        return (model, optimizer, ema, keys_D), loss

    _, losses_K = step((model, optimizer, ema, keys_D), batch_KxG)
    return losses_K
