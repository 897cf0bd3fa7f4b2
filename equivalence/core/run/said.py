"""The stage lines a check says (``clock.Lines``), as typed records: what reads a command's stderr back.

Each line ``Lines`` writes whole is a ``Said`` (its stage, how the stage stood, the line), appended as
one JSON record to the file ``EQUIVALENCE_STAGE_EVENTS`` names, where one is named (the tests name one
for every process they start, and for their own): what tells a stage's line from a command's message is
this record, not the line's wording.
"""

import contextlib
import dataclasses
import json
import os

EVENTS_ENV = 'EQUIVALENCE_STAGE_EVENTS'  # a file: every line said, one JSON record each


@dataclasses.dataclass(frozen=True)
class Said:
    """One line ``Lines`` wrote whole: its stage's name and depth, ``begun``, ``done`` or ``failed``, the line."""

    stage: str
    depth: int
    state: str
    line: str


def told(said: Said) -> None:
    """``said`` appended to the file of records ``EQUIVALENCE_STAGE_EVENTS`` names, if any."""
    path = os.environ.get(EVENTS_ENV)
    if path:
        with contextlib.suppress(OSError), open(path, 'a') as f:
            f.write(json.dumps(dataclasses.asdict(said)) + '\n')


def read(path: str) -> list[Said]:
    """The records in ``path``, in order; a line cut short (a process killed while writing it) left out."""
    try:
        with open(path, errors='replace') as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError, TypeError):
            out.append(Said(**json.loads(line)))
    return out
