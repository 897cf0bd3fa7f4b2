"""The port checked from the team's own test suite: `python -m pytest` in this folder.

The shrunk GPT-2 at D = 1, 2, 4, 8 (minutes on 2 cores) and its two slips; GPT-2 small itself built
abstractly (nothing allocated, nothing trained), so that the real size cannot rot unseen."""

import jax
import my_port
import numpy as np
import pytest
from flax import nnx

from equivalence import check
from equivalence.testing import assert_port_matches


@pytest.mark.parametrize('devices', [1, 2, 4, 8])
def test_port_matches(devices):
    assert_port_matches(my_port.LOOP, devices=devices)


def test_the_layer_norm_epsilon_slip_is_caught():
    """nnx.LayerNorm's default epsilon (1e-6) where GPT-2's is 1e-5: the forward pass differs from step 1."""
    result = check(my_port.LOOP_LN_EPS_SLIP, devices=2, steps_per_call=2, calls=2, diagnose=False)
    assert result.outcome.label == 'MISMATCH'


def test_the_decay_everything_slip_is_caught():
    """AdamW without its mask: the LayerNorm scales and the biases decay too, from the first step with a
    learning rate (step 2; the warmup starts at 0)."""
    result = check(my_port.LOOP_DECAY_ALL_SLIP, devices=2, steps_per_call=2, calls=2, diagnose=False)
    assert result.outcome.label == 'MISMATCH'
    assert any(leaf.name.endswith('ln_f/scale') and not leaf.ok for leaf in result.report.leaves)


@pytest.mark.parametrize('name, count', [('tiny', 29_696), ('124m', 124_439_808)])
def test_each_size_has_its_parameters(name, count):
    """Both models built abstractly (``jax.eval_shape``: nothing allocated), GPT-2 small's 124M included."""
    port = my_port.sized(name)
    input_ids = port.make_data(np.random.default_rng(0), 1, 1)['input_ids'][0]
    linen = jax.eval_shape(lambda: port.legacy_model().init(jax.random.key(0), input_ids, False))
    model = nnx.eval_shape(lambda: port.nnx_model(nnx.Rngs(0)))
    assert parameters(linen['params']) == parameters(nnx.state(model, nnx.Param)) == count


def parameters(tree) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(tree))
