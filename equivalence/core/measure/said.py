"""The stage lines a check says (``clock.Lines``), as typed records: what reads a command's stderr back.

Each line ``Lines`` writes whole is a ``Said`` (its stage, how the stage stood, the line), appended as
one JSON record to the file ``EQUIVALENCE_STAGE_EVENTS`` names, where one is named (the tests name one
for every process they start, and for their own): what tells a stage's line from a command's message is
this record, not the line's wording.
"""

import contextlib
import dataclasses
import os

from equivalence.core.port import jsonl

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
        jsonl.append(path, dataclasses.asdict(said))


def read(path: str) -> list[Said]:
    """The records in ``path``, in order; a line cut short (a process killed while writing it) left out."""
    out = []
    for record in jsonl.read(path):
        with contextlib.suppress(TypeError):
            out.append(Said(**record))
    return out
