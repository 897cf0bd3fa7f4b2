"""A sha256 per leaf, written by ``migrate`` beside the NNX checkpoint, and read back by ``verify``
and ``--resume-at``: Orbax 0.12.8 keeps no checksum of array bytes, so a flipped byte in an array
file reads back as a wrong value with no error (FACTS.md). The manifest closes that gap.

It lives inside the step's directory (``NNX_DIR/<step>/equivalence-manifest.json``), so it
travels with the checkpoint it describes, and holds three maps: ``nnx`` (path -> hash of the
value written), ``legacy`` (path in the legacy train state -> hash of the value read) and
``pairs`` (NNX path -> the legacy leaf it came from, by group: ``params/Dense_0/kernel``);
and ``files`` (every file of the NNX step's directory but the manifest -> the sha256 of its
bytes), so that bytes no leaf reads are checked too. A leaf's hash covers dtype, shape and bytes.
"""

import hashlib
import json
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from equivalence.checkpoint.store import CheckpointError, reading
from legacy_pmap import checkpoints as legacy_checkpoints

NAME = 'equivalence-manifest.json'
FORMAT = 1


def digest(value: Any) -> str:
    array = np.ascontiguousarray(np.asarray(value))
    h = hashlib.sha256(f'{array.dtype.str}{list(array.shape)}'.encode())
    h.update(array.tobytes())
    return h.hexdigest()


def hashes(tree: Any) -> dict[str, str]:
    """``{'a/b/c': sha256}`` of every leaf of a tree of host arrays."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {legacy_checkpoints.path_str(path): digest(leaf) for path, leaf in leaves}


def path(nnx_dir: str, step: int) -> str:
    return os.path.join(nnx_dir, str(step), NAME)


def file_hashes(step_dir: str) -> dict[str, str]:
    """``{'state/ocdbt.process_0/d/2cbd...': sha256}`` of every file of a step's directory but the
    manifest: the bytes no leaf reads too (OCDBT's per-process copies, metadata, the key and the record)."""
    found = {}
    for folder, dirs, files in os.walk(step_dir):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(folder, name)
            relative = os.path.relpath(full, step_dir).replace(os.sep, '/')
            if relative in (NAME, NAME + '.tmp'):
                continue
            h = hashlib.sha256()
            with open(full, 'rb') as f:
                for chunk in iter(lambda: f.read(1 << 20), b''):
                    h.update(chunk)
            found[relative] = h.hexdigest()
    return found


def compare_files(nnx_dir: str, step: int, expected: dict[str, str]) -> None:
    """Every file of the step's directory against the sha256 migrate recorded; the first that differs,
    is missing or is new is named."""
    compare(nnx_dir, step, expected, file_hashes(os.path.join(nnx_dir, str(step))), 'file', ' (added after migrate)')


def write(nnx_dir: str, step: int, legacy_dir: str, nnx_state: Any, legacy_state: Any, pairs: dict[str, str]) -> str:
    """The manifest of one migrated step, written atomically (a torn manifest never reads as one)."""
    record = {
        'format': FORMAT,
        'step': step,
        'legacy_dir': os.path.relpath(os.path.abspath(legacy_dir), os.path.abspath(nnx_dir)),  # moves with the pair
        'legacy_dir_absolute': os.path.abspath(legacy_dir),
        'nnx': hashes(nnx_state),
        'legacy': hashes(legacy_state),
        'pairs': pairs,
        'files': file_hashes(os.path.join(nnx_dir, str(step))),  # every byte of the step, read by a leaf or not
    }
    target = path(nnx_dir, step)
    with open(target + '.tmp', 'w') as f:
        json.dump(record, f, indent=1, sort_keys=True)
    os.replace(target + '.tmp', target)
    return target


def read(nnx_dir: str, step: int) -> dict | None:
    """The manifest of ``step``, or None when the checkpoint has none (not written by migrate)."""
    try:
        with open(path(nnx_dir, step)) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CheckpointError(f'{path(nnx_dir, step)}: the manifest cannot be read ({e})') from None
    if not isinstance(record, dict) or record.get('format') != FORMAT or not isinstance(record.get('nnx'), dict):
        raise CheckpointError(f'{path(nnx_dir, step)}: not a manifest of this suite (format {FORMAT})')
    return record


def raw_state(directory: str, step: int) -> Any:
    """The ``state`` item of a checkpoint as saved, host arrays, no target: what is on disk."""
    with reading(directory):
        manager, step = legacy_checkpoints.open_step(directory, step)
        return manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))['state']


def compare(
    directory: str, step: int, expected: dict[str, str], found: dict[str, str], what: str, new: str = ''
) -> None:
    """Every leaf (or file: ``what``) the manifest lists must read back with its hash; the first that does
    not is named, and the first one the manifest does not list (``new``: what that means)."""
    noun = what if what == 'file' else f'{what} leaf'
    for leaf, want in expected.items():
        if leaf not in found:
            raise CheckpointError(f'{directory} step {step}: {noun} {leaf} is missing (the manifest lists it)')
        if found[leaf] != want:
            raise CheckpointError(
                f'{directory} step {step}: {noun} {leaf} does not match its manifest (sha256 '
                f'{found[leaf][:12]}... != {want[:12]}...): its bytes changed after migrate wrote it'
            )
    extra = sorted(set(found) - set(expected))
    if extra:
        raise CheckpointError(f'{directory} step {step}: {noun} {extra[0]} is not in the manifest{new}')


def latest(nnx_dir: str) -> int:
    with reading(nnx_dir):
        return legacy_checkpoints.open_step(nnx_dir)[1]


def recorded_legacy(nnx_dir: str, record: dict) -> tuple[str | None, str]:
    """``(directory, as recorded)``: the legacy source the manifest names, relative to ``nnx_dir`` (so a
    pair moved together still finds it), else by the absolute path it had; None when neither exists."""
    relative, absolute = record.get('legacy_dir'), record.get('legacy_dir_absolute')
    candidates = [os.path.normpath(os.path.join(nnx_dir, p)) for p in (relative, absolute) if p]
    return next((c for c in candidates if os.path.isdir(c)), None), relative or absolute or '?'


def verify(
    nnx_dir: str,
    legacy_dir: str | None = None,
    step: int | None = None,
    required: bool = True,
    find_legacy: bool = False,
    files: bool = True,
) -> list[str]:
    """Check a migrated checkpoint against its manifest: every file of the NNX step's directory (``files``)
    and every leaf it restores, then every leaf of the legacy one it came from (``legacy_dir``, or with
    ``find_legacy`` the one the manifest records); ``CheckpointError`` (exit 2) naming the first file or
    leaf that differs. Lines for the report."""
    step = latest(nnx_dir) if step is None else step
    record = read(nnx_dir, step)
    if record is None:
        if required:
            raise CheckpointError(f'{nnx_dir} step {step} has no {NAME}: only checkpoints written by migrate carry one')
        return []
    lines = []
    if files and 'files' in record:
        compare_files(nnx_dir, step, record['files'])
        lines.append(f'{nnx_dir} step {step}: {len(record["files"])} files match their sha256')
    elif files:
        lines.append(f'{nnx_dir} step {step}: no sha256 per file (a manifest of an older migrate): leaves only')
    compare(nnx_dir, step, record['nnx'], hashes(raw_state(nnx_dir, step)), 'NNX')
    lines.append(f'{nnx_dir} step {step}: {len(record["nnx"])} leaves match their sha256')
    if legacy_dir is None and find_legacy:
        legacy_dir, recorded = recorded_legacy(nnx_dir, record)
        if legacy_dir is None:
            lines.append(
                f'legacy source {recorded} (as the manifest records it) not found: not checked; pass LEGACY_DIR'
            )
    if legacy_dir is not None:
        compare(legacy_dir, step, record['legacy'], hashes(raw_state(legacy_dir, step)), 'legacy')
        lines.append(f'{legacy_dir} step {step}: {len(record["legacy"])} leaves match their sha256')
    return lines
