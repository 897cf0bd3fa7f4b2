"""The porting pitfalls: each wrong version shows its damage, each fix matches; the CLI's contract.

One test per pitfall asserts both halves on the case's measured figures, against thresholds
stated here (DAMAGE = 100x the suite tolerance's absolute floor, see pitfalls/base.py).
Timings are reported by the cases, never asserted.
"""

import json
import re
import subprocess
import types

import pytest
from conftest import assert_one_line_error, require_devices, run_module

from equivalence import pitfalls
from equivalence.pitfalls import base
from equivalence.pitfalls import unblocked_collectives as queued

# Compiled at XLA's level 0 in this worker (conftest.at_level_0_in_process), as the subject allows:
AT_LEVEL_0 = "each pitfall's damage is 100x the suite's tolerance; a fix's MATCH of noise is test_equivalence's"

D = 8  # the README's figures are for 8 simulated devices
EXPECTED = [
    'missing_pmean',
    'batchnorm_axis_name',
    'per_device_rng',
    'masked_loss',
    'shard_map_pmean',
    'scan_transform_metadata',
    'indivisible_batch',
    'unreplicate_gather',
    'unblocked_collectives',
    'explicit_mesh',
    'warmup_off_by_one',
]


def run_case(name: str) -> base.CaseResult:
    require_devices(D)
    result = pitfalls.load(name).run(D)
    assert isinstance(result, base.CaseResult)
    return result


def test_cases_are_discovered_in_issue_order_with_their_interface():
    assert pitfalls.names() == EXPECTED
    for number, name in enumerate(EXPECTED, start=1):
        module = pitfalls.load(name)
        assert (module.NUMBER, module.NAME) == (number, name)
        assert module.TITLE and len(module.DESCRIPTION) > 40 and callable(module.run)
    with pytest.raises(KeyError):
        pitfalls.load('base')


def test_1_missing_pmean_replicas_drift_and_pmean_fixes_it():
    r = run_case('missing_pmean')
    assert r.details['replica_spread'] > base.DAMAGE and r.details['max_abs_to_reference'] > base.DAMAGE
    assert r.details['fixed_replica_spread'] == 0.0 and r.details['fixed_max_abs_params'] < base.TOL.atol
    assert r.damage_shown and r.fix_matches and r.documented


def test_2_batchnorm_without_axis_name_differs_and_with_it_matches():
    r = run_case('batchnorm_axis_name')
    assert r.details['replica_spread_batch_stats'] > base.DAMAGE
    assert min(r.details['max_abs'][g] for g in ('losses', 'model_state', 'params')) > base.DAMAGE
    assert r.details['fixed_replica_spread_batch_stats'] == 0.0
    assert max(r.details['fixed_max_abs'].values()) < base.TOL.atol
    assert r.damage_shown and r.fix_matches


def test_3_mixed_rng_modes_differ_and_either_mode_on_both_sides_matches():
    r = run_case('per_device_rng')
    assert r.details['wrong']['first_step_loss_diff'] > base.DAMAGE and r.details['wrong']['params'] > base.DAMAGE
    for mode in ('per-device/per-device', 'global/global'):
        assert r.details[mode]['match'], mode
    assert r.damage_shown and r.fix_matches


def test_4_pmean_of_masked_means_is_off_and_psum_of_numerator_and_denominator_matches():
    r = run_case('masked_loss')
    assert r.details['valid_on_last_device'] < r.details['padded_batch'] // D  # the devices do differ
    assert min(r.details['wrong_max_abs'][g] for g in ('losses', 'params')) > base.DAMAGE
    assert max(r.details['fixed_max_abs'].values()) < base.TOL.atol
    assert r.damage_shown and r.fix_matches


def test_5_shard_map_with_extra_pmean_gives_d_times_the_gradient_and_both_fixes_match():
    r = run_case('shard_map_pmean')
    assert all(ratio == pytest.approx(D, rel=1e-5) for ratio in r.details['grad_norm_ratio'].values())
    assert r.details['wrong_max_abs'] > base.DAMAGE
    fixes = [k for k in r.details if k.startswith(('A:', 'B:'))]
    assert len(fixes) == 2 and all(r.details[k] < base.TOL.atol for k in fixes)
    assert r.damage_shown and r.fix_matches


def test_6_scan_transform_metadata_changes_nothing_and_placing_the_batch_shards_it():
    r = run_case('scan_transform_metadata')
    assert r.details['metadata_changes_nothing'] is True
    assert r.details['unplaced'] == {'devices': 1, 'all_reduces': 0}
    assert r.details['placed']['devices'] == D and r.details['placed']['all_reduces'] >= 1
    assert r.details['placed']['max_abs_diff'] < base.TOL.atol
    assert r.changes_nothing and not r.damage_shown and r.fix_matches and r.documented


def test_6_negative_control_the_identity_check_sees_a_different_program():
    from equivalence.pitfalls import scan_transform_metadata as case

    a = {'program': 'x', 'params': {'w': [1.0]}, 'losses_K': {'losses': [0.0]}}
    assert case.identical(a, a)
    assert not case.identical(a, {**a, 'program': 'y'})
    assert not case.identical(a, {**a, 'params': {'w': [1.0 + 1e-7]}})


def test_7_indivisible_batch_raises_on_both_paths_the_suite_explains_and_padding_matches():
    r = run_case('indivisible_batch')
    errors = r.details['raw_errors']
    assert set(errors) == {'pmap layout (legacy shard_batch)', 'mesh placement (device_put)'}
    assert 'cannot reshape' in errors['pmap layout (legacy shard_batch)']
    assert 'divide' in errors['mesh placement (device_put)']
    assert 'use --batch-size 96 or 104' in r.details['suite_error']
    assert r.details['padded_batch'] == 104 and r.details['padded_max_abs_diff'] < base.TOL.atol
    assert r.damage_shown and r.fix_matches


def test_8_x0_is_an_all_reduce_copied_to_every_device_and_the_shard_read_is_not():
    r = run_case('unreplicate_gather')
    assert min(r.details['all_reduces_per_leaf']) >= 1 and r.details['shard_read_all_reduces'] == [0]
    assert r.details['x0_device_copies'] == [D] and r.details['shard_read_device_copies'] == [1]
    assert r.details['max_abs_diff'] == 0.0
    assert r.damage_shown and r.fix_matches


def test_9_queued_collectives_are_contained_and_blocking_completes_and_matches():
    r = run_case('unblocked_collectives')
    wrong, fixed = r.details['wrong'], r.details['fixed']
    assert wrong['outcome'] in ('aborted', 'hung', 'completed'), wrong  # bounded, whatever happened
    assert wrong['seconds'] <= queued.BOUND_S + 1
    if wrong['outcome'] == 'aborted':
        assert 'Termination timeout for `all reduce`' in wrong['message']
    assert r.damage_shown == (wrong['outcome'] in ('aborted', 'hung'))
    assert fixed['outcome'] == 'completed' and fixed['calls'] == queued.CALLS
    assert fixed['match'] and fixed['max_abs_params'] < base.TOL.atol
    assert r.fix_matches and r.documented and not r.damage_required


def test_9_rendezvous_abort_is_recognised_and_other_outcomes_are_said_plainly():
    stderr = (
        'E1129 rendezvous.cc:116] [id=0] This thread has been waiting for `all reduce RendezvousKey{x}` for 2 s\n'
        'F1129 22:24:06.661930 8848 rendezvous.cc:161] [id=4] Termination timeout for `all reduce '
        'RendezvousKey{run_id=RunId: -5, global_devices=[0, 1]}` of 5 seconds exceeded. Exiting.\n'
    )
    message = queued.rendezvous_message(stderr)
    assert message == 'Termination timeout for `all reduce` of 5 seconds exceeded. Exiting.'
    assert queued.rendezvous_message('Segmentation fault') is None
    assert queued.describe({'outcome': 'completed', 'seconds': 1.25}, 7).startswith('not reproduced on this machine')
    assert 'hung' in queued.describe({'outcome': 'hung', 'seconds': queued.BOUND_S}, 7)


def test_10_explicit_mesh_raises_outside_set_mesh_and_both_fixes_match():
    r = run_case('explicit_mesh')
    assert r.details['default_axis_type'] == 'AxisType.Explicit'
    assert 'jax.set_mesh' in r.details['error']
    assert r.details['inside jax.set_mesh'] < base.TOL.atol and r.details['AxisType.Auto mesh'] < base.TOL.atol
    assert r.damage_shown and r.fix_matches


def test_11_naive_warmup_moves_the_first_update_and_the_optax_schedules_match():
    r = run_case('warmup_off_by_one')
    naive = 'naive (count + 1)'
    assert r.details['reference_first_update'] == 0.0
    assert r.details['first_update'][naive] > base.DAMAGE
    assert r.details['final_max_abs_to_reference'][naive] > base.DAMAGE
    assert not r.details['every_step_within_tolerance'][naive]
    fixes = [k for k in r.details['first_update'] if k != naive]
    assert len(fixes) == 2 and all(r.details['first_update'][k] == 0.0 for k in fixes)
    assert all(r.details['every_step_within_tolerance'][k] for k in fixes)
    assert r.damage_shown and r.fix_matches


def test_a_case_that_does_not_show_its_damage_is_not_documented():
    ok = base.CaseResult('s', 't', damage_shown=True, fix='f', fix_matches=True)
    assert ok.documented
    assert not base.CaseResult('s', 't', damage_shown=False, fix='f', fix_matches=True).documented
    assert not base.CaseResult('s', 't', damage_shown=True, fix='f', fix_matches=False).documented
    assert base.CaseResult('s', 't', False, 'f', True, damage_required=False).documented


def test_a_case_that_raises_is_a_row_that_does_not_pass():
    from equivalence.pitfalls import __main__ as cli_main

    def broken(devices):
        raise RuntimeError('boom\nsecond line')

    case = types.SimpleNamespace(NUMBER=99, NAME='broken', TITLE='t', DESCRIPTION='d', run=broken)
    row = cli_main.run_case(case, D)
    assert row['documented'] is False and row['symptom'] == 'case raised RuntimeError: boom'
    text = cli_main.table([row], D, 'cpu')
    assert '0 of 1 cases behave as documented; not: broken' in text


def test_a_case_whose_wrong_version_changes_nothing_reads_no_damage_and_stays_documented():
    """Case 6's row: the metadata was measured to change nothing (the same program, bitwise the same
    results), so its damage column says none, not 'yes' beside 'no effect'; the pitfall is what it
    fails to do (the batch stays on one device), which the symptom and the footnote say. Built from
    a CaseResult, without running the case's JAX code."""
    from equivalence.pitfalls import __main__ as cli_main

    def result(changes_nothing):
        return base.CaseResult('no effect (program and results bitwise identical ...: yes)', 't', damage_shown=False,
                               fix='f', fix_matches=True, changes_nothing=changes_nothing)  # fmt: skip

    case = types.SimpleNamespace(NUMBER=6, NAME='scan_transform_metadata', TITLE='t', DESCRIPTION='d')
    row = cli_main.run_case(types.SimpleNamespace(**vars(case), run=lambda devices: result(True)), D)
    assert row['documented'] and row['changes_nothing'] and not row['damage_shown']
    text = cli_main.table([row], D, 'cpu')
    line = next(x for x in text.splitlines() if x.startswith(' 6  scan_transform_metadata'))  # its row, then its fix
    assert line.split()[2:4] == ['none+', 'yes'], line  # damage: none; fix matches: yes
    assert '+ no damage of its own: the wrong version changes nothing, measured' in text
    assert '1 of 1 cases behave as documented' in text
    assert not result(False).documented  # had it changed something and shown no damage: not as documented


# ---- the CLI, in a subprocess ----


def cli(*args: str) -> subprocess.CompletedProcess:
    return run_module('equivalence.pitfalls', *args)


def test_cli_list_names_every_case():
    proc = cli('--list')
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[1] for line in proc.stdout.strip().splitlines()] == EXPECTED


def test_cli_only_one_case_prints_its_row_and_writes_json(tmp_path, capsys):
    """In-process, through the command's own ``main`` (its start as a process: ``--list`` and the bad input
    below), so that the case's programs are test 7's."""
    from equivalence.pitfalls.__main__ import main

    out = tmp_path / 'pitfalls.json'
    assert main(['--only', 'indivisible_batch', '--json', str(out)]) == 0
    said = capsys.readouterr()
    stdout = said.out  # its row; the devices and that every case behaves as documented: the JSON below
    # the case said on stderr as it ran (not a terminal here): its name, then its seconds
    assert re.fullmatch(r'pitfall 7 indivisible_batch \.\.\. \d+\.\d s( \(.*\))?\n', said.err), said.err
    assert 'IndivisibleError' in stdout
    report = json.loads(out.read_text())
    assert report['all_documented'] is True and report['devices'] == 8
    [case] = report['cases']
    assert case['name'] == 'indivisible_batch' and case['damage_shown'] and case['fix_matches']
    assert case['details']['batch'] == 100 and case['description']


@pytest.mark.parametrize(
    'args, expected',
    [
        (['--only', 'resnet'], "unknown pitfall 'resnet'; choose one of missing_pmean"),
        (['--frobnicate'], 'unrecognized arguments: --frobnicate'),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(args, expected):
    proc = cli(*args)
    assert_one_line_error(proc, expected)


def test_cli_keeps_an_existing_json_without_overwrite(tmp_path, capsys):
    """Refused by the command's validation, in-process (exit 2 as a process: the bad input above)."""
    from equivalence.pitfalls.__main__ import main

    out = tmp_path / 'pitfalls.json'
    out.write_text('precious')
    with pytest.raises(SystemExit) as exit_:
        main(['--only', 'indivisible_batch', '--json', str(out)])
    assert exit_.value.code == 2 and 'pass --overwrite' in capsys.readouterr().err
    assert out.read_text() == 'precious'
