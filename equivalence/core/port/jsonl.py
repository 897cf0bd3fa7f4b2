"""One JSON record a line, in a file that several writers append to and one reader reads back: what a worker
hands its launcher (``distributed.records``), the stage lines a check says (``run.said``)."""

import contextlib
import json


def append(path: str, record: dict) -> None:
    """``record`` appended as one line; a file that cannot be written is left as it is."""
    with contextlib.suppress(OSError), open(path, 'a') as f:
        f.write(json.dumps(record) + '\n')
        f.flush()


def read(path: str) -> list[dict]:
    """The records in ``path``, in order; a line cut short (its writer killed while writing it) is left out."""
    try:
        with open(path, errors='replace') as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out
