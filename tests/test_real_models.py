"""Real models as research code writes them: a ViT-shaped stem (patch-embedding convolution, a class
token concatenated to the patches, a position-embedding gather) whose ``__call__`` takes ``train``
by keyword only. Its level-1 run needs no linen subclass (``init_kwargs=``) and prints no warning of
the suite's own: the gradient placement that does not fit it falls back, said by ``explain``."""

import dataclasses
import warnings
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from equivalence import LoopPort, ModelPort
from equivalence.core import harness, kinds, preflight
from equivalence.core.port.config import ConfigError, RunConfig
from equivalence.core.run.inputs import make_inputs
from equivalence.core.twins import unverified
from equivalence.explain import measure_both, path_text, report
from nnx_sharded import sharding

# Compiled at XLA's level 0 in this worker (conftest.at_level_0_in_process), as the subject allows:
AT_LEVEL_0 = "a research stem's call signature and its placement's fallback; the floors are test_equivalence's"

PATCH, WIDTH, CLASSES, SIDE = 4, 8, 3, 8
TOKENS = (SIDE // PATCH) ** 2 + 1  # the patches and the class token
QUICK = {'steps_per_call': 2, 'calls': 2}


class LinenStem(nn.Module):
    @nn.compact
    def __call__(self, x, *, train: bool):
        h = nn.Conv(WIDTH, (PATCH, PATCH), strides=(PATCH, PATCH), padding='VALID')(x)
        h = h.reshape(h.shape[0], -1, WIDTH)
        cls = self.param('cls', nn.initializers.normal(0.02), (1, 1, WIDTH))
        h = jnp.concatenate([jnp.tile(cls, (h.shape[0], 1, 1)), h], axis=1)
        h = h + nn.Embed(TOKENS, WIDTH)(jnp.arange(TOKENS))[None]
        h = nn.Dropout(0.1, deterministic=not train)(h)
        return nn.Dense(CLASSES)(h[:, 0])


class NnxStem(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, cls_token: bool = True, positions: bool = True):
        self.Conv_0 = nnx.Conv(1, WIDTH, (PATCH, PATCH), strides=(PATCH, PATCH), padding='VALID', rngs=rngs)
        self.cls = nnx.Param(jnp.zeros((1, 1, WIDTH)))
        self.Embed_0 = nnx.Embed(TOKENS, WIDTH, rngs=rngs)
        self.drop = nnx.Dropout(0.1, rngs=rngs)
        self.Dense_0 = nnx.Linear(WIDTH, CLASSES, rngs=rngs)
        self.cls_token, self.positions = cls_token, positions

    def __call__(self, x):
        h = self.Conv_0(x)
        h = h.reshape(h.shape[0], -1, WIDTH)
        first = jnp.tile(self.cls[...], (h.shape[0], 1, 1)) if self.cls_token else h[:, :1] * 0.0
        h = jnp.concatenate([first, h], axis=1)
        h = h + self.Embed_0(jnp.arange(TOKENS))[None] * self.positions
        return self.Dense_0(self.drop(h)[:, 0])


def make_data(rng, n_steps, batch):
    x = rng.normal(size=(n_steps, batch, SIDE, SIDE, 1)).astype('float32')
    return {'x': x, 'y': x.reshape(n_steps, batch, -1)[..., :CLASSES].astype('float32')}


def legacy_loss(model, params, model_state, batch, noise):
    return jnp.mean((model.apply({'params': params}, batch['x'], train=True) - batch['y']) ** 2, -1)


def nnx_loss(model, batch, noise):
    return jnp.mean((model(batch['x']) - batch['y']) ** 2, -1)


STEM = ModelPort(
    name='vit stem', legacy_model=LinenStem, nnx_model=lambda rngs: NnxStem(rngs), legacy_loss=legacy_loss,
    nnx_loss=nnx_loss, make_data=make_data, make_tx=lambda s: optax.sgd(0.05 * s, momentum=0.9),
    init_args=lambda b: (b['x'],), init_kwargs=lambda b: {'train': False}, default_batch=8,
)  # fmt: skip


def config(port: ModelPort) -> RunConfig:
    return RunConfig(workload=port.name, devices=2, batch_size=port.default_batch, rng_mode='global', **QUICK)


def test_a_keyword_only_train_flag_is_given_by_init_kwargs():
    """Was: ``init_args`` positional only, so upstream's ``__call__(self, x, *, train)`` needed a subclass."""
    require_devices(2)
    preflight.check(kinds.of(STEM), config(STEM))
    without = dataclasses.replace(STEM, init_kwargs=None)  # the linen init then misses train: one line, exit 2
    with pytest.raises(preflight.PreflightError, match="port 'vit stem': legacy_model raised TypeError.*'train'"):
        preflight.check(kinds.of(without), config(without))
    wrong = dataclasses.replace(STEM, init_kwargs=lambda b: (False,))
    with pytest.raises(preflight.PreflightError, match='init_kwargs returned a tuple, not a dict of names'):
        preflight.check(kinds.of(wrong), config(wrong))
    with pytest.raises(ConfigError, match=r'init_kwargs \(test_real_models.py:\d+\) cannot be called as init_kwargs'):
        dataclasses.replace(STEM, init_kwargs=lambda: {})
    # the verdict's own abstract init (which layer the model applies last, read on a MATCH) is given them
    # too: it was not, and a matching run with init_kwargs ended in exit 3 (found on AlgoPerf's MNIST)
    variables, calls, _ = make_inputs(STEM, config(STEM))
    assert unverified.output_layer(STEM, variables, calls[0], {}) == {'Dense_0/kernel', 'Dense_0/bias'}


def placed_gradient(model: nnx.Module) -> list[str]:
    """The fallback lines of one data-parallel gradient of ``model``, traced (not compiled) on a 2-device mesh."""
    mesh = sharding.make_mesh(2)
    data = make_data(np.random.default_rng(0), 1, 4)
    batch = jax.tree.map(lambda v: jax.device_put(v[0], NamedSharding(mesh, P('data'))), data)
    graphdef, state = nnx.split(model)
    loss = lambda state, batch: sharding.value_and_grad(nnx_loss_mean)(nnx.merge(graphdef, state), batch, {})[0][0]  # noqa: E731
    sharding.take_fallbacks()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        jax.jit(loss).trace(state, batch)
    return sharding.take_fallbacks()


def nnx_loss_mean(model, batch, noise):
    losses = nnx_loss(model, batch, noise)
    return jnp.mean(losses), losses


def test_the_gradient_placement_falls_back_on_a_class_token_without_a_warning():
    """Was: ``UserWarning: gradient all-reduced before the kernel transposes (explicit mode:
    ShardingTypeError(...))`` on every level-1 run of such a model."""
    require_devices(2)
    lines = placed_gradient(NnxStem(nnx.Rngs(0)))
    assert len(lines) == 1 and 'ShardingTypeError: All operands should have the same sharding' in lines[0], lines
    assert 'at test_real_models.py:' in lines[0], lines  # the model's own line: the concatenate
    # Control: the same stem without the class token (the convolution and the position gather kept)
    # traces in explicit mode, so the all-reduce is placed after the transposes and nothing is said.
    assert placed_gradient(NnxStem(nnx.Rngs(0), cls_token=False)) == []


def test_a_level_1_run_of_the_stem_prints_no_warning_and_explain_says_where_the_all_reduce_is():
    """The run as ``python -W error -m equivalence.run`` would make it (which ignores JAX's donation warning
    about the batch, as every command does). Whether the stem MATCHes is not what is tested here."""
    require_devices(2)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        warnings.filterwarnings('ignore', message='Some donated buffers were not usable')
        harness.check(STEM, devices=2, rng_mode='global', verdict='screen', **QUICK)
        legacy, nnx_side = measure_both(STEM, config(STEM))
    text = path_text(report(legacy, nnx_side, config(STEM), 'cpu', {})['paths']['nnx'])
    assert 'note: gradient all-reduced before the kernel transposes' in text and 'ShardingTypeError' in text, text
    assert legacy.notes == ()


# -- attention dropout with per-device keys ----------------------------------------------------------

HEADS, LENGTH, FEATURES = 2, 3, 4
RAW_KEYS, TYPED_KEYS = jax.random.split(jax.random.PRNGKey(0), 2), jax.random.split(jax.random.key(0), 2)


@pytest.mark.parametrize('keys', [RAW_KEYS, TYPED_KEYS], ids=['[D, 2] raw', '[D] typed'])
def test_no_nnx_layer_takes_per_device_keys_whatever_the_reseed_policy(keys):
    """What docs/randomness.md says: ``nnx.reseed``'s ``policy`` reshapes a stream's *own* key; the key it is
    given must be one key, so per-device keys raise whatever the policy. So do NNX attention and Dropout."""
    model = nnx.MultiHeadAttention(num_heads=HEADS, in_features=FEATURES, qkv_features=8, dropout_rate=0.3,
                                   decode=False, deterministic=False, rngs=nnx.Rngs(0, dropout=1))  # fmt: skip
    for policy in ('scalars_only', 'match_shape', lambda path, key, shape: key):
        with pytest.raises(ValueError, match='fold_in accepts a single key'):
            nnx.reseed(model, dropout=keys, policy=policy)
    x = jnp.ones((2, LENGTH, FEATURES))
    with pytest.raises(ValueError, match='fold_in accepts a single key'):
        model(x, rngs=nnx.Rngs(dropout=keys))
    with pytest.raises(ValueError, match='bernoulli accepts a single key'):
        nnx.Dropout(0.5)(x, rngs=keys)
    one = model(x, rngs=nnx.Rngs(dropout=keys[0]))  # control: one key is taken
    assert one.shape == x.shape


class LinenAttention(nn.Module):
    @nn.compact
    def __call__(self, x, *, train: bool):
        attention = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=8, dropout_rate=0.3,
                                                    deterministic=not train)  # fmt: skip
        return nn.Dense(1)(attention(x).mean(1))


class NnxAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.MultiHeadDotProductAttention_0 = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=FEATURES, qkv_features=8, dropout_rate=0.3, decode=False,
            deterministic=False, rngs=rngs)  # fmt: skip
        self.Dense_0 = nnx.Linear(FEATURES, 1, rngs=rngs)

    def __call__(self, x, rngs: nnx.Rngs | None = None):
        return self.Dense_0(self.MultiHeadDotProductAttention_0(x, rngs=rngs).mean(1))


def attention_data(rng, n_steps, batch):
    x = rng.normal(size=(n_steps, batch, LENGTH, FEATURES)).astype('float32')
    return {'x': x, 'y': x.sum((-1, -2))[..., None].astype('float32')}


@flax.struct.dataclass
class AttentionState:
    step: jax.Array
    params: Any
    opt_state: Any


def sgd():
    return optax.sgd(0.02, momentum=0.9)


def attention_state(variables: dict) -> AttentionState:
    return AttentionState(jnp.zeros((), jnp.int32), variables['params'], sgd().init(variables['params']))


def attention_step(carry, batch):
    """The pmap step: each device splits its own key and gives the attention layer its step key."""
    rng, state = carry
    rng, step_rng = jax.random.split(rng)

    def loss_fn(params):
        pred = LinenAttention().apply({'params': params}, batch['x'], train=True, rngs={'dropout': step_rng})
        return jnp.mean((pred - batch['y']) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    updates, opt_state = sgd().update(jax.lax.pmean(grads, 'batch'), state.opt_state, state.params)
    state = AttentionState(state.step + 1, optax.apply_updates(state.params, updates), opt_state)
    return (rng, state), jax.lax.pmean(loss, 'batch')


def device_rows(model: NnxAttention, x_G: jax.Array, keys_D: jax.Array) -> jax.Array:
    """The working path of docs/randomness.md: the forward pass on each device's rows of the global batch
    (``[D, G/D, ...]``), vmapped, each row with its device's key: the masks pmap drew, in one program."""
    d = keys_D.shape[0]
    forward = nnx.vmap(lambda m, x, key: m(x, rngs=nnx.Rngs(dropout=key)), in_axes=(None, 0, 0))
    out = forward(model, x_G.reshape(d, -1, *x_G.shape[1:]), keys_D)
    return out.reshape(x_G.shape[0], *out.shape[2:])


def attention_call(rows_of_keys=lambda keys: keys):
    """The NNX fused call; ``rows_of_keys``: which device key each row gets (the negative control swaps them)."""

    @nnx.jit
    def calls(model, optimizer, keys_D, batch_KxG):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def step(carry, batch):
            model, optimizer, keys_D = carry
            split = jax.vmap(jax.random.split)(keys_D)  # each device's rng, step_rng = split(rng)
            keys_D, step_keys = split[:, 0], rows_of_keys(split[:, 1])
            loss_fn = lambda m: jnp.mean((device_rows(m, batch['x'], step_keys) - batch['y']) ** 2)  # noqa: E731
            loss, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads)
            return (model, optimizer, keys_D), loss

        return step((model, optimizer, keys_D), batch_KxG)[1]

    return lambda ts, keys_D, batch_KxG: (ts, calls(*ts, keys_D, batch_KxG))


ATTENTION = LoopPort(
    name='attention rows', legacy_model=LinenAttention, nnx_model=NnxAttention, make_data=attention_data,
    legacy_state=attention_state, legacy_step=attention_step, new_call=attention_call(),
    new_state=lambda m: (m, nnx.Optimizer(m, sgd(), wrt=nnx.Param)), init_args=lambda b: (b['x'],),
    init_kwargs=lambda b: {'train': False}, default_batch=8, rng_modes=('per-device',),
)  # fmt: skip


def test_nnx_attention_with_per_device_keys_matches_when_each_device_row_gets_its_key():
    require_devices(2)
    once = {'devices': 2, 'steps_per_call': 2, 'calls': 1, 'verdict': 'screen'}
    result = harness.check(ATTENTION, **once)
    assert result.report.match, [leaf for leaf in result.report.leaves if not leaf.ok]
    swapped = dataclasses.replace(ATTENTION, new_call=attention_call(lambda keys: keys[::-1]))  # negative control
    assert not harness.check(swapped, diagnose=False, **once).report.match
    # The same NNX code runs on its own, without the suite's bridge: [D, 2] keys, one row each.
    model = NnxAttention(nnx.Rngs(0))
    batch = jax.tree.map(jnp.asarray, attention_data(np.random.default_rng(0), 2, 8))
    _, losses_K = ATTENTION.new_call((model, nnx.Optimizer(model, sgd(), wrt=nnx.Param)), RAW_KEYS, batch)
    assert losses_K.shape == (2,) and bool(jnp.all(jnp.isfinite(losses_K)))


def test_bench_says_where_the_gradient_all_reduce_fell_back():
    from test_bench_advice import fake_result

    from equivalence.bench import report as benchreport

    result = fake_result(dict.fromkeys(['legacy', 'nnx', 'nnx_jit_state', 'nnx_jit_dict'], 1.0), {})
    assert benchreport.placement_rows(result) == []  # nothing fell back: nothing said
    result.placement = placed_gradient(NnxStem(nnx.Rngs(0)))
    assert benchreport.placement_rows(result) == [f'note on the NNX calls: {result.placement[0]}']
