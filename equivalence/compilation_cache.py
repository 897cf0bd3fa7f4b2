"""JAX's persistent compilation cache, on by default in the commands and the pytest plugin, so that a
second check of the same port reads its programs from disk instead of compiling them again.

Where: ``JAX_COMPILATION_CACHE_DIR`` (or ``jax.config``'s ``jax_compilation_cache_dir``) when the user
has set it, else ``$EQUIVALENCE_COMPILATION_CACHE`` when it names a directory, else
``$XDG_CACHE_HOME/equivalence/jax`` (``~/.cache/equivalence/jax``). Off: ``--no-compilation-cache``
on any command, or ``EQUIVALENCE_COMPILATION_CACHE=0`` (``off``, ``false``, ``no``). A program is cached
whatever its compile time (``jax_persistent_cache_min_compile_time_secs`` 0, unless the user set it):
a check's compile time is mostly many programs of under a second each.

A port that stubs a heavy import (``sys.modules['tensorflow'] = types.ModuleType(...)``, as ports of
score_sde do) made every cache read fail (``ValueError: tensorflow.__spec__ is None``: JAX reaches the
cache through ``etils.epath``, which asks ``importlib.util.find_spec('tensorflow')``). That answer is
cached by etils; it is asked here, before any port is imported, so the stub is never looked at.

JAX writes no program that holds a host callback (``jax.debug.callback``: the recordings through which
a check's verdict reads each module's values and each random draw), so a second check compiled every
one of them again (measured: 76 of 146 s of compiling, score_sde at D = 2). In this JAX a callback on
the CPU is a call to "the callback numbered i" (``emit_python_callback``'s FFI target and its
``index``), the Python functions themselves given to XLA when the program is loaded: the compiled
program holds no pointer to them. ``keep_programs_with_callbacks`` therefore writes such a program under
JAX's own key with ``CALLBACKS`` appended, and loads it again with the callbacks of the program being
compiled now, which are the ones a fresh compile would be given. Only on the CPU, where it was tried
(the GPU's lowering is the same FFI call, untried here; the TPU's is another); a program whose devices
span several processes, or a read or write that fails: compiled as JAX would. JAX's own cache options
that govern errors and logging (``jax_raise_persistent_cache_errors``, ``jax_explain_cache_misses``) are
not followed for these programs: a failed read or write is silent, and the program compiled.

The cache changes no number: a hit is the program JAX would compile (its key is the module's bytes,
the devices, the compile options, the backend and JAX's flags). The suite's own tests turn it off
(``tests/conftest.py``), but for the one that measures it.
"""

import os
import sys
import time

from equivalence import compat

ENV = 'EQUIVALENCE_COMPILATION_CACHE'
FLAG = '--no-compilation-cache'
OFF = ('0', 'off', 'false', 'no')
CALLBACKS = '-host-callbacks'  # appended to JAX's key: an entry JAX itself never writes nor reads
_WANTED = False  # use() turned the cache on in this process


def default_directory() -> str:
    base = os.environ.get('XDG_CACHE_HOME') or os.path.join(os.path.expanduser('~'), '.cache')
    return os.path.join(base, 'equivalence', 'jax')


def wanted(argv: list[str] | None = None) -> str | None:
    """The directory the cache goes in, or None where it is off (``FLAG`` in ``argv``, or ``ENV``)."""
    args = sys.argv[1:] if argv is None else argv
    setting = os.environ.get(ENV, '').strip()
    if FLAG in args or setting.lower() in OFF:
        return None
    return os.environ.get('JAX_COMPILATION_CACHE_DIR') or setting or default_directory()


def use(argv: list[str] | None = None) -> str | None:
    """Turn the cache on where it is wanted (``wanted``); returns its directory, or None (off). Before the
    port is imported, so that a stubbed import cannot break its reads."""
    global _WANTED
    _ask_etils_about_tensorflow()
    directory = wanted(argv)
    if directory is None:
        return None
    _WANTED = True
    if 'jax' not in sys.modules:  # read by JAX as it starts
        os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', directory)
        os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
        return os.environ['JAX_COMPILATION_CACHE_DIR']
    import jax

    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update('jax_compilation_cache_dir', directory)
        if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in os.environ:
            jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
    keep_programs_with_callbacks()
    return jax.config.jax_compilation_cache_dir


def keep_programs_with_callbacks() -> None:
    """Programs with host callbacks written to and read from the cache too (see above), once ``use``
    has turned it on; called again where JAX was imported after ``use`` (``cli.main`` before the work,
    ``testing.assert_port_matches`` before the check). Idempotent."""
    if not _WANTED or compat.version() < (0, 5):  # jax 0.4 (the recorder's): its compile takes other arguments
        return
    from jax._src import compiler

    if getattr(compiler.compile_or_get_cached, '_keeps_callbacks', False):
        return
    compiler.compile_or_get_cached = _keeping(compiler.compile_or_get_cached)


def _keeping(compile_or_get_cached):
    from jax._src import compilation_cache, compiler, config, distributed, monitoring

    def compile_or_read(backend, computation, devices, compile_options, host_callbacks, executable_devices, *rest):
        key = None
        if (
            host_callbacks
            and backend.platform == 'cpu'
            and compilation_cache.is_cache_used(backend)
            and not any(r is not None for r in rest)  # PGLE's profiler: JAX's own path
        ):
            if len({d.process_index for d in devices.flat}) == 1:
                try:
                    key = compilation_cache.get_cache_key(computation, devices, compile_options, backend) + CALLBACKS
                except Exception:  # noqa: BLE001 -- JAX's own compile does the same: no key, no cache
                    key = None
        if key is None:
            return compile_or_get_cached(
                backend, computation, devices, compile_options, host_callbacks, executable_devices, *rest
            )
        try:
            entry = compilation_cache._get_cache(backend).get(key)
            if entry is not None:
                serialized, _ = compilation_cache.extract_executable_and_time(
                    compilation_cache.decompress_executable(entry)
                )
                executable = backend.deserialize_executable(
                    serialized, executable_devices, compile_options, host_callbacks=host_callbacks
                )
                monitoring.record_event('/jax/compilation_cache/cache_hits')
                return executable
        except Exception:  # noqa: BLE001 -- an entry that does not load is compiled again, as JAX does
            pass
        started = time.monotonic()
        executable = compiler.backend_compile_and_load(
            backend, computation, executable_devices, compile_options, host_callbacks
        )
        took = time.monotonic() - started
        try:
            if distributed.global_state.process_id != 0 or took < config.persistent_cache_min_compile_time_secs.value:
                return executable  # JAX's own rules: one process writes, and not a program quicker than asked
            module = str(computation.operation.attributes['sym_name']).strip('"')
            compilation_cache.put_executable_and_time(key, module, executable, backend, int(took))
        except Exception:  # noqa: BLE001 -- not kept: the next check compiles it again
            pass
        return executable

    compile_or_read._keeps_callbacks = True
    return compile_or_read


def _ask_etils_about_tensorflow() -> None:
    """etils' ``_is_tf_installed`` answered now, while no stub stands in ``sys.modules`` (see above)."""
    if 'tensorflow' in sys.modules and getattr(sys.modules['tensorflow'], '__spec__', None) is None:
        return  # a stub is here already: asking now would raise; JAX then warns once per read, as before
    try:
        from etils.epath import gpath

        gpath._is_tf_installed()  # functools.cache: the answer is kept for the process
    except Exception:  # noqa: BLE001 -- another etils: nothing to warm
        pass
