"""BatchNorm and Dropout under pmap vs sharding, and the two RNG modes (issue: stateful layers)."""

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest
from conftest import require_devices
from flax import nnx

from equivalence.core import harness, kinds
from equivalence.core.compare import compare
from equivalence.core.port import workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.run import inputs as made
from equivalence.core.run import sides
from legacy_pmap import models as legacy_models
from nnx_sharded import models as nnx_models

RANDOM = [name for name, wl in workloads.WORKLOADS.items() if name in ('score', 'cnn')]


def config(name: str, **overrides) -> RunConfig:
    fields = {'workload': name, 'batch_size': workloads.get(name).default_batch, 'calls': 2, **overrides}
    require_devices(fields.get('devices', 8))
    return RunConfig(**fields)


@pytest.mark.parametrize('devices, rng_mode', [(8, 'per-device'), (2, 'global')])  # each mode, each end of D
def test_cnn_matches_with_running_statistics_and_accuracy(devices, rng_mode):
    # The fixed screen first (a leaf that fails it is still judged by its floor): the subject here is
    # BatchNorm's statistics and accuracy; the controls below and test_verdict.py test the verdict.
    result = harness.run(workloads.get('cnn'), config('cnn', devices=devices, rng_mode=rng_mode, verdict='screen'))
    assert result.report.match, [(x.name, x.max_abs) for x in result.report.leaves if not x.ok]
    stats = [x for x in result.report.leaves if x.group == 'model_state']
    assert {x.path for x in stats} == {f'batch_stats/bn{i}/{s}' for i in (1, 2) for s in ('mean', 'var')}
    assert all(x.ok for x in stats)
    assert result.legacy.eval_accuracy == result.new.eval_accuracy > 0.5  # chance is 0.1
    assert sides.replica_spread(result.legacy.raw) == 0.0  # pmap's replicas, statistics included, stay one


def test_legacy_batchnorm_without_axis_name_is_a_mismatch():
    """Per-device statistics (no axis_name) are the classic bug: the harness must see it."""
    wl = workloads.get('cnn')
    no_axis = dataclasses.replace(wl, legacy_model=lambda: legacy_models.CNN(bn_axis_name=None))
    result = harness.run(no_axis, config('cnn', devices=8), diagnose=False)
    failed = {x.group for x in result.report.leaves if not x.ok}
    assert {'model_state', 'losses', 'params'} <= failed


def test_a_model_ports_batchnorm_naming_another_axis_is_told_the_suites_axis():
    """A linen ``BatchNorm(axis_name='data')`` in a ``ModelPort``: the fix said 'the port declares
    axis_name='batch': set axis_name='data'', a field a ModelPort does not have. It names the suite's
    pmap axis, and what to change in the model. No training runs (the pre-flight stops it)."""
    from equivalence.core import preflight
    from equivalence.pitfalls import batchnorm_axis_name

    require_devices(2)
    port = batchnorm_axis_name.workload('data')
    with pytest.raises(preflight.PreflightError) as e:
        harness.check(port, devices=2, steps_per_call=1, calls=1)
    text = str(e.value)
    assert 'unbound axis name: data' in text and 'the port declares' not in text, text
    assert "fix: the suite's pmap names its axis 'batch': give the model's collectives (a linen BatchNorm's " in text


def test_swapping_rng_modes_between_the_sides_is_a_mismatch():
    wl = workloads.get('cnn')
    cfg = config('cnn', devices=8)
    fed = made.make(wl, cfg)
    old = sides.run_legacy(kinds.of(wl), cfg, fed)
    new = sides.run_new(kinds.of(wl), dataclasses.replace(cfg, rng_mode='global'), fed)
    report = compare.compare(sides.with_losses(old.final, old.losses), sides.with_losses(new.final, new.losses))
    assert not report.match
    assert not next(x for x in report.leaves if x.group == 'losses').ok


def _final(name: str, devices: int, rng_mode: str, runs=(sides.run_legacy, sides.run_new)) -> list[dict]:
    """The final states and losses of the paths in ``runs`` (both by default); no verdict (this
    test compares runs across D itself)."""
    wl, cfg = workloads.get(name), config(name, devices=devices, rng_mode=rng_mode, calls=1)
    fed = made.make(wl, cfg)
    return [sides.with_losses(p.final, p.losses) for p in (run(kinds.of(wl), cfg, fed) for run in runs)]


@pytest.mark.parametrize('name', RANDOM)
def test_global_mode_is_invariant_to_the_device_count(name):
    """Global keys: each path at D=8 ends where it ends at D=1 (two counts are enough for
    invariance; 8, the batch split the most ways, is the most informative). The negative
    control runs the legacy path alone: per-device keys at D=1 and D=8 draw other numbers."""
    tol = workloads.get(name).tolerance
    legacy_1, nnx_1 = _final(name, 1, 'global')
    legacy_8, nnx_8 = _final(name, 8, 'global')
    assert compare.compare(legacy_1, legacy_8, tol).match, 'legacy, D=1 vs D=8'
    assert compare.compare(nnx_1, nnx_8, tol).match, 'nnx, D=1 vs D=8'
    # Negative control: per-device keys depend on D, so D=1 and D=8 draw other numbers.
    [per_device_1] = _final(name, 1, 'per-device', runs=(sides.run_legacy,))
    [per_device_8] = _final(name, 8, 'per-device', runs=(sides.run_legacy,))
    assert not compare.compare(per_device_1, per_device_8, tol).match


def test_dropout_mask_is_the_frameworks_dropout():
    """The mask drawn by cnn_noise's formula is bit for bit what both Dropout layers draw."""
    key, rate = jax.random.PRNGKey(3), 0.25
    x = jax.random.normal(jax.random.PRNGKey(4), (16, 64))
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    linen = nn.Dropout(rate, deterministic=False).apply({}, x, rng=key)
    nnx_out = nnx.Dropout(rate)(x, rngs=key)
    np.testing.assert_array_equal(legacy_models.dropout(x, keep, rate), linen)
    np.testing.assert_array_equal(nnx_models.dropout(x, keep, rate), linen)
    np.testing.assert_array_equal(nnx_out, linen)
    assert not np.array_equal(legacy_models.dropout(x, ~keep, rate), linen)  # the check can fail
