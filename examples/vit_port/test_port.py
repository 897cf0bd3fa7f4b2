"""The port checked from the team's own test suite: `python -m pytest` in this folder.

SGD momentum in bfloat16 (as upstream) and in float32, at D = 1, 2, 4, 8 (16 runs, minutes on
2 cores); the slip in one encoder block; and the form that draws other random numbers, which must
never read as a MATCH. The ladder's rungs built abstractly, ViT-B/16 included (nothing allocated), so that
the real sizes cannot rot unseen; the smallest model with ViT-B's 1000-class head judged in its own precision."""

import jax
import my_port
import numpy as np
import pytest
from flax import nnx

from equivalence import check
from equivalence.testing import assert_port_matches


@pytest.mark.parametrize('devices', [1, 2, 4, 8])
@pytest.mark.parametrize('port', [my_port.LOOP, my_port.LOOP_FLOAT32], ids=['loop', 'float32'])
def test_port_matches(port, devices):
    """The whole 20-step schedule: in the first steps the momentum has barely moved (the learning rate
    is 0 at step 1), and bfloat16 rounds the two sides' moments apart only later."""
    assert_port_matches(port, devices=devices, steps_per_call=5, calls=4)


def test_a_slip_in_one_encoder_block_is_caught():
    """Block 1's MLP with the exact gelu where linen's is the tanh approximation, under bfloat16 momentum:
    the parameters move by less than a bfloat16 step of their change, the per-step losses (float32)
    catch it. Not in the first step: the zero-initialised head makes every logit 0 whatever the encoder
    computes; nor in 4 steps, where the encoder has barely trained."""
    result = check(my_port.LOOP_GELU_SLIP, devices=2, steps_per_call=5, calls=4, diagnose=False)
    assert result.outcome.label == 'MISMATCH'
    assert [leaf.name for leaf in result.report.leaves if not leaf.ok] == ['losses/per_step']


def test_other_random_numbers_are_not_verified():
    """The NNX step folds the device count into its dropout key: no MATCH, NOT VERIFIED."""
    result = check(my_port.LOOP_DEVICE_KEYS, devices=2, steps_per_call=2, calls=2)
    assert result.outcome.label == 'NOT VERIFIED'


def test_a_young_head_is_judged_in_its_own_precision_and_its_slip_is_caught():
    """ViT-B's zero-initialised 1000-class head, 4 steps from 0, fed by bfloat16 momentum: at seed 4 the twin
    rounds a few of its momentum's elements to their neighbouring values, 2^-8 of the head's change there, above
    0.1% of it. That is rounding in the head's own precision, not noise: a MATCH (it was NOT VERIFIED, 'the output
    layer is noise-dominated'). The NNX head's learning rate 0.1% off is a MISMATCH."""
    flags = dict(devices=1, steps_per_call=2, calls=2, seed=4)
    assert check(my_port.sized('1e5'), **flags).outcome.label == 'MATCH'
    assert check(my_port.sized('1e5', head_lr=1.001), diagnose=False, **flags).outcome.label == 'MISMATCH'


COUNTS = {'6e3': 5_530, '2e5': 208_074, '3e6': 2_912_296, '2e7': 21_778_792, '9e7': 86_023_912}


@pytest.mark.parametrize('name', list(my_port.LADDER))
def test_each_rung_has_its_parameters(name):
    port = my_port.sized(name)
    image = port.make_data(np.random.default_rng(0), 1, 1)['image'][0]
    linen = jax.eval_shape(lambda: port.legacy_model().init(jax.random.key(0), image, False))
    model = nnx.eval_shape(lambda: port.nnx_model(nnx.Rngs(0)))
    assert parameters(linen['params']) == parameters(nnx.state(model, nnx.Param)) == COUNTS[name]


def parameters(tree) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(tree))
