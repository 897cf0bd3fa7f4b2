"""A reference: the pmap side of a check, recorded once where it ran (``python -m equivalence.record``), then
read by every later check in place of running it (``run --reference FILE``).

One ``.npz`` file (numpy's own zip of ``.npy`` arrays, which every numpy since 1.x reads without pickle):
every array of the recording by a number, and one entry ``manifest``, a JSON text holding the recording's
structure (``encoding.encode``), what the run was (its ``RunConfig`` fields that decide what it computed: ``FITTED``),
where it ran (``environment``) and a sha256 of every array. Not Orbax: a team records in the environment its
pmap code ran in (jax 0.4, flax of its time), where the Orbax of today is not installed; ``.npz`` needs numpy
alone, and a file is one thing to keep beside the port's tests.

Read (``load``): a file that is not a reference, an array whose sha256 fails, or a run it does not fit
(``fits``: another K, C, batch, seed, key mode, device count or workload) is ``BadReference``, exit 2, one
line naming what differs, before anything is trained.
"""

import dataclasses
import hashlib
import json
import os
import platform
import sys
import tempfile
import zipfile
import zlib
from typing import Any

import jax
import numpy as np

from equivalence.core.port.config import ConfigError
from equivalence.core.port.plan import Run
from equivalence.core.run.encoding import Unreadable, decode, encode

FORMAT = 'equivalence-reference'
VERSION = 1
# What a run must share with the recorded one to compute the same thing: the rest (strategy, twin, verdict,
# precision, the NNX form) is the new side's or the verdict's own, free to differ.
FITTED = ('workload', 'devices', 'steps_per_call', 'calls', 'batch_size', 'seed', 'rng_mode')
FLAGS = {'steps_per_call': '--steps-per-call', 'batch_size': '--batch-size', 'rng_mode': '--rng'}


class BadReference(ConfigError):
    """A reference that cannot be read, is damaged, or does not fit the run: exit 2, before any training."""


def digest(a: np.ndarray) -> str:
    """sha256 of an array's dtype, shape and bytes."""
    h = hashlib.sha256(f'{a.dtype.str}{a.shape}'.encode())
    h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def environment() -> dict:
    """Where a recording ran: what could change its numbers."""
    versions = {}
    for name in ('jax', 'jaxlib', 'flax', 'optax', 'numpy'):
        module = sys.modules.get(name)
        if module is None:
            try:
                module = __import__(name)
            except ImportError:
                continue
        versions[name] = getattr(module, '__version__', '?')
    device = jax.devices()[0]
    return {
        'versions': versions,
        'python': platform.python_version(),
        'backend': jax.default_backend(),
        'device_kind': device.device_kind,
        'device_count': jax.device_count(),
        'process_count': jax.process_count(),
        'precision': str(jax.config.jax_default_matmul_precision),
        'threefry_partitionable': bool(jax.config.jax_threefry_partitionable),
        'xla_flags': os.environ.get('XLA_FLAGS', ''),
    }


# -- the file ---------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Reference:
    """A recording read back: its ``config`` (``FITTED`` fields), ``environment``, and its ``tree`` (what the
    recorder wrote: the inputs, the legacy run, its first steps recorded), still encoded until ``tree`` is
    decoded with the types the reader knows (``content``)."""

    path: str
    config: dict
    environment: dict
    structure: Any
    arrays: dict

    def content(self, types: dict[str, type]) -> Any:
        """The recording, decoded; ``BadReference`` where its structure does not (an edited manifest)."""
        try:
            return decode(self.structure, self.arrays, types)
        except Unreadable as e:  # a record of a class this process has not imported
            raise BadReference(f'reference {self.path}: {e}') from None
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
            raise self.edited(e) from None

    def edited(self, error: Exception) -> 'BadReference':
        """A manifest whose structure does not read as a recording (``error``): edited or damaged."""
        return BadReference(f'reference {self.path}: its manifest does not read as a recording ({type(error).__name__}'
                            f' {error}): edited or damaged since it was recorded, record it again')  # fmt: skip

    def fits(self, config: Run, port_name: str) -> None:
        """``BadReference`` naming the first thing this run does not share with the recorded one."""
        given = {**{k: getattr(config, k) for k in FITTED}, 'workload': port_name}
        for name in FITTED:
            if given[name] != self.config.get(name):
                recorded, here = self.config.get(name), given[name]
                if name == 'workload':
                    raise BadReference(f'reference {self.path}: recorded for the port {recorded!r}, not {here!r} (a '
                                       f'port keeps the name it was recorded under): check {recorded!r} against it, '
                                       f'or record a reference for {here!r}')  # fmt: skip
                flag = FLAGS.get(name, f'--{name}')
                raise BadReference(f'reference {self.path}: recorded with {flag} {recorded}, this run has {here}: run '
                                   f'the check with {flag} {recorded}, or record a reference for this run')  # fmt: skip


def save(path: str, config: Run, port_name: str, tree: Any) -> None:
    """Write ``tree`` as a reference at ``path``, atomically (a temporary file renamed into place)."""
    arrays: list = []
    structure = encode(tree, arrays)
    named = {f'a{i}': a for i, a in enumerate(arrays)}
    manifest = {
        'format': FORMAT,
        'version': VERSION,
        'config': {**{k: getattr(config, k) for k in FITTED}, 'workload': port_name},
        'environment': environment(),
        'sha256': {name: digest(a) for name, a in named.items()},
        'tree': structure,
    }
    manifest['manifest_sha256'] = _manifest_digest(manifest)
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=folder, suffix='.npz.tmp')
    try:
        with os.fdopen(fd, 'wb') as f:
            np.savez_compressed(f, manifest=np.array(json.dumps(manifest)), **named)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as a file the user wrote: mkstemp makes it private
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(path: str) -> Reference:
    """The reference at ``path``, every array checked against its sha256 (``BadReference`` otherwise)."""
    manifest, arrays = _read(path, with_arrays=True)
    hashes = manifest['sha256']
    if set(hashes) != set(arrays):
        raise BadReference(f'reference {path}: {len(arrays)} arrays, its manifest lists {len(hashes)}: damaged')
    for name, a in arrays.items():
        if digest(a) != hashes[name]:
            raise BadReference(f'reference {path}: array {name} fails its sha256: damaged since it was recorded')
    by_index = {int(name[1:]): a for name, a in arrays.items()}
    return Reference(path, manifest['config'], manifest['environment'], manifest['tree'], by_index)


def recorded_config(path: str) -> dict:
    """What the reference at ``path`` was recorded with (``FITTED``), its manifest alone read (no array):
    ``BadReference`` where it is no reference, as ``load`` says it."""
    return _read(path, with_arrays=False)[0]['config']


def with_recorded(flags: dict) -> dict:
    """``flags`` (``RunConfig`` keywords, ``reference`` among them) with the run's values the reference was recorded
    with where they leave them out: the library's and the pytest plugin's form of ``run --reference``; a value
    given that differs is ``BadReference`` naming the keyword, as those forms spell it."""
    path, recorded = flags['reference'], recorded_config(flags['reference'])
    for name in FITTED[1:]:  # not the workload: a port's name, which ``fits`` checks
        if name in flags and flags[name] != recorded[name]:
            raise BadReference(f'reference {path}: recorded with {name}={recorded[name]!r}, this check gives '
                               f'{name}={flags[name]!r}: give {name}={recorded[name]!r} or leave it out (the reference '
                               'gives it), or record a reference for this check')  # fmt: skip
    return {**{name: recorded[name] for name in FITTED[1:]}, **flags}


def _read(path: str, with_arrays: bool) -> tuple[dict, dict]:
    """``(its manifest, checked; its arrays by name, or {})``; ``BadReference`` saying what the file is where it
    is not a reference (``_what_it_is``) or cannot be read as one."""
    _what_it_is(path)
    try:
        with np.load(path, allow_pickle=False) as held:
            if 'manifest' not in held.files:
                names = ', '.join(held.files[:3]) + (' ...' if len(held.files) > 3 else '')
                raise BadReference(f'reference {path}: a zip of {len(held.files)} entries ({names or "none"}) with no '
                                   f'manifest: not a reference (python -m equivalence.record writes one)')  # fmt: skip
            text = str(held['manifest'])
            arrays = {name: held[name] for name in held.files if name != 'manifest'} if with_arrays else {}
    except BadReference:
        raise
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise BadReference(f'reference {path}: a damaged or truncated zip, which numpy cannot read '
                           f'({type(e).__name__}): record it again, or copy it whole') from None  # fmt: skip
    try:
        manifest = json.loads(text)
    except ValueError:
        raise BadReference(f'reference {path}: its manifest is not JSON: edited or damaged since it was recorded, '
                           'record it again') from None  # fmt: skip
    _check_manifest(path, manifest)
    return manifest, arrays


def _what_it_is(path: str) -> None:
    """``BadReference`` saying what ``path`` is, where it is not a zip that could be a reference: missing, a
    directory, unreadable, empty, one ``.npy`` array, a pickle (never loaded: loading one runs code), text."""
    if os.path.isdir(path):
        raise BadReference(f'reference {path}: a directory, not a file: give the .npz that python -m '
                           'equivalence.record wrote (its --out)')  # fmt: skip
    try:
        with open(path, 'rb') as f:
            head = f.read(512)
    except FileNotFoundError:
        raise BadReference(f'reference {path}: no such file') from None
    except OSError as e:
        raise BadReference(f'reference {path}: cannot be read ({e.strerror or type(e).__name__})') from None
    for magic, what in MAGIC:
        if head.startswith(magic):
            if what:
                raise BadReference(f'reference {path}: {what}, not a reference (python -m equivalence.record writes '
                                   'one, an .npz)')  # fmt: skip
            return
    if not head:
        raise BadReference(f'reference {path}: empty (0 bytes): a recording that did not finish, or a file cut short')
    text = head.decode('utf-8', 'replace').strip()  # its last character may be cut
    if text.count('\ufffd') > 1 or not all(c.isprintable() or c.isspace() for c in text):
        raise BadReference(f'reference {path}: neither a zip nor a numpy file (its first bytes {head[:4].hex()}), '
                           'not a reference (python -m equivalence.record writes one, an .npz)')  # fmt: skip
    raise BadReference(f'reference {path}: a text file ({text[:24]!r}...), not a reference (python -m '
                       'equivalence.record writes one, an .npz)')  # fmt: skip


MAGIC = (  # a file's first bytes, and what it is where it is not a zip
    (b'PK\x03\x04', ''),  # a zip: numpy's .npz, maybe a reference
    (b'PK\x05\x06', ''),  # an empty zip
    (b'\x93NUMPY', 'one numpy array (.npy, numpy.save)'),
    (b'\x80', 'a pickle, which this suite never loads (loading one runs its code)'),
)


def _check_manifest(path: str, manifest: Any) -> None:
    """``BadReference`` where the manifest is not this suite's, of another version, or edited since it was
    written (its own sha256, or its fields, do not hold)."""
    if not isinstance(manifest, dict) or manifest.get('format') != FORMAT:
        said = manifest.get('format') if isinstance(manifest, dict) else type(manifest).__name__
        raise BadReference(f'reference {path}: not a reference this suite wrote (format {said!r})')
    if manifest.get('version') != VERSION:
        raise BadReference(f'reference {path}: format version {manifest.get("version")}, this suite reads {VERSION}')
    own = manifest.pop('manifest_sha256', None)  # written since 2026-12: references recorded before have none
    config, fields = manifest.get('config'), (('environment', dict), ('sha256', dict), ('tree', object))
    wrong = [name for name, kind in fields if not isinstance(manifest.get(name), kind) or name not in manifest]
    edited = own is not None and own != _manifest_digest(manifest)
    missing = [name for name in FITTED if name not in config] if isinstance(config, dict) else ['config']
    if edited or missing or wrong:
        what = 'its own sha256 fails' if edited else f'no {", ".join(missing + wrong)} as written'
        raise BadReference(f'reference {path}: its manifest was edited or damaged since it was recorded ({what}): '
                           'record it again')  # fmt: skip


def _manifest_digest(manifest: dict) -> str:
    """sha256 of the manifest less its own (``manifest_sha256``), as written."""
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
