"""A check judges the port's code as it stands when the check starts.

The suite keeps work across checks (a model's traced graph, its facts, linen's compiled initialisation), and
JAX keeps each function's trace, keyed by the function object: a constant that a port's module holds, read at
trace time, is baked in. A pytest ``monkeypatch`` of that constant, or an edit and ``importlib.reload``, leaves
the same port object and the same functions, so what was kept would judge the code as it was. ``starting(port)``
reads the state of the code the port reaches (its fields, and the modules of the team's that they live in and
import: their constants, functions and classes), and where it differs from what an earlier check read, lets go
of everything kept (the suite's caches, ``kept`` here, and ``jax.clear_caches()``) before the check runs.
"""

import dataclasses
import functools
import os
import sys
import sysconfig
import types
from collections.abc import Callable
from typing import Any

from equivalence.core.port import ports

_FORGET: list[Callable[[], None]] = []  # each cache's clear, registered by the module that keeps it
_READ: dict[str, tuple] = {}  # module name -> its state, as the last check read it
_SCALARS = (bool, int, float, complex, str, bytes, type(None))
_WIDTH = 256  # the elements of a container read, so that a big table costs little


def kept(forget: Callable[[], None]) -> None:
    """Register a cache kept across checks: ``forget()`` empties it when the code it was built from changes."""
    _FORGET.append(forget)


def starting(port: Any) -> bool:
    """Called as a check starts: True (and everything kept let go) where the code ``port`` reaches changed
    since a check read it in this process."""
    try:
        now = _modules_state(port)
    except Exception:  # noqa: BLE001 -- a module whose state cannot be read: nothing kept is trusted
        forget_all()
        return True
    changed = any(_READ.get(name, state) != state for name, state in now.items())
    _READ.update(now)
    if changed:
        forget_all()
    return changed


def forget_all() -> None:
    for forget in _FORGET:
        forget()
    if 'jax' in sys.modules:
        sys.modules['jax'].clear_caches()  # its traces are keyed by the function object, not by what it read


def _modules_state(port: Any) -> dict[str, tuple]:
    """Each module of the team's that the port's fields live in, or that those import, with its state."""
    found: dict[str, types.ModuleType] = {}
    pending = [_module_of(v) for v in _field_values(port)]
    while pending:
        module = pending.pop()
        if module is None or module.__name__ in found or not _teams(module):
            continue
        found[module.__name__] = module
        pending += [_module_of(v) for v in list(vars(module).values())]
    return {name: _state(vars(module)) for name, module in found.items()}


def _field_values(port: Any) -> list:
    values = ports.field_values(port) if dataclasses.is_dataclass(port) else []
    out = []
    for v in values:
        out.append(v)
        out += [c.cell_contents for c in getattr(v, '__closure__', None) or () if _filled(c)]
        if isinstance(v, functools.partial):
            out += [v.func, *v.args, *v.keywords.values()]
    return out


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 -- an empty cell raises
    except ValueError:
        return False
    return True


def _module_of(value: Any) -> types.ModuleType | None:
    if isinstance(value, types.ModuleType):
        return value
    name = getattr(value, '__module__', None) or getattr(type(value), '__module__', None)
    return sys.modules.get(name) if isinstance(name, str) else None


@functools.cache
def _libraries() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # equivalence/
    return tuple({os.path.realpath(paths[k]) + os.sep for k in ('stdlib', 'platstdlib', 'purelib', 'platlib')} | {here})


def _teams(module: types.ModuleType) -> bool:
    """A module of the team's (or a built-in workload's): not the standard library, an installed package, or
    this suite."""
    file = getattr(module, '__file__', None)
    return bool(file) and not os.path.realpath(file).startswith(_libraries())


def _state(namespace: dict) -> tuple:
    return tuple(sorted(((k, _value(v, 2)) for k, v in namespace.items() if not k.startswith('__')), key=_first))


def _first(item: tuple) -> str:
    return item[0]


class _Same:
    """An object held and compared by identity (its own ``==`` may be an array's, or fail); held, so that its
    ``id`` is not reused by the object that replaced it."""

    __slots__ = ('obj',)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


def _value(v: Any, depth: int) -> Any:
    """What a change to ``v`` (a module's attribute) changes: a scalar's value; an object's identity (a
    monkeypatched or reloaded function, class or table is another object); the scalars a container holds, a few
    levels down (a config dict whose value was set), and those a dataclass of the team's holds (a config whose field
    was set). Not the other objects a container holds, nor what other objects hold: a module's cache of programs
    or results, or its counters, fill as checks run, which is no change to the code."""
    if isinstance(v, _SCALARS):
        return (type(v).__name__, v)
    if isinstance(v, list | tuple | set | frozenset | dict):
        return (_Same(v), _scalars(v, depth))
    if dataclasses.is_dataclass(v) and not isinstance(v, type) and _teams_class(v):  # a config of the team's
        return (_Same(v), _scalars(vars(v), depth))
    return _Same(v)


def _scalars(v: Any, depth: int) -> tuple:
    """The scalars in the container ``v`` (its first ``_WIDTH`` elements), and in those it holds ``depth`` deep."""
    if isinstance(v, dict):
        items = [(repr(k), x) for k, x in list(v.items())[:_WIDTH]]
    else:
        items = list(enumerate(sorted(v, key=repr) if isinstance(v, set | frozenset) else list(v)[:_WIDTH]))
    out = []
    for k, x in items:
        if isinstance(x, _SCALARS):
            out.append((k, type(x).__name__, x))
        elif depth and isinstance(x, list | tuple | set | frozenset | dict):
            out.append((k, _scalars(x, depth - 1)))
    return tuple(out)


def _teams_class(v: Any) -> bool:
    module = sys.modules.get(getattr(type(v), '__module__', ''), None)
    return module is not None and _teams(module)
