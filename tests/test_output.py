"""Report targets are checked before any work, and reports are written atomically."""

import json
import os
import stat

import pytest

from equivalence.core.port.config import ConfigError
from equivalence.core.report import output


@pytest.fixture
def place(tmp_path):
    (tmp_path / 'old.json').write_text('precious')
    (tmp_path / 'adir').mkdir()
    (tmp_path / 'afile').write_text('x')
    return tmp_path


@pytest.mark.parametrize(
    'name, overwrite, expected',
    [
        ('adir', True, 'is a directory'),
        ('missing/r.json', False, 'does not exist'),
        ('afile/r.json', False, 'is not a directory'),
        ('new/', False, 'needs a file name'),
        ('old.json', False, 'pass --overwrite'),
    ],
)
def test_bad_json_targets_are_refused(place, name, overwrite, expected):
    with pytest.raises(ConfigError, match=expected):
        output.check_file(os.path.join(place, name), overwrite)


def test_good_json_targets_pass(place):
    output.check_file(str(place / 'new.json'), overwrite=False)
    output.check_file(str(place / 'old.json'), overwrite=True)
    with pytest.raises(ConfigError, match='needs a file name'):
        output.check_file('', overwrite=True)
    with pytest.raises(ConfigError, match='not a regular file'):
        output.check_file(os.devnull, overwrite=True)


def test_unwritable_directory_is_refused(place, monkeypatch):
    # root may write anywhere, so the permission bit cannot be tested by chmod here
    monkeypatch.setattr(os, 'access', lambda path, mode: False)
    with pytest.raises(ConfigError, match='not writable'):
        output.check_file(str(place / 'new.json'), overwrite=False)
    with pytest.raises(ConfigError, match='not writable'):
        output.check_dir(str(place / 'adir'), ('a.png',), overwrite=False)


def test_plot_directory_rules(place):
    output.check_dir(str(place / 'figs'), ('a.png',), overwrite=False)  # created later; its parent exists
    assert not (place / 'figs').exists()  # checking creates nothing
    with pytest.raises(ConfigError, match='is not a directory'):
        output.check_dir(str(place / 'afile'), ('a.png',), overwrite=True)
    with pytest.raises(ConfigError, match='does not exist'):
        output.check_dir(str(place / 'missing' / 'figs'), ('a.png',), overwrite=True)
    (place / 'adir' / 'a.png').write_text('old')
    with pytest.raises(ConfigError, match='pass --overwrite'):
        output.check_dir(str(place / 'adir'), ('a.png',), overwrite=False)
    output.check_dir(str(place / 'adir'), ('a.png',), overwrite=True)
    (place / 'adir' / 'b.png').mkdir()
    with pytest.raises(ConfigError, match='not a regular file'):
        output.check_dir(str(place / 'adir'), ('b.png',), overwrite=True)


def test_interrupted_write_keeps_the_old_file_and_leaves_no_temporary(place):
    with pytest.raises(KeyboardInterrupt), output.atomic_write(str(place / 'old.json')) as f:
        f.write('{"half": ')
        raise KeyboardInterrupt
    assert (place / 'old.json').read_text() == 'precious'
    assert sorted(os.listdir(place)) == ['adir', 'afile', 'old.json']


def test_write_json_replaces_with_usual_permissions_and_writes_nan_as_null(place):
    link = place / 'link.json'
    link.symlink_to(place / 'old.json')
    output.write_json(str(link), {'loss': float('nan'), 'xs': (1.0, float('inf')), 'n': 3}, overwrite=True)
    assert link.is_symlink()  # the report behind the link was replaced, not the link
    assert json.loads((place / 'old.json').read_text()) == {'loss': None, 'xs': [1.0, None], 'n': 3}
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(place / 'old.json').st_mode) == 0o666 & ~umask


def test_a_directory_that_takes_no_new_file_is_refused_before_any_work(place, capsys):
    """``/proc`` passes ``os.access`` for root, yet no file can be created in it: the check creates
    (and removes) one, so ``--json``/``--plot`` there is exit 2 naming the flag, not exit 3 after training."""
    from test_cli import validate

    for check in (
        lambda: output.check_file('/proc/report.json', False),
        lambda: output.check_dir('/proc/figs', (), False),
    ):
        with pytest.raises(
            ConfigError, match=r'^cannot write --(json|plot) /proc/\S+: no new (file|folder) can be created in /proc \('
        ):
            check()
    with pytest.raises(SystemExit) as exit_:
        validate('run', ['--json', '/proc/report.json'])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count('\n') == 1 and err.startswith('error: cannot write --json /proc/'), err
    before = sorted(os.listdir(place))
    output.check_file(str(place / 'new.json'), overwrite=False)
    output.check_dir(str(place / 'adir'), ('a.png',), overwrite=False)
    output.check_dir(str(place / 'figs'), ('a.png',), overwrite=False)
    assert sorted(os.listdir(place)) == before and os.listdir(place / 'adir') == []  # the probes are gone


def test_two_writers_of_one_report_the_second_is_refused_and_the_first_kept(place):
    """Two runs given the same new ``--json``: both pass the check before their work, and the one
    that finishes second must not replace the first's report (kept unless --overwrite)."""
    target = str(place / 'report.json')
    output.check_file(target, overwrite=False)  # both runs' checks, before either wrote anything
    with pytest.raises(ConfigError, match=r'report\.json appeared while this command ran.*pass --overwrite') as e:
        with output.atomic_write(target, overwrite=False) as slow:
            slow.write('{"run": "slow"}')
            output.write_json(target, {'run': 'fast'})  # the other run finishes first
    assert json.loads((place / 'report.json').read_text()) == {'run': 'fast'}
    kept = str(e.value).split('this report is in ')[1].split(';')[0]
    assert open(kept).read() == '{"run": "slow"}'  # the second report is kept beside it, not lost
    output.write_json(target, {'run': 'again'}, overwrite=True)  # --overwrite replaces
    assert json.loads((place / 'report.json').read_text()) == {'run': 'again'}
