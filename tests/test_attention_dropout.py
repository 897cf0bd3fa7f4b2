"""Randomness inside any layer: Flax's attention dropout bridged at both levels with Dropout's
guarantees (same bits whatever the layout; the layers' own bits from a given key), and a layer
drawing from a stream the suite does not bridge named, not left as a bare MISMATCH."""

import contextlib
import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import require_devices
from flax import nnx
from flax.linen.attention import dot_product_attention_weights as linen_weights
from flax.nnx.nn.attention import dot_product_attention_weights as nnx_weights

from equivalence import ModelPort
from equivalence.core import harness
from equivalence.core.port.config import RunConfig
from equivalence.core.port.naming import PortError
from equivalence.core.rng import randomness
from equivalence.pitfalls import masked_loss

F, L = 4, 3
QUICK = {'steps_per_call': 2, 'calls': 2}


class LinenAttention(nn.Module):
    broadcast: bool = True

    @nn.compact
    def __call__(self, x_BxLxF, train: bool):
        attention = nn.MultiHeadDotProductAttention(
            num_heads=2, qkv_features=8, dropout_rate=0.3, use_bias=False, broadcast_dropout=self.broadcast,
            deterministic=not train)  # fmt: skip
        h = attention(x_BxLxF)
        return nn.Dense(1)(nn.Dropout(0.1, deterministic=not train)(h).mean(1))


class NnxAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, broadcast: bool = True):
        self.MultiHeadDotProductAttention_0 = nnx.MultiHeadAttention(
            num_heads=2, in_features=F, qkv_features=8, dropout_rate=0.3, use_bias=False,
            broadcast_dropout=broadcast, decode=False, deterministic=False, rngs=rngs)  # fmt: skip
        self.drop, self.Dense_0 = nnx.Dropout(0.1, rngs=rngs), nnx.Linear(F, 1, rngs=rngs)

    def __call__(self, x_BxLxF):
        return self.Dense_0(self.drop(self.MultiHeadDotProductAttention_0(x_BxLxF)).mean(1))


def make_data(rng, n_steps, batch):
    x = rng.normal(size=(n_steps, batch, L, F)).astype('float32')
    return {'x': x, 'y': x.sum((-1, -2))[..., None].astype('float32')}


def port(broadcast: bool) -> ModelPort:
    return ModelPort(
        name='attention', legacy_model=lambda: LinenAttention(broadcast),
        nnx_model=lambda r: NnxAttention(r, broadcast),
        legacy_loss=lambda m, p, s, b, n: jnp.mean((m.apply({'params': p}, b['x'], True) - b['y']) ** 2, -1),
        nnx_loss=lambda m, b, n: jnp.mean((m(b['x']) - b['y']) ** 2, -1), make_data=make_data,
        make_tx=lambda s: optax.sgd(0.02 * s, momentum=0.9), init_args=lambda b: (b['x'], False), default_batch=8,
    )  # fmt: skip


def test_attention_dropout_at_level_1_matches_and_is_the_same_whatever_the_layout(monkeypatch):
    """Was exit 3 (InvalidRngError: needs PRNG for "dropout"). A mask shared across the batch (the
    layers' default) and one per example; global keys: the same losses on 1 device as on 2."""
    require_devices(4)
    # The fixed screen decides the MATCHes here (a run that fails it is still judged by its floor):
    # what is checked is the bridge; the unbridged control below goes through the whole verdict.
    own_mask = harness.check(port(broadcast=False), devices=4, rng_mode='global', verdict='screen', **QUICK)
    assert own_mask.report.match, [leaf for leaf in own_mask.report.leaves if not leaf.ok]
    one, two = (
        harness.check(port(broadcast=True), devices=d, rng_mode='global', verdict='screen', **QUICK) for d in (1, 2)
    )
    assert one.report.match and two.report.match, [leaf for leaf in two.report.leaves if not leaf.ok]
    np.testing.assert_allclose(one.legacy.losses, two.legacy.losses, rtol=1e-6)  # the same masks: per example
    original = randomness.bridged  # negative control: NNX attention draws its own masks

    def nnx_unbridged(rng_mode, axis_name=None, example_keys=None):
        return contextlib.nullcontext() if axis_name is None else original(rng_mode, axis_name, example_keys)

    monkeypatch.setattr(randomness, 'bridged', nnx_unbridged)
    unbridged = harness.check(port(broadcast=True), devices=2, rng_mode='global', diagnose=False, **QUICK)
    assert not unbridged.report.match and 'losses/per_step' in [x.name for x in unbridged.report.leaves if not x.ok]


@pytest.mark.parametrize('broadcast', [True, False])
def test_from_a_given_key_the_bridge_draws_the_attention_layers_own_bits(broadcast):
    key, x = jax.random.PRNGKey(3), jax.random.normal(jax.random.PRNGKey(4), (2, 5, F))
    linen = nn.MultiHeadDotProductAttention(num_heads=2, qkv_features=8, dropout_rate=0.3,
                                            broadcast_dropout=broadcast, deterministic=False)  # fmt: skip
    variables = linen.init(jax.random.PRNGKey(0), x)
    mha = nnx.MultiHeadAttention(num_heads=2, in_features=F, qkv_features=8, dropout_rate=0.3, decode=False,
                                 broadcast_dropout=broadcast, deterministic=False, rngs=nnx.Rngs(0))  # fmt: skip
    own_linen = linen.apply(variables, x, dropout_rng=jax.random.fold_in(key, 0))
    own_nnx = mha(x, rngs=nnx.Rngs(dropout=key))
    with randomness.bridged('per-device'):
        bridged_linen = jax.jit(lambda x: linen.apply(variables, x, rngs={'dropout': key}))(x)
        bridged_nnx = mha(x, rngs=nnx.Rngs(dropout=key))
    np.testing.assert_array_equal(bridged_linen, own_linen)
    np.testing.assert_array_equal(bridged_nnx, own_nnx)
    assert not np.array_equal(linen.apply(variables, x, dropout_rng=key), own_linen)  # the key matters


class LinenOwnAttention(nn.Module):
    """As Hugging Face's Flax models draw attention dropout: their own import of the function, their own key."""

    @nn.compact
    def __call__(self, q, k):
        return linen_weights(q, k, dropout_rng=self.make_rng('dropout'), dropout_rate=0.3, deterministic=False)


class NnxOwnAttention(nnx.Module):
    def __init__(self, rngs):
        self.rngs = rngs

    def __call__(self, q, k):
        return nnx_weights(q, k, dropout_rng=self.rngs.dropout(), dropout_rate=0.3, deterministic=False)


def test_a_layer_that_imports_the_attention_weights_and_draws_its_own_key_is_bridged():
    """A linen layer calling ``dot_product_attention_weights`` by its own import with a key from ``make_rng``, and an
    NNX layer with a key from its stream: each draws other bits alone (the control), the same bits bridged, from the
    key its step gave it (``apply(rngs=)``, ``nnx.reseed``), and nothing is named as unbridged."""
    key, q, k = jax.random.PRNGKey(3), *jax.random.normal(jax.random.PRNGKey(4), (2, 2, 5, 2, F))
    own = NnxOwnAttention(nnx.Rngs(0))
    nnx.reseed(own, dropout=key)
    apart = [LinenOwnAttention().apply({}, q, k, rngs={'dropout': key}), own(q, k)]
    assert not np.array_equal(*apart)  # the control: each framework's own key, its own bits
    randomness.take_unbridged()
    with randomness.bridged('global'):
        linen_w = jax.jit(lambda q, k: LinenOwnAttention().apply({}, q, k, rngs={'dropout': key}))(q, k)
        nnx.reseed(own, dropout=key)
        nnx_w = own(q, k)
    np.testing.assert_array_equal(linen_w, nnx_w)
    assert not np.array_equal(linen_w, apart[0]) and randomness.take_unbridged() == []


class LinenNoise(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + jax.random.normal(self.make_rng('noise'), x.shape)


class NnxNoise(nnx.Module):
    def __init__(self, rngs):
        self.rngs = rngs

    def __call__(self, x):
        return x + jax.random.normal(self.rngs.noise(), x.shape)


def test_a_layer_drawing_from_a_stream_the_suite_does_not_bridge_is_named():
    x, key = jnp.ones((2, 3)), jax.random.PRNGKey(0)
    randomness.take_unbridged()
    with randomness.bridged('global'):
        LinenNoise().apply({}, x, rngs={'noise': key})  # level 2: the user's key, but not bridged
        NnxNoise(nnx.Rngs(noise=0))(x)
        with pytest.raises(PortError, match=r"linen layer LinenNoise .*'noise' stream with make_rng.*no key"):
            LinenNoise().apply({}, x)  # level 1: no key to give
    lines = randomness.take_unbridged()
    assert any("linen LinenNoise (LinenNoise) draws from the 'noise' stream" in n for n in lines), lines
    assert any("NNX NnxNoise draws from the 'noise' stream" in n for n in lines), lines
    with randomness.bridged('global'):  # Dropout and attention draw nothing the bridge does not cover
        NnxAttention(nnx.Rngs(0))(jnp.ones((2, L, F)))
    assert randomness.take_unbridged() == []


# -- losses that are not per-example means ----------------------------------------------------------


def legacy_token_sums(model, params, model_state, batch, noise):
    losses_B, model_state = masked_loss.legacy_losses.mlp_loss(model, params, model_state, batch, noise)
    return {'loss': losses_B * batch['mask'], 'weight': batch['mask']}, model_state


def nnx_token_sums(model, batch, noise):
    return {'loss': masked_loss.nnx_losses.mlp_loss(model, batch, noise) * batch['mask'], 'weight': batch['mask']}


def test_a_token_weighted_loss_matches_at_level_1_and_the_masked_loss_pitfall_is_linked():
    """Level 1 takes ``{'loss': sums_B, 'weight': weights_B}``: psum(sums) / psum(weights) on the pmap
    side. The per-device weighted mean then pmean (the pitfall) mismatches, and the report links it."""
    require_devices(4)
    valid = masked_loss.indivisible(4)
    config = RunConfig(workload='mlp', devices=4, steps_per_call=2, calls=2, batch_size=masked_loss.padded(valid, 4))
    port = dataclasses.replace(masked_loss.workload(legacy_token_sums, 4), nnx_loss=nnx_token_sums)
    # what is checked is the loss's form (the fixed screen; failing it, the measured floor); the pitfall's
    # wrong run goes through the whole verdict, its diagnosis and hint, not located (no where: is read)
    assert harness.run(port, dataclasses.replace(config, verdict='screen')).report.match
    wrong_port = masked_loss.workload(masked_loss.legacy_local_mean, 4)
    wrong = harness.run(wrong_port, dataclasses.replace(config, locate=False))
    assert not wrong.report.match
    hint = [n for n in wrong.notes if n.startswith('hint: on a padded batch this port mismatches at 4 devices')]
    assert hint and 'pitfalls --only masked_loss' in hint[0], wrong.notes


def test_only_a_padded_batch_is_run_again_on_one_device_for_the_hint():
    """The masked-loss hint runs both sides again on one device, on a padded batch only: a mask or weights
    leaf, or integer tokens ``[K, G, length]`` holding zeros; not uint8 images with black pixels (every
    MISMATCH of google-research/vdm's port paid 20 to 40 s for it)."""
    from equivalence.core.judge import hints

    tokens = np.array([[[5, 3, 0, 0]] * 2] * 2, np.int32)  # [K, G, length], padded with zeros
    images = np.zeros((2, 2, 8, 8, 3), np.uint8)
    assert hints.padded({'inputs': tokens}) and hints.padded({'x': np.ones((2, 2, 4)), 'mask': np.ones((2, 2))})
    assert not hints.padded({'images': images}) and not hints.padded({'inputs': tokens + 1})
    # and only where the devices' rows hold other amounts of tokens: every row 2 tokens, 2 pads (lm1b's port
    # tried blind) cannot give a mean of per-device means other than the global mean
    assert not hints.uneven({'inputs': tokens}, 2) and hints.uneven(
        {'inputs': np.concatenate([tokens[:, :1], tokens[:, :1] * 0], 1)}, 2
    )
