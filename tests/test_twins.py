"""A twin measures a floor wherever the run could be measured, and never one it cannot vouch for.

- At D = 1 with per-device keys the twin on 2 devices keeps the run's ``[1, 2]`` keys.
- A twin whose random draws are not the run's is refused, even where its first two losses agree.
- A new side pinned to a mesh built from ``jax.devices()`` at import gets its twin in a fresh process.

These are the device-count twins (``--twin devices``, and every twin of several processes); the default twin
is the run's own program (``run/nudge.py``; ``tests/test_one_chip.py``), which none of this concerns.
"""

import dataclasses
import json
import types

import jax
import numpy as np
import pinned_port
import pytest
from conftest import require_devices
from noisy_ports import PER_DEVICE, QUICK, nnx_step

from equivalence.core import harness, kinds
from equivalence.core.compare import compare
from equivalence.core.compare import rule as verdict
from equivalence.core.compare.findings import (
    Finding,
    LegacyTwin,
    Memory,
    NoTwin,
    Refusal,
    TwinRefused,
    Twins,
    Unmeasured,
)
from equivalence.core.compare.outcome import Outcome
from equivalence.core.port import loading, workloads
from equivalence.core.port.config import RunConfig
from equivalence.core.report import render as report
from equivalence.core.report import words
from equivalence.core.run import inputs as made
from equivalence.core.run import model_side, sides
from equivalence.core.run.model_side import Reordered
from equivalence.core.twins import fresh, legacy_twin


def mesh_sized_step(ts, batch, keys):
    """One key per device of the mesh the batch lives on: the run's keys on the run's mesh, others on a twin's."""
    x = batch['x']
    n = keys.shape[0] if isinstance(x, jax.core.Tracer) else len(x.sharding.device_set)  # traced: as given
    return nnx_step(ts, batch, keys[:n])


MESH_SIZED = dataclasses.replace(PER_DEVICE, name='mesh-sized-noise', new_step=mesh_sized_step)


def test_a_twin_at_one_device_keeps_the_per_device_keys():
    """D = 1, per-device keys: the twin on 2 devices is given the run's ``[1, 2]`` keys, which do not split
    over 2 devices (it raised IndivisibleError, and the verdict fell back on the fixed screen)."""
    require_devices(2)
    result = harness.check(PER_DEVICE, devices=1, twin='devices', **QUICK)
    assert result.verdict.twin == Twins((2,)), words.lines(result.verdict)
    assert result.report.match and result.report.floor is not None


def test_a_twin_that_draws_other_random_numbers_is_refused():
    """The twin's draws are compared with the run's, not only its first two losses: with a zero head
    and a first learning rate of 0 those agree whatever noise is drawn. A step that takes one key per
    device of its mesh draws other noise on the twin's: refused, its spread never a floor. The same
    step with the keys as given draws the run's numbers on any mesh: its twin measures (the control,
    the test above)."""
    require_devices(2)
    refused = harness.check(MESH_SIZED, devices=2, twin='devices', **QUICK)
    no_twin = refused.verdict.twin
    assert no_twin.why is NoTwin.Why.TWIN, words.lines(refused.verdict)
    assert no_twin.detail == TwinRefused(1, no_twin.detail.refusal, fresh=False, per_replica=True), no_twin
    assert no_twin.detail.refusal.why is Refusal.Why.DRAWS  # per_replica: the likely cause said (issue 51)
    assert refused.report.floor is None
    # no floor measured, so the verdict is NOT VERIFIED (exit 5) for that reason, never the fixed screen's MATCH
    assert refused.outcome is Outcome.NOT_VERIFIED and refused.verdict.unverified == Unmeasured(no_twin, True)


def test_with_no_floor_the_diagnosis_says_why_no_twin_measured_one():
    """The ``unmeasured`` line gives the twin's own reason, not a guess about device counts."""
    ref = {'params': {'w': np.array([1.0], np.float32)}}
    off = compare.compare(ref, {'params': {'w': np.array([1.1], np.float32)}}, compare.FLOAT32_REDUCTION_ORDER)
    why = NoTwin(NoTwin.Why.TWIN, "refused: it draws other random numbers than the new side's run")
    found = verdict.diagnose(off, None, None, False, why)
    assert found.kind is Finding.UNMEASURED and found.no_floor is why, found  # the twin's reason, not a guess


@pytest.fixture(scope='module')
def pinned():
    require_devices(8)
    return {
        p.name: harness.check(p, devices=len(jax.devices()), locate=False, twin='devices', **QUICK)
        for p in (pinned_port.PORT, pinned_port.SLIP)
    }


def test_a_port_a_factory_returns_is_loaded_by_its_factorys_name_in_the_fresh_process():
    """``--workload pinned_port:make_port`` (a function returning the port): the fresh process loads it as it
    was loaded, by the factory's name. It was 'not importable by name', and the run NOT VERIFIED. No JAX runs."""
    port = loading.load('pinned_port:make_port')
    assert fresh.locate(port, RunConfig(workload=port.name)) == 'pinned_port:make_port'
    assert fresh.locate(pinned_port.PORT, RunConfig(workload=port.name)) == 'pinned_port:PORT'
    assert fresh.locate(dataclasses.replace(port, name='unnamed'), RunConfig(workload='unnamed')) == ''  # the control


def test_a_new_side_pinned_to_its_own_mesh_gets_its_floor_from_a_fresh_process(pinned):
    """linen + jax.jit with shardings on a mesh built from jax.devices() at import runs on every device of
    its process and nowhere else: the twin on 1 device raises in this process (the verdict was the fixed
    screen, 'unmeasured' on MISMATCH). A fresh process that sees 1 device imports the port afresh and
    runs it: a measured floor, and the slip is a MISMATCH judged by it."""
    result = pinned[pinned_port.PORT.name]
    assert result.verdict.twin == Twins((1,), fresh=(1,)), words.lines(result.verdict)
    assert result.report.match
    said = report.to_json(result, {})
    assert said['verdict']['floor_rule'] is not None
    text = report.text(result, 'cpu')
    assert result.verdict.unverified is None and result.verdict.diagnosis is None  # measured: not 'unmeasured'
    # what its own step placed, read from the state it returned: two of the four parameters split (dims of
    # 16; 4 and 1 do not divide by 8), and the twin's bytes beside the run's, the arrays read
    assert said['placed_by'] == "the port's own step" and sum(any(p['spec']) for p in said['placement']) == 2
    assert said['strategy'] is None  # not the suite's default 'dp', which placed nothing here
    assert "the port's own step: 2 of 4 parameters split over its devices" in text
    memory = said['verdict']['memory']
    assert memory['run']['source'] == 'arrays' and memory['twins']['1 device(s)']['held'] > memory['run']['held']
    slipped = pinned[pinned_port.SLIP.name]
    assert not slipped.report.match and slipped.report.floor is not None
    assert slipped.verdict.kind is not Finding.UNMEASURED and slipped.verdict.twin == Twins((1,), fresh=(1,))
    json.dumps(report.to_json(slipped, {}))  # the report of a twin that ran elsewhere is plain data


def test_a_sharded_runs_twins_hold_no_more_per_device_than_the_run():
    """fsdp on 8 devices (wide): a twin on 1 device, or data parallel on 8, holds the whole state per
    device (5.0x and 4.8x the run's bytes per device, XLA's memory analysis), which a model that fits
    only sharded cannot. Its twins are the run's own devices, placed as fsdp and as fsdp-tp, the batch
    rows interleaved: at most 1.1x, in the report and the JSON, and the verdict is still a MATCH."""
    require_devices(8)
    result = harness.check(workloads.get('wide'), devices=8, strategy='fsdp', twin='devices', **QUICK)
    assert result.report.match, verdict.failed(result.report)
    placed = ('fsdp, batch rows interleaved', 'fsdp-tp, batch rows interleaved')
    assert result.verdict.twin == Twins((Reordered('fsdp'), Reordered('fsdp-tp')))
    memory = report.to_json(result, {})['verdict']['memory']
    run = memory['run']['held']
    assert set(memory['twins']) == set(placed)
    assert all(0 < twin_['held'] <= 1.1 * run for twin_ in memory['twins'].values()), memory
    said = 'bytes per device (XLA memory analysis of one call): run '  # the report's line, from the record
    assert Memory(memory['run'], memory['twins']) in result.verdict.done
    assert any(line.startswith(said) for line in words.done(result.verdict))


def test_a_reordered_twin_gives_every_example_its_own_noise():
    """The twin takes the batch's rows interleaved; the step draws noise by position, so the loss is handed
    each example's own noise (a loss that reads both sees the run's pairs, in the twin's order)."""
    rows = model_side.Reordered('fsdp').rows(8, 2)
    assert sorted(rows) == list(range(8)) and list(rows[:4]) == [0, 4, 1, 5]
    x = np.arange(8.0)
    loss = model_side.reordered_loss(lambda model, batch, noise: batch * 10 + noise['n'], rows)
    assert np.array_equal(loss(None, x[rows], {'n': x}), (x * 11)[rows])


def test_the_legacy_twin_with_per_device_keys_draws_what_the_run_draws():
    """cnn (Dropout) with per-device keys: the pmap side on another count gave each device one key of its
    own and drew other masks, so no legacy twin could run (cnn, Adam eps 1e-8, seed 5, D = 8 was a false
    MISMATCH). Drawing each of the run's D key rows for its examples, it is the run itself on D devices
    (bitwise) and agrees on its first losses on 1; the plain pmap step on 1 device does not (the control)."""
    require_devices(2)
    cnn = workloads.get('cnn')
    config = RunConfig(workload='cnn', devices=2, rng_mode='per-device', batch_size=cnn.default_batch, **QUICK)
    fed = made.make(cnn, config)
    run = sides.run_legacy(kinds.of(cnn), config, fed)
    same = legacy_twin.with_rows(cnn, config, 2, fed)
    assert all(np.array_equal(run.final[g][p], same.final[g][p]) for g in run.final for p in run.final[g])
    on_one = legacy_twin.with_rows(cnn, config, 1, fed)
    assert verdict.twin_refusal(run.losses, on_one.losses, 'legacy') is None
    plain = sides.run_legacy(kinds.of(cnn), dataclasses.replace(config, devices=1), fed)
    refused = verdict.twin_refusal(run.losses, plain.losses, 'legacy')
    assert (refused.why, refused.step, refused.side) == (Refusal.Why.SPACINGS, 1, 'legacy'), refused
    assert refused.spacings > verdict.TWIN_ULPS, refused


def test_a_fresh_process_that_fails_says_why_in_a_json_record_not_a_line_read_back(tmp_path):
    """The child writes how it ended (JSON: the exception's type and first line), which the parent reads;
    a child that ended before it could write one is told by the last line it printed."""
    import subprocess
    import sys

    ask, answer, said = (str(tmp_path / name) for name in ('request.pkl', 'result.pkl', 'ended.json'))
    command = [sys.executable, '-m', fresh.CHILD, 'mlp', '1', ask, answer, said]
    proc = subprocess.run(command, env=fresh.env(1), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    ended = json.loads((tmp_path / 'ended.json').read_text())
    assert ended['outcome'] == 'failed' and ended['error'] == 'FileNotFoundError' and ask in ended['message']
    assert fresh.failure(said, proc) == f'FileNotFoundError: {ended["message"]}'
    died = subprocess.CompletedProcess(command, -9, '', 'Fatal Python error: Aborted\n')
    assert fresh.failure(str(tmp_path / 'none.json'), died) == 'Fatal Python error: Aborted'


def test_a_loop_ports_legacy_twin_that_its_per_device_keys_part_is_said_as_expected():
    """A loop port's own step, on another device count, is handed that count's keys, not the run's per-device keys:
    where it draws from its device's key it computes another run, which is expected, and said so as information
    (google/mipnerf's step at D = 4 read 'refused: ... 93295 float32 spacings ... it does not compute the same
    thing'). The controls: global keys, or a twin handed the run's key rows, refused, say it plainly. No JAX runs."""
    params = [{'w': np.ones(3, np.float32)}]
    old = types.SimpleNamespace(params_per_call=params, final={}, start=params[0], losses=np.float32([0.376, 0.35]))
    twins = {1: types.SimpleNamespace(params_per_call=params)}
    other = types.SimpleNamespace(params_per_call=params, losses=np.float32([0.379, 0.36]))

    def ran(rng_mode: str, by_rows: bool = False):
        kind = types.SimpleNamespace(legacy_twin=lambda config, n, inputs: (other, by_rows))
        config = types.SimpleNamespace(devices=4, strategy='dp', calls=2, rng_mode=rng_mode)
        return legacy_twin.run(kind, config, old, old, twins, types.SimpleNamespace(recorded=None))[1]

    expected = ran('per-device')
    assert expected.ran is LegacyTwin.Ran.REFUSED and expected.keys_of == 4, expected
    said = words.legacy_twin(expected)
    assert said.startswith('legacy twin on 1 device(s) not used as a floor, as expected: with per-device keys')
    assert 'refused' not in said and "its loss at step 1 0.379000008, the run's 0.375999987" in said, said
    for plain in (ran('global'), ran('per-device', by_rows=True)):
        assert plain.keys_of is None and words.legacy_twin(plain).startswith('legacy twin on 1 device(s) refused')
