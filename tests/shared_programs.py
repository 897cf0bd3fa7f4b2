"""Compiled programs shared between the suite's tests, in memory.

Every check builds its steps anew (new closures), so JAX's own caches, keyed by the function
object, never see that two tests compile the same program: the legacy side of one workload at one
device count is the same XLA program under every strategy, and the verdict's twins repeat across
tests. Most of the suite's time is XLA compiling on the CPU (measured: 162 of 208 s of
``tests/test_equivalence.py``). Here a compile is looked up first by the key JAX's persistent
compilation cache uses (``jax._src.compilation_cache.get_cache_key``: the module's bytes, the
devices, the compile options, the backend and JAX's flags), so an identical program is compiled
once per pytest worker. Measured alone, each file 1.4x to 1.5x faster (test_equivalence 252 -> 179 s,
test_strategies 300 -> 204 s).

Why not JAX's persistent cache itself: it serialises each executable to disk, and in one of three
whole-suite runs (2026-12-02) a pytest worker died of a segmentation fault inside that
serialisation (``put_executable_and_time``), after which pytest-xdist hung; and on some CPUs its
entries are rejected on reload (jax-ml/jax#38445), so CI's machine might never hit. Nothing is
serialised here: the executable object itself is reused, as JAX's in-memory caches do.

Programs with host callbacks (the location's recordings: most of the location tests' compiling) are
shared only where every callback is known to do the same: the callback is baked into the executable
(JAX's persistent cache never shares such a program), so a reused program calls the first program's
callbacks. Each callback is read down through JAX's own wrappers (``emit_python_callback``,
``debug_callback``) to the user's callable, which must be a module-level function or a
``functools.partial`` of one with plain arguments (the suite's ``intercept._store`` and
``draws._record``, which read the recording under way from module state); its name and arguments join
the key. A lambda, a closure, a bound method or an argument printed with an address: not shared.
Programs spanning several processes are not shared. The
cache is registered with JAX's cache management, so ``jax.clear_caches()`` (the suite's own
``devices.release_compiled_programs`` among its callers) empties it, and it holds at most
``LIMIT`` programs, the least recently used going first. It changes no number: the same key is
the same program, which is the persistent cache's own contract.

JAX is pinned (pyproject.toml): ``compiler.compile_or_get_cached`` is the one function every
``jit`` and ``pmap`` compile goes through in this version.
"""

import collections
import contextlib
import functools
import types

import jax
from jax._src import compilation_cache, compiler, util

LIMIT = 256  # executables; ~100 memory maps each (devices.py), well under half the kernel's 65,530


class Programs:
    """key -> loaded executable, least recently used first; cleared by ``jax.clear_caches``."""

    def __init__(self) -> None:
        self.held: collections.OrderedDict = collections.OrderedDict()
        self.counts = collections.Counter()  # 'hit', 'miss'

    def get(self, key):
        executable = self.held.get(key)
        self.counts['miss' if executable is None else 'hit'] += 1
        if executable is not None:
            self.held.move_to_end(key)
        return executable

    def put(self, key, executable) -> None:
        self.held[key] = executable
        while len(self.held) > LIMIT:
            self.held.popitem(last=False)

    def cache_clear(self) -> None:
        self.held.clear()

    def cache_info(self) -> str:
        return f'{len(self.held)} programs, {self.counts["hit"]} hits, {self.counts["miss"]} misses'

    def cache_keys(self) -> list:
        return list(self.held)


PROGRAMS = Programs()
_compile = compiler.compile_or_get_cached
# XLA options added to every program compiled through here, as (name, value): conftest's
# ``at_level_0_in_process``, for the test files whose subject is not the float32 rounding. They are
# part of the key (JAX's cache key hashes the compile options, these among them). Set and unset with
# ``with_options``, which empties JAX's own caches at each change (keyed by the function, not by these).
OPTIONS: list[tuple[str, str]] = []


PLAIN = (str, int, float, bool, type(None))


def _plain(value) -> bool:
    if isinstance(value, tuple | list):
        return all(_plain(v) for v in value)
    if isinstance(value, dict):
        return all(_plain(k) and _plain(v) for k, v in value.items())
    return isinstance(value, PLAIN)


def _said(fn, depth: int = 0) -> str | None:
    """What a host callback does, as text: JAX's wrappers read through to the user's callable (see the
    module docstring); None where it cannot be known (then the program is not shared)."""
    if depth > 8:
        return None
    if isinstance(fn, functools.partial):
        inner = _said(fn.func, depth + 1)
        if inner is None or not _plain(fn.args) or not _plain(fn.keywords):
            return None
        return f'{inner}{fn.args!r}{sorted(fn.keywords.items())!r}'
    if not isinstance(fn, types.FunctionType):
        return None
    name = f'{fn.__module__}.{fn.__qualname__}'
    if '<locals>' not in fn.__qualname__:
        return None if fn.__closure__ else name  # a module-level function
    if not fn.__module__.startswith('jax.'):
        return None  # a user's closure or lambda: what it captured is not known
    parts = [name]
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:
            continue
        if isinstance(value, functools.partial | types.FunctionType):
            inner = _said(value, depth + 1)
            if inner is None:
                return None
            parts.append(inner)
        elif _plain(value) or type(value).__name__ == 'PyTreeDef':
            parts.append(repr(value))
        elif type(value).__module__.startswith('jax.') and ' at 0x' in repr(value):
            parts.append(type(value).__qualname__)  # an effect token, one per kind
        else:
            return None
    return '|'.join(parts)


def _key(backend, computation, devices, compile_options, host_callbacks) -> str | None:
    """JAX's persistent-cache key of the program, with what its host callbacks do, or None where it is
    not to be shared."""
    if len({d.process_index for d in devices.flat}) > 1:
        return None
    said = [_said(fn) for fn in host_callbacks]
    if any(s is None for s in said):
        return None
    try:
        key = compilation_cache.get_cache_key(computation, devices, compile_options, backend)
    except Exception:  # noqa: BLE001 -- JAX's own compile does the same: no key, no cache, compile
        return None
    return key if not said else f'{key}|' + '||'.join(said)


def compile_or_reuse(backend, computation, devices, compile_options, host_callbacks, *rest):
    if OPTIONS:
        compile_options.env_option_overrides = [*compile_options.env_option_overrides, *OPTIONS]
    key = _key(backend, computation, devices, compile_options, host_callbacks)
    executable = None if key is None else PROGRAMS.get(key)
    if executable is None:
        executable = _compile(backend, computation, devices, compile_options, host_callbacks, *rest)
        if key is not None:
            PROGRAMS.put(key, executable)
    return executable


def install() -> None:
    if compiler.compile_or_get_cached is not compile_or_reuse:
        compiler.compile_or_get_cached = compile_or_reuse
        util.register_cache(PROGRAMS, 'tests/shared_programs.py')


@contextlib.contextmanager
def with_options(options: list[tuple[str, str]]):
    """Every program compiled here under ``options``, and JAX's own caches emptied before and after (the
    programs held here kept: their key holds the options): a module-level ``jax.jit`` (an example's
    ``nnx.jit``, the suite's linen init) compiled at one level is never run where the other was asked."""
    _clear_jax_caches()
    OPTIONS[:] = options
    try:
        yield
    finally:
        OPTIONS.clear()
        _clear_jax_caches()


def _clear_jax_caches() -> None:
    held = PROGRAMS.held.copy()
    jax.clear_caches()  # this cache among them (``util.register_cache``): put back
    PROGRAMS.held.update(held)


@contextlib.contextmanager
def suspended():
    """JAX compiling as it does in a user's process: for tests of what a process holds."""
    compiler.compile_or_get_cached = _compile
    try:
        yield
    finally:
        compiler.compile_or_get_cached = compile_or_reuse
