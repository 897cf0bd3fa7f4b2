"""The port checked from the team's own test suite: `python -m pytest` in this folder. Its sizes built
abstractly, ResNet-50 included (nothing allocated), so that the real sizes cannot rot unseen."""

import jax
import legacy_code as old
import my_port
import numpy as np
import pytest
from flax import nnx

from equivalence import check
from equivalence.testing import assert_port_matches


@pytest.mark.parametrize('devices', [1, 2, 4, 8])
@pytest.mark.parametrize('port', [my_port.MODEL, my_port.LOOP], ids=['model', 'loop'])
def test_port_matches(port, devices):
    assert_port_matches(port, devices=devices)


def test_a_slip_is_caught():
    """nnx.BatchNorm's default momentum (0.99) where linen said 0.9: the batch statistics differ."""
    result = check(my_port.LOOP_BN_MOMENTUM_SLIP, devices=2, steps_per_call=2, calls=2, diagnose=False)
    assert not result.report.match
    assert any(leaf.group == 'model_state' and not leaf.ok for leaf in result.report.leaves)


COUNTS = {'tiny': (1_506, 48), 'r50-narrow': (376_722, 6_640), 'r50': (25_557_032, 53_120)}  # (params, statistics)


@pytest.mark.parametrize('name', list(my_port.SIZES))
def test_each_size_has_its_parameters(name):
    port = my_port.sized(name)
    image = port.make_data(np.random.default_rng(0), 1, 1)['image'][0]
    linen = jax.eval_shape(lambda: port.legacy_model().init(jax.random.key(0), image, False))
    model = nnx.eval_shape(lambda: port.nnx_model(nnx.Rngs(0)))
    new = (parameters(nnx.state(model, nnx.Param)), parameters(nnx.state(model, nnx.BatchStat)))
    assert (parameters(linen['params']), parameters(linen['batch_stats'])) == new == COUNTS[name]
    if name == 'r50':
        assert port.legacy_model() == old.ResNet50()  # flax's own partial: the same fields


def parameters(tree) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(tree))
