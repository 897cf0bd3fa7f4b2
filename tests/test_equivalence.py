"""Both paths train the same model: parameters, optimizer state, EMA and losses match."""

import functools
import logging

import flax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import require_devices

from equivalence.core import harness
from equivalence.core.compare import compare
from equivalence.core.judge import judge
from equivalence.core.port import workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.run import sides
from legacy_pmap import train as legacy

WORKLOADS = list(workloads.WORKLOADS)
FAST = [name for name in WORKLOADS if name != 'cnn']  # cnn has its own tests: test_stateful.py


def run(name: str, **overrides) -> judge.RunResult:
    """A run shared by every test of this module that asks for it (results are read, never changed)."""
    require_devices(overrides.get('devices', 8))
    return _shared(name, tuple(sorted(overrides.items())))


@functools.cache
def _shared(name: str, overrides: tuple) -> judge.RunResult:
    return fresh(name, **dict(overrides))


def fresh(name: str, diagnose: bool = True, **overrides) -> judge.RunResult:
    wl = workloads.get(name)
    fields = {'workload': name, 'batch_size': wl.default_batch, 'calls': 2, **overrides}
    require_devices(fields.get('devices', 8))
    return harness.run(wl, RunConfig(**fields), diagnose=diagnose)


# K = 1 (a scan of one step) on one device; K = 5 (scan over 5 steps) at D = 2 and 8. D = 4 and K = 1
# at D = 8 are the same programs at another size (test_strategies runs D = 4 and 8 under every layout).
@pytest.mark.parametrize('devices, steps_per_call', [(1, 1), (2, 5), (8, 5)], ids=lambda v: str(v))
@pytest.mark.parametrize('name', FAST)
def test_paths_match(name, devices, steps_per_call):
    # The fixed screen first: a leaf that fails it is still judged by its measured floor (the
    # measured verdict is tested in test_verdict.py); these runs are also the module's shared ones.
    result = run(name, devices=devices, steps_per_call=steps_per_call, verdict='screen')
    bad = [(leaf.name, leaf.max_abs) for leaf in result.report.leaves if not leaf.ok]
    assert result.report.match, bad
    groups = {leaf.group for leaf in result.report.leaves}
    assert {'params', 'opt_state', 'losses', 'step'} <= groups
    assert result.legacy.losses.shape == (2 * steps_per_call,)


# cnn's controls: test_stateful.py (BatchNorm statistics, rng modes); mlp's: test_cli.py, through the command
@pytest.mark.parametrize('name', [name for name in FAST if name != 'mlp'])
def test_negative_control_perturbed_lr_is_a_mismatch(name):
    """A 0.1% learning-rate change on the NNX side must be caught in params and losses."""
    result = run(name, devices=8, perturb=1e-3, diagnose=False)  # its match and leaves alone are read
    assert not result.report.match
    failed_groups = {leaf.group for leaf in result.report.leaves if not leaf.ok}
    assert {'params', 'losses'} <= failed_groups


def test_score_state_has_ema_and_warmup_schedule_count():
    result = run('score', devices=2, steps_per_call=5, verdict='screen')  # test_paths_match's run
    ema = result.legacy.final['ema']
    assert ema and set(ema) == set(result.legacy.final['params'])
    assert int(result.legacy.final['step']['step']) == 10 == int(result.new.final['step']['step'])
    # The EMA moved, but by much less than the parameters (ema_rate 0.999).
    assert any(not np.array_equal(ema[k], result.legacy.params_per_call[0][k]) for k in ema)


def test_a_single_changed_leaf_is_reported_with_its_path():
    result = run('mlp', devices=2, steps_per_call=5, verdict='screen')
    tampered = {g: dict(leaves) for g, leaves in result.new.final.items()}
    tampered['params']['out/bias'] = tampered['params']['out/bias'] + 1e-4
    report = compare.compare(result.legacy.final, tampered)
    assert [leaf.name for leaf in report.leaves if not leaf.ok] == ['params/out/bias']


def test_a_missing_leaf_is_a_mismatch():
    result = run('mlp', devices=2, steps_per_call=5, verdict='screen')
    partial = {g: dict(leaves) for g, leaves in result.new.final.items()}
    del partial['opt_state']['0/mu/out/bias']
    report = compare.compare(result.legacy.final, partial)
    assert not report.match
    assert [leaf.note for leaf in report.leaves if not leaf.ok] == ['only on the legacy side']


@pytest.mark.parametrize('name', FAST)  # cnn's (BatchNorm statistics too): test_stateful.py
def test_pmap_replicas_stay_identical(name):
    pstate = run(name, devices=8, steps_per_call=5, verdict='screen').legacy.raw
    assert sides.replica_spread(pstate) == 0.0
    # Negative control: one replica nudged by one ulp-sized step is seen.
    leaves = jax.tree.leaves(pstate)
    nudged = np.array(leaves[0])
    nudged[-1] = np.nextafter(nudged[-1], np.inf) if nudged.dtype.kind == 'f' else nudged[-1] + 1
    assert sides.replica_spread([nudged, *leaves[1:]]) > 0.0


@pytest.mark.parametrize('name', FAST)  # score draws noise keys; cnn's dropout keys come from the same chain
def test_same_seed_gives_bitwise_identical_results(name):
    first, second = (
        run(name, devices=2, steps_per_call=5, verdict='screen'),  # test_paths_match's run
        fresh(name, devices=2, steps_per_call=5, verdict='screen'),
    )
    for a, b in [(first.legacy, second.legacy), (first.new, second.new)]:
        np.testing.assert_array_equal(a.losses, b.losses)
        for group in a.final:
            for path in a.final[group]:
                np.testing.assert_array_equal(a.final[group][path], b.final[group][path], err_msg=path)


def test_another_seed_gives_other_numbers():
    other = run('mlp', devices=2, steps_per_call=5, seed=1, verdict='screen').legacy.losses
    assert not np.array_equal(run('mlp', devices=2, steps_per_call=5, verdict='screen').legacy.losses, other)


def test_placing_a_legacy_state_and_reading_it_back_compiles_nothing(caplog):
    """``legacy_pmap.train.replicate`` and ``unreplicate_to_host`` send and read host arrays: flax's
    stacking on device and a shard's indexing compile programs per leaf shape (seconds of every check
    in a fresh process). Shapes no other test uses, so that nothing is cached already; the negative
    control is flax's own ``replicate`` on the same shapes, which does compile."""
    require_devices(4)
    params = {'w': jnp.asarray(np.arange(21, dtype=np.float32).reshape(3, 7)), 'b': jnp.ones(7)}  # on device
    state = legacy.TrainState(np.int32(3), params, {'mu': params}, {}, params)
    devices = jax.devices()[:4]
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        pstate = legacy.replicate(state, devices)
        back = legacy.unreplicate_to_host(pstate)
    assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith('Compiling')]
    assert pstate.params['w'].shape == (4, 3, 7)
    assert pstate.params['w'].sharding.spec == jax.sharding.PartitionSpec(legacy.AXIS)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(got, want)
    with jax.log_compiles(), caplog.at_level(logging.WARNING):
        flax.jax_utils.replicate(state, devices)
    assert [r for r in caplog.records if r.getMessage().startswith('Compiling')], 'the control compiled nothing'
