"""A port named on the command line (``--workload package.module:NAME``) loaded, with one line for
each way a name goes wrong: a path, a file name, a standard-library module's name, a module that
fails to import, a port built with a wrong field (which one, and whether it is the one asked for),
a class or a factory where the port belongs. ``loaded_as`` remembers the name a port was loaded by,
so that a fresh process loads it the same way.
"""

import ast
import contextlib
import importlib
import logging
import os
import sys
import weakref

from equivalence.core.port import blame
from equivalence.core.port.config import ConfigError
from equivalence.core.port.ports import Port


@contextlib.contextmanager
def _absl_warnings_off():
    """A port's module may import libraries that warn on import through absl (flax's
    ``checkpoints`` module: 'Tensorflow library not found'): not the user's problem, and not a
    line of the command's output."""
    logger = logging.getLogger('absl')
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _kind(cls: type) -> str:
    """' (an nnx.Module)', ' (a linen Module)' or '' for a class that a port's name names."""
    bases = {(c.__module__, c.__name__) for c in cls.__mro__}
    if ('flax.nnx.module', 'Module') in bases:
        return ' (an nnx.Module)'
    if ('flax.linen.module', 'Module') in bases:
        return ' (a linen Module)'
    return ''


def _users(spec: str, what: str, error: Exception) -> ConfigError:
    """The user's module or factory raised: one line naming it and the user's frame (exit 2)."""
    frame = blame.innermost_user(error)
    line = f'--workload {spec!r}: {what} raised {blame.first_line(error)}' + (f' at {frame.where}' if frame else '')
    out = ConfigError(line)
    out.whole = blame.whole_text(error) if blame.elided(error) else ''
    return out


_LOADED: dict[int, tuple[weakref.ref, str]] = {}  # id(port) -> (the port, the spec it was loaded by)


def loaded_as(port: Port) -> str:
    """The ``package.module:NAME`` that ``load`` built ``port`` from ('' for one it did not): what a
    fresh process loads it by, a factory's name included."""
    held = _LOADED.get(id(port))
    return held[1] if held is not None and held[0]() is port else ''


_STDLIB = os.path.dirname(os.__file__)


def _user_file(name: str) -> str | None:
    """The file a top-level ``import name`` finds ahead of the standard library's module, if any
    (``equivalence.stdlib_shadow.user_file``, which the library may not import: it is the commands')."""
    for entry in sys.path:
        folder = os.path.abspath(entry or os.curdir)
        if folder == _STDLIB or entry.endswith('.zip'):
            return None
        for candidate in (os.path.join(folder, f'{name}.py'), os.path.join(folder, name, '__init__.py')):
            if os.path.isfile(candidate):
                return candidate
    return None


def _rename(name: str, attr: str) -> str:
    return f'rename the file, e.g. {name}_port.py, and pass --workload {name}_port:{attr}'


def _check_module_name(spec: str, module_name: str, attr: str) -> None:
    """A module named as users name files: a path, a file name, or a standard-library module's name."""
    if any(sep and sep in module_name for sep in ('/', '\\', os.sep, os.altsep)):
        folder, file = os.path.split(module_name.replace('\\', '/'))
        module = file.removesuffix('.py')
        where = f'its folder ({folder})' if folder not in ('', '.') else 'its folder'
        raise ConfigError(
            f'--workload {spec!r} names a path: name the module, --workload {module}:{attr}, and run from {where} '
            'or put that folder on PYTHONPATH'
        )
    if module_name.startswith('.'):
        raise ConfigError(
            f'--workload {spec!r} is a relative module name: name it in full, --workload '
            f'{module_name.lstrip(".")}:{attr} (its folder on PYTHONPATH or the current directory)'
        )
    if module_name.endswith('.py'):
        raise ConfigError(f'--workload {spec!r} names the file: drop .py, --workload {module_name[:-3]}:{attr}')
    top = module_name.split('.', 1)[0]
    if top not in sys.stdlib_module_names:
        return
    mine, loaded = _user_file(top), getattr(sys.modules.get(top), '__file__', None)
    if mine is None:
        raise ConfigError(
            f"--workload {spec!r} names the standard library's {top}, not a port's module; " + _rename(top, attr)
        )
    if loaded is not None and os.path.realpath(loaded) == os.path.realpath(mine):
        how = f"shadows the standard library's {top}: every library that imports {top} gets your file"
    else:
        how = f"is shadowed by the standard library's {top}" + (f' ({loaded}), imported first' if loaded else '')
    raise ConfigError(f'--workload {spec!r} names a module of the standard library: {mine} {how}; {_rename(top, attr)}')


def _built_where(error: ConfigError, module_name: str, attr: str) -> str:
    """Importing a module builds every port in it: the statement of the user's module that built the
    bad one (``PORT_B = LoopPort(...)``, its line), named as the port asked for or as another one."""
    frames = [f for f, _ in blame.frames(error) if blame.kind(f) == 'user']
    module = next((f for f in reversed(frames) if f.function == '<module>'), None)
    if module is None:
        return ''
    names = _assigned(module.file, module.line)
    where = f'{os.path.basename(module.file)}:{module.line}'
    if frames[-1] is not module:  # the constructor was called further in (a helper building the port)
        where += f', via {frames[-1].where}'
    if names == [attr]:
        return f'{attr} ({where}): '
    built = ', '.join(names) if names else 'a port'
    return f'importing {module_name} failed building {built} ({where}), not {attr}, the port asked for: '


def _assigned(file: str, line: int) -> list[str]:
    """The names a top-level statement of ``file`` spanning ``line`` assigns (``PORT_B = ...``)."""
    try:
        with open(file) as f:
            tree = ast.parse(f.read(), file)
    except (OSError, SyntaxError, ValueError):
        return []
    for node in tree.body:
        if node.lineno <= line <= (node.end_lineno or node.lineno):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, 'target', None)]
            return [t.id for t in targets if isinstance(t, ast.Name)]
    return []


def _not_found(name: str, module_name: str) -> str:
    """Why ``name`` did not import, as far as can be told: a submodule a stub lacks, a package not installed,
    or the port's own folder off the path."""
    parent = name.rpartition('.')[0]
    if parent and parent in sys.modules:  # the package imported, its submodule did not: a stub's gap
        where = getattr(sys.modules[parent], '__file__', None)
        return (f'{parent!r} imported ({where or "a module with no file: a stub"}) but has no {name!r}; a stub must '
                'hold every submodule the code it stands in for imports (flax imports tensorflow.io where tensorflow '
                'imports), in every process the suite starts too')  # fmt: skip
    if name.split('.')[0] == module_name.split('.')[0]:
        return 'is its folder on PYTHONPATH?'
    return f'imported by {module_name}: is it installed, or its folder on PYTHONPATH?'


def load(spec: str) -> Port:
    """``'package.module:NAME'`` -> the port it names (a port, or a function of no arguments returning one)."""
    port = _load(spec)
    key = id(port)
    _LOADED[key] = (weakref.ref(port, lambda _, key=key: _LOADED.pop(key, None)), spec)
    return port


def _load(spec: str) -> Port:
    module_name, _, attr = spec.partition(':')
    if not module_name or not attr:
        raise ConfigError(f'--workload {spec!r}: a port is named package.module:NAME')
    _check_module_name(spec, module_name, attr)
    try:
        with _absl_warnings_off():
            module = importlib.import_module(module_name)
    except ConfigError as e:  # a port built with a wrong field: which one, where, and whether it is the one asked for
        raise ConfigError(f'--workload {spec!r}: {_built_where(e, module_name, attr)}{e}') from None
    except ModuleNotFoundError as e:
        raise ConfigError(f'--workload {spec!r}: cannot import {e.name!r} ({_not_found(e.name or "", module_name)})'
                          ) from None  # fmt: skip
    except Exception as e:  # noqa: BLE001 -- the user's module failed: say so in one line
        raise _users(spec, f'importing {module_name}', e) from None
    if not hasattr(module, attr):
        raise ConfigError(f'--workload {spec!r}: {module_name} has no attribute {attr!r}')
    port = getattr(module, attr)
    if isinstance(port, type):  # a model (or any class) named where the port belongs: calling it is no answer
        raise ConfigError(
            f'--workload {spec!r} is a class{_kind(port)}, not a port: name a ModelPort or LoopPort '
            'built around it, or a function of no arguments returning one (docs/commands.md#your-port-as-modulename)'
        )
    if callable(port) and not isinstance(port, Port):
        try:
            port = port()
        except ConfigError as e:
            raise ConfigError(f'--workload {spec!r}: {e}') from None
        except Exception as e:  # noqa: BLE001 -- the user's factory failed: its line, exit 2
            raise _users(spec, f'{attr}()', e) from None
    if not isinstance(port, Port):
        raise ConfigError(f'--workload {spec!r} is a {type(port).__name__}, not an equivalence ModelPort or LoopPort')
    return port
