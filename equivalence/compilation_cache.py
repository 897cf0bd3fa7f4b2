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

The cache changes no number: a hit is the program JAX would compile (its key is the module's bytes,
the devices, the compile options, the backend and JAX's flags). The suite's own tests turn it off
(``tests/conftest.py``), but for the one that measures it.
"""

import os
import sys

ENV = 'EQUIVALENCE_COMPILATION_CACHE'
FLAG = '--no-compilation-cache'
OFF = ('0', 'off', 'false', 'no')


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
    _ask_etils_about_tensorflow()
    directory = wanted(argv)
    if directory is None:
        return None
    if 'jax' not in sys.modules:  # read by JAX as it starts
        os.environ.setdefault('JAX_COMPILATION_CACHE_DIR', directory)
        os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
        return os.environ['JAX_COMPILATION_CACHE_DIR']
    import jax

    if jax.config.jax_compilation_cache_dir is None:
        jax.config.update('jax_compilation_cache_dir', directory)
        if 'JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS' not in os.environ:
            jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
    return jax.config.jax_compilation_cache_dir


def _ask_etils_about_tensorflow() -> None:
    """etils' ``_is_tf_installed`` answered now, while no stub stands in ``sys.modules`` (see above)."""
    if 'tensorflow' in sys.modules and getattr(sys.modules['tensorflow'], '__spec__', None) is None:
        return  # a stub is here already: asking now would raise; JAX then warns once per read, as before
    try:
        from etils.epath import gpath

        gpath._is_tf_installed()  # functools.cache: the answer is kept for the process
    except Exception:  # noqa: BLE001 -- another etils: nothing to warm
        pass
