"""Reading checkpoints through the two packages, with every failure as one line.

A checkpoint is input from disk: a missing step, a damaged or truncated file, or a state of
another workload is bad input (exit 2, one ``error:`` line naming the directory, and the leaf
where one is at fault), never a traceback. Orbax's own error logs are silenced while reading,
and so is what a failed read leaves behind: Orbax reads every array at once on an event loop
that it closes as soon as one read fails, and the reads still in flight then print
``RuntimeError: Event loop is closed`` tracebacks from tensorstore's threads when they finish.
"""

import contextlib
import io
import logging
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import orbax.checkpoint as ocp

from equivalence.checkpoint import foreign
from equivalence.core.port.config import ConfigError
from legacy_pmap import checkpoints as legacy_checkpoints
from nnx_sharded import checkpoints as nnx_checkpoints

SETTLE_S = 0.5  # after a failed read, how long the reads still in flight get to finish, silenced


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read or does not fit: exit 2, one line."""


class StateMismatch(CheckpointError):
    """A checkpoint whose leaves do not fit the train state it is read into (another workload's)."""


MISMATCHES = (legacy_checkpoints.StateMismatch, nnx_checkpoints.StateMismatch)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Orbax's logs (``ERROR:absl:...`` before it raises) and stray tracebacks from its threads
    go nowhere; the error raised is what gets reported."""
    logger = logging.getLogger('absl')
    level, hook, stderr = logger.level, sys.unraisablehook, sys.stderr
    logger.setLevel(logging.CRITICAL)
    sys.unraisablehook, sys.stderr = (lambda unraisable: None), io.StringIO()
    try:
        yield
    finally:
        logger.setLevel(level)
        sys.unraisablehook, sys.stderr = hook, stderr


@contextlib.contextmanager
def reading(directory: str) -> Iterator[None]:
    """Any failure inside -> ``CheckpointError`` naming ``directory``, in one line."""
    with quiet():
        try:
            yield
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 -- a damaged file fails anywhere in orbax or tensorstore
            time.sleep(SETTLE_S)  # still silenced: the other reads finish and print into the void
            error = StateMismatch if isinstance(e, MISMATCHES) else CheckpointError
            raise error(describe(directory, e)) from None


def describe(directory: str, error: Exception) -> str:
    lines = str(error).strip().splitlines() or [type(error).__name__]
    text = lines[0] if len(lines[0]) <= 300 else lines[0][:300] + '...'
    if directory in text:
        return text
    return f'cannot read checkpoint {directory}: {type(error).__name__}: {text}'


def read_legacy(directory: str, target: Any, step: int | None = None) -> tuple[Any, Any, dict]:
    """``(state, rng, meta)`` of a legacy checkpoint, typed as ``target``, on the host: the suite's
    own layout, or a team's (``foreign``: flax's or Orbax's savers; ``rng`` is then None)."""
    with reading(directory):
        if foreign.locate(directory, step) is not None:
            return foreign.read(directory, target, step)
        return legacy_checkpoints.restore(directory, target, step)


def read_nnx(directory: str, target: dict, step: int | None = None) -> tuple[dict, Any, dict]:
    """``(state, rng, meta)`` of an NNX checkpoint, placed as ``target``'s shardings say."""
    with reading(directory):
        return nnx_checkpoints.restore(directory, target, step)


def suite_record(directory: str, step: int | None = None) -> tuple[int, set[str], dict] | None:
    """``(step, top-level names of its state, its meta)`` of a checkpoint in the suite's own layout
    (either side's: ``state``, ``rng``, ``meta``), read without a target; None for a team's layout."""
    with reading(directory):
        if not os.path.isdir(directory) or foreign.locate(directory, step) is not None:
            return None
        manager, step = legacy_checkpoints.open_step(directory, step)
        tree = manager.item_metadata(step)['state']
        meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
    return step, set(tree.keys()) if hasattr(tree, 'keys') else set(), dict(meta or {})
