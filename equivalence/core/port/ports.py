"""The public surface: what a team gives the suite to check its own port, at two levels.

- ``ModelPort`` (level 1): your linen module and your NNX module, the loss of each, an
  optax transformation and a data source. The suite's own loops (``legacy_pmap/train.py``
  and ``nnx_sharded/train.py``) train both and compare. The built-in workloads are ports
  of this kind (``equivalence.core.port.workloads``): they take no path a user port cannot.
- ``LoopPort`` (level 2): your own pmap step, with its ``lax.pmean``, and your own new side:
  an NNX step or fused call over the objects or over a functional ``TrainState``, or a linen
  step under ``jax.jit``. The suite lays out one data stream both ways, hands both sides the
  same keys, places the inputs and compares every leaf.

A batch is any pytree of arrays whose leaves lead with the batch axis; no key is required.
Both levels go through ``equivalence.core.harness`` and the same comparison and report.
"""

import ast
import contextlib
import dataclasses
import functools
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

from equivalence.core.port import blame, port_fields
from equivalence.core.port.config import ConfigError
from equivalence.core.port.naming import Names
from equivalence.core.port.tolerance import FLOAT32_REDUCTION_ORDER, Tolerance


def _batch_only(batch) -> tuple:
    return (batch,)


@dataclasses.dataclass(frozen=True)
class ModelPort:
    """Level 1: your two models and losses, trained by the suite's two loops.

    Losses return one value per example; the loops average them over the global batch. A loss
    that is not a per-example mean (tokens of padded sequences) returns ``{'loss': sums_B,
    'weight': weights_B}``: the mean is ``psum(sum) / psum(weight)`` on the pmap side and
    ``sum / sum`` on the sharded side.
    ``noise`` draws the random numbers a loss consumes outside the model (the suite calls it
    per device or once for the global batch, as ``--rng`` says, and gives both losses the
    same numbers); Dropout layers *inside* the models need nothing: the suite draws their
    masks the same way on both sides (``equivalence.core.run.randomness``).
    """

    name: str
    legacy_model: Callable[[], Any]  # () -> linen Module
    nnx_model: Callable[[Any], Any]  # (nnx.Rngs) -> nnx Module; its initial values are replaced by linen's
    legacy_loss: Callable  # (model, params, model_state, batch, noise) -> losses_B, or (losses_B, new model_state)
    nnx_loss: Callable  # (model, batch, noise) -> losses_B; BatchNorm statistics update in place
    make_data: Callable  # (np.random.Generator, n_steps, global_batch) -> pytree of [n_steps, global_batch, ...]
    make_tx: Callable  # (lr_scale: float) -> optax transformation; --perturb scales the NNX side's
    init_args: Callable = _batch_only  # (a batch of one example: leaves [1, ...]) -> positional args of the linen init
    init_kwargs: Callable | None = None  # (batch of one example) -> keyword args of the linen init: {'train': False}
    noise: Callable | None = None  # (key, batch shapes) -> pytree of per-example arrays, or None
    names: Names = None  # linen -> NNX paths: None (same), {prefix: prefix}, a function, or 'structure'
    ema_rate: float | None = None  # EMA of the parameters after every step, or None
    default_batch: int = 64  # global batch when --batch-size is not given
    rng_modes: tuple[str, ...] = ('per-device', 'global')  # --rng values the port supports; the first is the default
    summary: str = ''  # one line for listings
    tolerance: Tolerance = FLOAT32_REDUCTION_ORDER  # what "match" means, and why
    eval_data: Callable | None = None  # () -> {'x', 'y'} held-out split, for classifiers
    legacy_predict: Callable | None = None  # (model, params, model_state, x) -> logits
    nnx_predict: Callable | None = None  # (model, x) -> logits

    def __post_init__(self):
        port_fields.check(self)  # each wrong field: one ConfigError line naming it and the fix


@dataclasses.dataclass(frozen=True)
class LoopPort:
    """Level 2: your own pmap step and your own new side's step; the suite only feeds and compares.

    The suite initialises ``legacy_model`` once; ``legacy_state`` builds your pmap train state from
    those variables. The new side is your train state and your step, in any of the forms real code
    has (``equivalence.core.port.new_side``): the NNX objects ``(model, optimizer)``; a flax ``TrainState``
    holding ``graphdef`` and an ``nnx.State`` of parameters (functional NNX under ``jax.jit``); or a
    plain pytree of linen parameters and optax state (linen under ``jax.jit``). With ``nnx_model``
    the suite copies linen's weights into it (through ``names``) and ``new_state`` builds your train
    state from that model; without ``nnx_model``, ``new_state`` builds it from linen's variables, as
    ``legacy_state`` does. Each call gets keys from one host chain: per-device ``[D, 2]`` (pmap: row
    d on device d; the new side: the same array placed ``P('data')``) or one global key, as
    ``--rng`` says.

    Real steps come as they are written (``equivalence.core.run.adapters``): ``step_form='state'``
    for ``train_step(state, batch) -> (state, metrics)`` (no key, or the key inside the state),
    ``'state_rng'`` for ``train_step(state, batch, rng)`` (a fresh key per step from the host
    chain; by keyword with ``rng_arg=`` / ``new_rng_arg=``), extra arguments bound with
    ``functools.partial``; ``loss='loss'`` or a function of the metrics reads the loss, and the
    other metrics are compared as a group of their own.

    The new side's fields were named ``nnx_state``, ``nnx_call``, ``nnx_step`` and ``nnx_groups``
    when it had to be NNX; those names still work, as arguments and as attributes, with a
    ``DeprecationWarning`` that names the new field (``ALIASES``).
    """

    name: str
    legacy_model: Callable[[], Any]  # () -> linen Module, initialised by the suite
    nnx_model: Callable[[Any], Any] | None = None  # (nnx.Rngs) -> nnx Module given linen's weights; None: no NNX model
    make_data: Callable = None  # (np.random.Generator, n_steps, global_batch) -> pytree of [n_steps, global_batch, ...]
    legacy_state: Callable[[dict], Any] = None  # linen variables -> your train state (one replica; replicated)
    legacy_step: Callable = None  # ((rng, state), batch) -> ((rng, state), loss); your pmean over axis_name inside
    new_state: Callable[[Any], Any] = None  # the NNX model holding linen's weights (or, without nnx_model, linen's
    # variables) -> your new train state: NNX objects, a TrainState of graphdef + nnx.State, or a pytree
    new_call: Callable | None = None  # (train_state, keys, batch_KxG) -> (train_state, out_K): K steps, one call
    init_args: Callable = _batch_only  # (a batch of one example: leaves [1, ...]) -> positional args of the linen init
    init_kwargs: Callable | None = None  # (batch of one example) -> keyword args of the linen init, as for ModelPort
    axis_name: str = 'batch'  # the pmap axis your step's lax.pmean names
    names: Names = None  # linen -> NNX paths, as for ModelPort
    legacy_groups: Callable | None = None  # your train state -> {group: tree}; None: read its fields by name
    new_groups: Callable | None = None  # your new train state -> {group: tree}; None: read it by its form
    default_batch: int = 64
    rng_modes: tuple[str, ...] = ('per-device', 'global')  # what your loops support; the first is the default
    summary: str = ''
    tolerance: Tolerance = FLOAT32_REDUCTION_ORDER
    skip: tuple[str, ...] = ()  # legacy train-state fields deliberately not migrated (e.g. 'dynamic_scale')
    # Real code as it is (equivalence.core.run.adapters): the step's form, how it is run, where its loss is.
    step_form: str = 'carry'  # 'carry' (above); 'state': (state, batch) -> (state, out); 'state_rng': + key
    legacy_loop: str | None = None  # 'steps': pmap(step) K times per call; 'scan': pmap(scan(step)); None: carry->scan
    loss: str | Callable | None = None  # a metrics key, or a function metrics -> loss; None: out is the loss
    new_step: Callable | None = None  # instead of new_call: (train_state, batch_G[, key]) -> out or (train_state, out)
    rng_arg: str | None = None  # 'state_rng': the keyword the pmap step takes its key by (dropout_rng=); None: 3rd
    new_rng_arg: str | None = None  # the same for new_step; None: rng_arg where new_step has it, else the 3rd

    def __post_init__(self):
        port_fields.check(self)


# The new side's fields under the names they had when it had to be NNX: still accepted as arguments (the
# one given wins over its new name, so ``dataclasses.replace(port, nnx_state=...)`` works) and read as
# attributes, each with a ``DeprecationWarning`` naming the new field. ``dataclasses.replace`` copies only
# the fields, so the old names never shadow a new value.
ALIASES = {'nnx_state': 'new_state', 'nnx_call': 'new_call', 'nnx_groups': 'new_groups', 'nnx_step': 'new_step'}


def _deprecated(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(
        f'LoopPort field {old} is now {new} (the new side need not be NNX): use {new}=',
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def _accepting_aliases(init: Callable) -> Callable:
    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        for old, new in ALIASES.items():
            if old in kwargs:
                _deprecated(old, new, 3)
                kwargs[new] = kwargs.pop(old)
        init(self, *args, **kwargs)

    return __init__


def _alias(old: str, new: str) -> property:
    def read(self):
        _deprecated(old, new, 3)
        return getattr(self, new)

    return property(read, doc=f'{new}, under its former name (deprecated)')


LoopPort.__init__ = _accepting_aliases(LoopPort.__init__)
for _old, _new in ALIASES.items():
    setattr(LoopPort, _old, _alias(_old, _new))


Port = ModelPort | LoopPort


def init_inputs(port: Port, example: Any) -> tuple[tuple, dict]:
    """The linen init's positional and keyword arguments from one example: ``init_args`` and
    ``init_kwargs`` (``__call__(self, inputs, *, train)`` takes ``train`` by keyword only)."""
    kwargs = port.init_kwargs(example) if port.init_kwargs is not None else {}
    return port.init_args(example), kwargs


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


def load(spec: str) -> Port:
    """``'package.module:NAME'`` -> the port it names (a port, or a function of no arguments returning one)."""
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
        raise ConfigError(f'--workload {spec!r}: cannot import {e.name!r} (is its folder on PYTHONPATH?)') from None
    except Exception as e:  # noqa: BLE001 -- the user's module failed: say so in one line
        raise _users(spec, f'importing {module_name}', e) from None
    if not hasattr(module, attr):
        raise ConfigError(f'--workload {spec!r}: {module_name} has no attribute {attr!r}')
    port = getattr(module, attr)
    if isinstance(port, type):  # a model (or any class) named where the port belongs: calling it is no answer
        raise ConfigError(
            f'--workload {spec!r} is a class{_kind(port)}, not a port: name a ModelPort or LoopPort '
            'built around it, or a function of no arguments returning one (docs/port.md)'
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
