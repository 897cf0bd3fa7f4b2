"""Where reports go: checked before any work, written atomically after it.

A report (``--json`` of every command, ``run``'s figures) is written to a temporary file
in the target's directory and renamed over the target (``os.replace``), so an interrupted
run leaves either the old file or the new one, never half of one. A ``--json`` report
without ``--overwrite`` is linked into place exclusively instead: one that another run
wrote there meanwhile is never replaced.
"""

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO

from equivalence.core.port.config import ConfigError


def check_file(path: str, overwrite: bool, flag: str = '--json') -> None:
    """Raise unless a report can be written at ``path`` without clobbering anything unasked."""
    if not path or path.endswith(os.sep) or (os.altsep and path.endswith(os.altsep)):
        raise ConfigError(f'{flag} needs a file name, got {path!r}')
    target = os.path.realpath(path)
    if os.path.isdir(target):
        raise ConfigError(f'{flag} {path} is a directory; give a file name')
    if os.path.lexists(target):
        if not os.path.isfile(target):
            raise ConfigError(f'{flag} {path} exists and is not a regular file')
        if not overwrite:
            raise ConfigError(f'{path} exists; pass --overwrite to replace it')
    _check_writable_dir(os.path.dirname(target), f'{flag} {path}')


def check_dir(directory: str, files: tuple[str, ...], overwrite: bool, flag: str = '--plot') -> None:
    """Raise unless ``files`` can be written into ``directory`` (created if missing; its parent must exist)."""
    if not directory:
        raise ConfigError(f'{flag} needs a directory name, got {directory!r}')
    target = os.path.realpath(directory)
    if not os.path.lexists(target):
        _check_writable_dir(os.path.dirname(target), f'{flag} {directory}', folder=True)
        return
    if not os.path.isdir(target):
        raise ConfigError(f'{flag} {directory} is not a directory')
    _check_writable_dir(target, f'{flag} {directory}')
    existing = [os.path.join(directory, f) for f in files if os.path.lexists(os.path.join(target, f))]
    for path in existing:
        if not os.path.isfile(path):
            raise ConfigError(f'{path} exists and is not a regular file')
    if existing and not overwrite:
        raise ConfigError(f'{", ".join(existing)} exists; pass --overwrite to replace it')


def _check_writable_dir(directory: str, what: str, folder: bool = False) -> None:
    """Raise unless a report can be created in ``directory``: tried, by creating (and removing) a file
    there, or a folder with ``folder`` (``--plot DIR`` not there yet), for ``os.access`` says yes
    where nothing can be created (root in ``/proc``, a read-only mount)."""
    if not os.path.exists(directory):
        raise ConfigError(f'cannot write {what}: directory {directory} does not exist')
    if not os.path.isdir(directory):
        raise ConfigError(f'cannot write {what}: {directory} is not a directory')
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ConfigError(f'cannot write {what}: directory {directory} is not writable')
    try:
        if folder:
            os.rmdir(tempfile.mkdtemp(prefix='.equivalence-probe-', dir=directory))
        else:
            fd, probe = tempfile.mkstemp(prefix='.equivalence-probe-', dir=directory)
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        kind = 'folder' if folder else 'file'
        raise ConfigError(f'cannot write {what}: no new {kind} can be created in {directory} ({e.strerror})') from None


@contextlib.contextmanager
def atomic_write(path: str, binary: bool = False, overwrite: bool = True) -> Iterator[IO]:
    """Open a temporary file beside ``path``; on success, move it to ``path``; on failure, delete it.

    ``overwrite``: renamed over whatever is at ``path`` (``os.replace``). Without it the report is
    linked into place exclusively (``os.link`` fails on an existing name; where the file system has
    no hard links, ``open(path, 'x')``): a report that appeared at ``path`` since ``check_file``
    (another run writing the same ``--json``) is kept, this one is moved to a name beside it, and
    ``ConfigError`` says both."""
    target = os.path.realpath(path)  # a symlink keeps pointing at the report
    directory, name = os.path.split(target)
    fd, tmp = tempfile.mkstemp(prefix=f'.{name}.', suffix='.tmp', dir=directory)
    try:
        with os.fdopen(fd, 'wb' if binary else 'w') as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a report gets the usual permissions
        if overwrite:
            os.replace(tmp, target)
        elif not _create(tmp, target):
            raise ConfigError(
                f'{path} appeared while this command ran (another run writing the same report?) and is kept; '
                f'this report is in {_keep_beside(tmp, target)}; pass --overwrite to replace it'
            )
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _create(tmp: str, target: str) -> bool:
    """``tmp`` moved to ``target`` only if nothing is there; False if something is."""
    try:
        os.link(tmp, target)  # atomic and exclusive: readers see no file or the whole report
    except FileExistsError:
        return False
    except OSError:  # no hard links here (some FUSE and FAT mounts): exclusive still, not atomic
        try:
            with open(target, 'xb') as out, open(tmp, 'rb') as src:
                shutil.copyfileobj(src, out)
        except FileExistsError:
            return False
    os.unlink(tmp)
    return True


def _keep_beside(tmp: str, target: str) -> str:
    """``tmp`` renamed to a visible name of its own beside ``target`` (``report.k2j3h.json``)."""
    stem, ext = os.path.splitext(os.path.basename(target))
    fd, kept = tempfile.mkstemp(prefix=f'{stem}.', suffix=ext or '.kept', dir=os.path.dirname(target))
    os.close(fd)
    os.replace(tmp, kept)
    return kept


def write_json(path: str, payload, overwrite: bool = False) -> None:
    """``payload`` as indented JSON; numpy values as numbers and lists, non-finite numbers as null.
    Replaces an existing ``path`` only with ``overwrite`` (the commands' ``--overwrite``)."""
    text = json.dumps(plain(payload), indent=2, allow_nan=False) + '\n'
    with atomic_write(path, overwrite=overwrite) as f:
        f.write(text)


def plain(value):
    """JSON-ready: numpy scalars and arrays as Python numbers and lists; nan and inf (JSON has none) as None."""
    if hasattr(value, 'tolist'):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
