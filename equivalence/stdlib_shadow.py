"""A user's file named like a module of Python's standard library (``random.py`` beside the port).

Such a file and the standard library's module cannot both be imported under one name. Where the
standard library's is imported already, ``--workload random:MODEL`` finds it and not the port
(``loading.load`` says so). Where the user's folder comes first on ``sys.path`` (``python -m`` puts the
current directory there), the file *shadows* the standard library's: the first library that
imports ``random`` (``tempfile``, before any command starts) gets the user's file and fails with a
traceback and exit 1, which reads as MISMATCH. ``guard`` catches that import instead: one
``error:`` line and exit 2. Imports nothing but ``os`` and ``sys``: it runs before everything.
"""

import _imp
import os
import sys

_STDLIB = os.path.dirname(os.__file__)


def user_file(name: str) -> str | None:
    """The file a top-level ``import name`` would find before the standard library's module, if any:
    ``name.py`` or ``name/__init__.py`` in a ``sys.path`` entry ahead of the standard library."""
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        if folder == _STDLIB or entry.endswith('.zip'):  # the standard library itself: nothing ahead of it
            return None
        for candidate in (os.path.join(folder, f'{name}.py'), os.path.join(folder, name, '__init__.py')):
            if os.path.isfile(candidate):
                return candidate
    return None


def rename(name: str, attr: str = 'NAME') -> str:
    return f'rename the file, e.g. {name}_port.py, and pass --workload {name}_port:{attr}'


class _Guard:
    """A ``sys.meta_path`` finder that finds nothing: it looks ahead of the path finder, and a standard
    library module about to come from a user's file ends the command with one line, exit 2."""

    def find_spec(self, fullname, path=None, target=None):
        builtin = fullname in sys.builtin_module_names or _imp.is_frozen(fullname)  # no file can shadow those
        if path is None and fullname in sys.stdlib_module_names and not builtin:
            found = user_file(fullname)
            if found is not None:
                print(
                    f"error: {found} shadows the standard library's {fullname}: Python imports it wherever a "
                    f'library imports {fullname} (here: before the command could start); {rename(fullname)}',
                    file=sys.stderr,
                )
                raise SystemExit(2)
        return None


def guard() -> None:
    """Installed by ``equivalence/__init__.py`` when a command starts (``python -m equivalence...``)."""
    if not any(isinstance(finder, _Guard) for finder in sys.meta_path):
        sys.meta_path.insert(0, _Guard())
