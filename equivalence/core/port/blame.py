"""Whose mistake an exception is: the user's port (exit 2, one line naming the field and the frame)
or this suite (exit 3, a bug to fix).

An exception's traceback is read from the innermost frame outwards, skipping the libraries
(JAX, Flax, optax, NumPy, Orbax, the standard library): the first frame left is where the
mistake was made. In the suite's own packages it is the suite's bug. Outside them, and when
the traceback passes through one of the port's callables (``legacy_step``, ``new_call``,
``make_data``, ...; the outermost such frame names the field), it is the port's.
"""

import dataclasses
import functools
import inspect
import os
import sysconfig
import threading
import traceback
from typing import Any

LIBRARIES = frozenset(
    {
        'jax',
        'jaxlib',
        'flax',
        'optax',
        'numpy',
        'orbax',
        'chex',
        'tensorstore',
        'ml_dtypes',
        'absl',
        'etils',
        'treescope',
        'scipy',
        'typing_extensions',
        'pytest',
        '_pytest',
        'pluggy',
        'hypothesis',
    }
)
SUITE = frozenset({'equivalence', 'legacy_pmap', 'nnx_sharded'})
_STDLIB = os.path.realpath(sysconfig.get_paths()['stdlib'])
_current = threading.local()


@dataclasses.dataclass(frozen=True)
class Frame:
    module: str
    file: str
    line: int
    function: str

    @property
    def where(self) -> str:
        return f'{os.path.basename(self.file)}:{self.line} in {self.function}'


def set_port(port: Any) -> None:
    """The port now being checked or run: its callables name the field an exception came through."""
    _current.port = port


def current_port() -> Any:
    return getattr(_current, 'port', None)


def frames(error: BaseException) -> list[tuple[Frame, Any]]:
    """Every frame of the traceback, outermost first, with its code object."""
    out, tb = [], error.__traceback__
    while tb is not None:
        f = tb.tb_frame
        out.append(
            (Frame(f.f_globals.get('__name__', ''), f.f_code.co_filename, tb.tb_lineno, f.f_code.co_name), f.f_code)
        )
        tb = tb.tb_next
    return out


def kind(frame: Frame) -> str:
    """'library', 'suite' or 'user'."""
    top = frame.module.split('.', 1)[0]
    if top in SUITE:
        return 'suite'
    path = os.path.realpath(frame.file)
    in_stdlib = path.startswith(_STDLIB) and 'site-packages' not in path and 'dist-packages' not in path
    if top in LIBRARIES or in_stdlib or frame.file.startswith('<frozen') or top == 'importlib':
        return 'library'
    return 'user'


def innermost(error: BaseException) -> tuple[str, Frame | None]:
    """``(kind, frame)`` of the innermost frame outside the libraries; ``('library', None)`` if none."""
    for frame, _ in reversed(frames(error)):
        k = kind(frame)
        if k != 'library':
            return k, frame
    return 'library', None


def innermost_user(error: BaseException) -> Frame | None:
    """The innermost frame in the user's code, wherever the exception then passed through."""
    return next((f for f, _ in reversed(frames(error)) if kind(f) == 'user'), None)


def named_in_innermost_user(error: BaseException) -> dict[str, Any]:
    """The values the innermost user frame names (its locals, free variables and the globals its code
    reads), by name, and the attributes its code reads off them, by dotted name (``old_train.p_train_step``,
    two levels deep; read statically, no property run): what it was calling when it raised."""
    tb, found = error.__traceback__, None
    while tb is not None:
        f = tb.tb_frame
        if kind(Frame(f.f_globals.get('__name__', ''), f.f_code.co_filename, tb.tb_lineno, f.f_code.co_name)) == 'user':
            found = f
        tb = tb.tb_next
    if found is None:
        return {}
    code, local = found.f_code, found.f_locals
    names = (*code.co_names, *code.co_freevars, *code.co_varnames)
    named = {n: local[n] if n in local else found.f_globals[n] for n in names if n in local or n in found.f_globals}
    level = named
    for _ in range(2):  # the attributes its code reads off them, then theirs
        level = {f'{name}.{attr}': held for name, value in level.items() for attr in code.co_names
                 if (held := inspect.getattr_static(value, attr, _MISSING)) is not _MISSING}  # fmt: skip
        named = {**named, **level}
    return named


_MISSING = object()


def _codes(fn: Any) -> list[Any]:
    """The code objects that run when the suite calls ``fn`` (a function, a partial, a jit, a class, a
    pmap of any of them, score_sde's ``pmap(partial(lax.scan, step))``)."""
    seen = []
    for candidate in (
        fn,
        getattr(fn, 'func', None),
        getattr(fn, '__init__', None),
        vars(type(fn)).get('__call__'),
    ):
        if candidate is None:
            continue
        try:
            candidate = inspect.unwrap(candidate)
        except ValueError:
            continue
        code = getattr(candidate, '__code__', None)
        if code is not None:
            seen.append(code)
        elif isinstance(candidate, functools.partial):  # a pmap's: what it binds, the libraries' own code left out
            seen += [c for f in (candidate.func, *candidate.args) if _own(f) for c in _codes(f)]
    return seen


def _own(fn: Any) -> bool:
    """A callable of the user's code, not of a library (``jax.lax.scan`` in score_sde's partial)."""
    return callable(fn) and str(getattr(fn, '__module__', '')).split('.')[0] not in LIBRARIES


def port_field(error: BaseException, port: Any) -> str | None:
    """The port field the exception came through: the outermost frame running one of its callables."""
    if port is None:
        return None
    by_code = {}
    for field in dataclasses.fields(port):
        value = getattr(port, field.name)
        if callable(value):
            for code in _codes(value):
                by_code.setdefault(code, field.name)
    return next((by_code[c] for _, c in frames(error) if c in by_code), None)


def first_line(error: BaseException, width: int = 480) -> str:
    """``Type: message`` on one line: every line of the message joined, and when longer than ``width``
    its head and its tail, where JAX names the culprit (``... for arg type: uint32[2,2]``)."""
    text = one_line(str(error), width)
    return f'{type(error).__name__}: {text}' if text else type(error).__name__


def one_line(text: str, width: int = 480) -> str:
    """``text``'s lines joined into one; the middle left out (`` ... ``) when it is longer than ``width``."""
    text = ' '.join(line.strip() for line in text.strip().splitlines() if line.strip())
    if len(text) <= width:
        return text
    tail = width // 3
    return f'{text[: width - tail].rstrip()} ... {text[-tail:].lstrip()}'


def elided(error: BaseException, width: int = 480) -> bool:
    """Whether ``first_line`` left part of the message out."""
    return one_line(str(error), width) != one_line(str(error), len(str(error)) + 1)


def whole_text(error: BaseException) -> str:
    """The exception's whole message and traceback, for the file a shortened line names."""
    return ''.join(traceback.format_exception(error))


def runtime_line(error: BaseException) -> str | None:
    """One line blaming the port for an exception raised in its code while the suite ran it: the
    innermost non-library frame is outside the suite and the traceback passes through one of the
    port's callables. None otherwise (a bug here: exit 3)."""
    who, frame = innermost(error)
    port = current_port()
    field = port_field(error, port) if who == 'user' else None
    if field is None:
        return None
    return f'port {port.name!r}: {field} raised {first_line(error)} ({frame.where}); this is in the port, not the suite'
