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

What is not shared: programs with host callbacks (their callbacks are baked into the executable;
JAX's persistent cache makes the same exception) and programs spanning several processes. The
cache is registered with JAX's cache management, so ``jax.clear_caches()`` (the suite's own
``devices.release_compiled_programs`` among its callers) empties it, and it holds at most
``LIMIT`` programs, the least recently used going first. It changes no number: the same key is
the same program, which is the persistent cache's own contract.

JAX is pinned (pyproject.toml): ``compiler.compile_or_get_cached`` is the one function every
``jit`` and ``pmap`` compile goes through in this version.
"""

import collections
import contextlib

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


def _key(backend, computation, devices, compile_options, host_callbacks) -> str | None:
    """JAX's persistent-cache key of the program, or None where it is not to be shared."""
    if host_callbacks or len({d.process_index for d in devices.flat}) > 1:
        return None
    try:
        return compilation_cache.get_cache_key(computation, devices, compile_options, backend)
    except Exception:  # noqa: BLE001 -- JAX's own compile does the same: no key, no cache, compile
        return None


def compile_or_reuse(backend, computation, devices, compile_options, host_callbacks, *rest):
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
def suspended():
    """JAX compiling as it does in a user's process: for tests of what a process holds."""
    compiler.compile_or_get_cached = _compile
    try:
        yield
    finally:
        compiler.compile_or_get_cached = compile_or_reuse
