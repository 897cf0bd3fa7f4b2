"""Reading checkpoints through the two packages, with every failure as one line.

A checkpoint is input from disk: a missing step, a damaged or truncated file, or a state of
another workload is bad input (exit 2, one ``error:`` line naming the directory, and the leaf
where one is at fault), never a traceback. Orbax's own error logs and the asyncio noise a
failed read leaves behind are silenced while reading.
"""

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any

from equivalence.core.config import ConfigError
from legacy_pmap import checkpoints as legacy_checkpoints
from nnx_sharded import checkpoints as nnx_checkpoints


class CheckpointError(ConfigError):
    """A checkpoint that cannot be read or does not fit: exit 2, one line."""


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Orbax logs its read errors (``ERROR:absl:...``) before raising; the raised error is reported instead."""
    logger = logging.getLogger('absl')
    level, hook = logger.level, sys.unraisablehook
    logger.setLevel(logging.CRITICAL)
    sys.unraisablehook = lambda unraisable: None  # tensorstore reads cancelled by the error, collected later
    try:
        yield
    finally:
        logger.setLevel(level)
        sys.unraisablehook = hook


@contextlib.contextmanager
def reading(directory: str) -> Iterator[None]:
    """Any failure inside -> ``CheckpointError`` naming ``directory``, in one line."""
    try:
        with quiet():
            yield
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 -- a damaged file fails anywhere in orbax or tensorstore
        raise CheckpointError(describe(directory, e)) from None


def describe(directory: str, error: Exception) -> str:
    lines = str(error).strip().splitlines() or [type(error).__name__]
    text = lines[0] if len(lines[0]) <= 300 else lines[0][:300] + '...'
    if directory in text:
        return text
    return f'cannot read checkpoint {directory}: {type(error).__name__}: {text}'


def read_legacy(directory: str, target: Any, step: int | None = None) -> tuple[Any, Any, dict]:
    """``(state, rng, meta)`` of a legacy checkpoint, typed as ``target``, on the host."""
    with reading(directory):
        return legacy_checkpoints.restore(directory, target, step)


def read_nnx(directory: str, target: dict, step: int | None = None) -> tuple[dict, Any, dict]:
    """``(state, rng, meta)`` of an NNX checkpoint, placed as ``target``'s shardings say."""
    with reading(directory):
        return nnx_checkpoints.restore(directory, target, step)
