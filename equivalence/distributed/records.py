"""What a worker hands its launcher: one JSON record per event, in a file of its own, not English to read back.

The launcher names a file in each worker's environment (``EQUIVALENCE_WORKER_RECORDS``); the worker
takes the name as this module is imported and removes it from its environment, so that the processes
it starts in turn (a fresh twin) write none. A worker started any other way (a cluster's) writes none.

An ``error`` record holds the one line the worker printed (``line``, whole: the command's own one
line, a port's mistake with its fix) and what happened, without the line's prefixes (``detail``).
"""

import os

from equivalence.core.port import jsonl

ENV = 'EQUIVALENCE_WORKER_RECORDS'
PATH = os.environ.pop(ENV, None)  # this process's file; its children's environment is without it


def error(detail: str, where: str = '', internal: bool = False) -> str:
    """The one ``error:`` line saying ``detail`` (in ``where``: ``process 0 of 2``; an ``internal`` error),
    recorded for the launcher; returned for the caller to print."""
    line = 'error: ' + (f'{where}: ' if where else '') + ('internal error: ' if internal else '') + detail
    write({'event': 'error', 'line': line, 'detail': detail})
    return line


def write(record: dict) -> None:
    """One record appended to this process's file, if the launcher gave it one."""
    if PATH is not None:
        jsonl.append(PATH, record)


def read(path: str) -> list[dict]:
    """A worker's records, in order; a line cut short (the worker killed while writing it) is left out."""
    return jsonl.read(path)


def last_error(path: str) -> dict | None:
    """The last ``error`` record in a worker's file: ``{'line', 'detail'}``, or None."""
    return next((r for r in reversed(read(path)) if r.get('event') == 'error'), None)
