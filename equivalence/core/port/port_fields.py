"""A port's own fields, checked as the flags are: each wrong one is one ``ConfigError`` line that
names the field and the fix, raised when the port is built (``ModelPort``/``LoopPort.__post_init__``).

What can be known without running anything is checked here: the kind of every field, and how
many positional arguments each callable takes (the suite calls them positionally). What a
callable returns is the pre-flight's business (``equivalence.core.preflight``).
"""

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from equivalence.core.port.config import RNG_MODES, ConfigError
from equivalence.core.port.pmaps import pmapped

# field -> (positional arguments the suite passes, what it is called as); '?' marks an optional field
CALLS = {
    'make_data': (3, 'make_data(rng: np.random.Generator, n_steps, global_batch)'),
    'make_tx': (1, 'make_tx(lr_scale)'),
    'init_args': (1, 'init_args(batch_of_one_example)'),
    'init_kwargs?': (1, 'init_kwargs(batch_of_one_example)'),
    'legacy_loss': (5, 'legacy_loss(model, params, model_state, batch, noise)'),
    'nnx_loss': (3, 'nnx_loss(model, batch, noise)'),
    'noise?': (2, 'noise(key, batch_spec)'),
    'eval_data?': (0, 'eval_data()'),
    'legacy_predict?': (4, 'legacy_predict(model, params, model_state, x)'),
    'nnx_predict?': (2, 'nnx_predict(model, x)'),
    'legacy_state': (1, 'legacy_state(linen_variables)'),
    'new_state': (1, 'new_state(nnx_model or, without one, linen_variables)'),
    'new_call?': (3, 'new_call(train_state, keys, batch_KxG)'),
    'legacy_groups?': (1, 'legacy_groups(train_state)'),
    'new_groups?': (1, 'new_groups(train_state)'),
}
KEYWORDS = ('rng_arg', 'new_rng_arg')  # a keyword a step takes its key by, or None
# The fields of a port's pmap side: what a check against a reference (``run --reference``) never calls.
LEGACY = ('legacy_model', 'make_data', 'init_args', 'init_kwargs', 'legacy_loss', 'legacy_predict', 'legacy_state',
          'legacy_step', 'legacy_groups')  # fmt: skip


class _Recorded:
    """``RECORDED``: a pmap-side field of a port whose pmap side is read from a reference (``run --reference``,
    docs/record.md), so that the pmap code need not be importable; called, it says so."""

    def __repr__(self) -> str:
        return 'RECORDED'

    def __call__(self, *args, **kwargs):
        raise ConfigError('a port field given as RECORDED was called: its pmap side is read from a reference, '
                          'check it with --reference FILE')  # fmt: skip


RECORDED = _Recorded()


def recorded_fields(port: Any) -> tuple[str, ...]:
    """The pmap-side fields ``port`` gives as ``RECORDED``: a check runs it only against a reference."""
    return tuple(f for f in LEGACY if getattr(port, f, None) is RECORDED)


def check(port: Any) -> None:
    """Every field of ``port`` (a ModelPort or LoopPort being built); ``ConfigError`` on the first wrong one."""
    name = port.name
    if not isinstance(name, str) or not name:
        raise ConfigError(f'port name={name!r}: give the port a non-empty name string')
    fields = set(vars(port)) - set(recorded_fields(port))
    check_rng_modes(port)
    check_names(port)
    if 'legacy_model' in fields:
        check_legacy_model(port)
    check_nnx_model(port)
    for key, (n, form) in CALLS.items():
        field = key.rstrip('?')
        if field in fields:
            check_callable(port, field, n, form, optional=key.endswith('?'))
    if 'legacy_step' in fields:
        check_pmapped_step(port)
        n, form = _step_call(port)
        how = rng_call(port)[0]
        if how == 'keyword':  # legacy_step(state, batch, dropout_rng=rng): its key by its name
            check_callable(port, 'legacy_step', n, form, optional=False, keywords=(port.rng_arg,))
        elif how != 'names':  # by name: its own signature named the three (rng_call)
            check_callable(port, 'legacy_step', n, form, optional=False)
    if not isinstance(port.default_batch, int) or isinstance(port.default_batch, bool) or port.default_batch < 1:
        raise _error(port, 'default_batch', f'must be a positive int, got {port.default_batch!r}')
    axis = vars(port).get('axis_name', 'batch')  # a field of a loop port's; a model port's pmap is the suite's
    if not isinstance(axis, str) or not axis:
        raise _error(port, 'axis_name', f'must be the pmap axis name your lax.pmean uses, a str; got {axis!r}')
    ema = getattr(port, 'ema_rate', None)
    if ema is not None and (isinstance(ema, bool) or not isinstance(ema, float | int) or not 0 <= ema < 1):
        raise _error(port, 'ema_rate', f'must be None or a number in [0, 1), got {ema!r}')
    check_skip(port)
    for field in KEYWORDS:
        value = getattr(port, field, None)
        if value is not None and not (isinstance(value, str) and value.isidentifier()):
            raise _error(
                port, field, f"must be None or the keyword a step takes its key by ('dropout_rng'), got {value!r}"
            )


def rng_call(port: Any) -> tuple[str, tuple[str, ...]]:
    """How a ``'state_rng'`` step whose key is named by ``rng_arg`` takes ``(state, batch, key)``, read from its
    signature: ``('first', ())``: ``legacy_step(rng, state, batch)`` (google-research/vdm's ``train_step(self,
    base_rng, state, batch)``, bound); ``('keyword', ())``: ``legacy_step(state, batch, rng_arg=rng)`` (flax's
    wmt ``dropout_rng=``); ``('names', (s, b))``: every argument by its name, the state and the batch being the
    step's two other parameters without a default (google-research/diffusion_distillation's ``step_fn(base_rng,
    train, state, batch)`` with ``train`` bound, leaving them keyword-only); ``('unclear', others)`` where other
    parameters without a default are not two; ``('', ())`` for any other step."""
    arg, step = getattr(port, 'rng_arg', None), getattr(port, 'legacy_step', None)
    if getattr(port, 'step_form', 'carry') != 'state_rng' or not arg or not callable(step):
        return '', ()
    params = _parameters(step) or []
    if arg not in {p.name for p in params}:
        return 'keyword', ()  # taken by **kwargs, or a signature that cannot be read
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    positional = [p.name for p in params if p.kind in kinds]
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    others = tuple(p.name for p in params if p.name != arg and p.default is p.empty and p.kind not in variadic)
    if len(others) != 2:
        return 'unclear', others
    if positional[:3] == [arg, *others]:
        return 'first', ()
    if positional[:2] == list(others) or any(p.kind == inspect.Parameter.POSITIONAL_ONLY for p in params):
        return 'keyword', ()
    return 'names', others


def key_first(port: Any) -> bool:
    """Whether a ``'state_rng'`` step is called ``legacy_step(rng, state, batch)`` (``rng_call``)."""
    return rng_call(port)[0] == 'first'


def _step_call(port: Any) -> tuple[int, str]:
    """How a loop port's ``legacy_step`` is called, by its ``step_form`` (``equivalence.core.run.adapters``)."""
    form = getattr(port, 'step_form', 'carry')
    if form == 'state_rng' and not getattr(port, 'rng_arg', None):
        return 3, 'legacy_step(state, batch, rng)'
    how, names = rng_call(port)
    if how == 'first':
        return 3, f'legacy_step({port.rng_arg}, state, batch)'
    if how == 'names':
        return 0, f'legacy_step({port.rng_arg}=rng, {names[0]}=state, {names[1]}=batch)'
    if how == 'unclear':
        step = port.legacy_step
        raise _error(
            port,
            'legacy_step',
            f'{_where(step)}takes {", ".join(names) or "nothing"} besides its key {port.rng_arg}: bind all but '
            'the state and the batch (functools.partial(step, name=value)), so that it takes its key, the state and '
            'the batch',
        )
    if form in ('state', 'state_rng'):
        return 2, 'legacy_step(state, batch' + (f', {port.rng_arg}=rng)' if form == 'state_rng' else ')')
    return 2, 'legacy_step((rng, state), batch)'


def check_pmapped_step(port: Any) -> None:
    """A ``legacy_step`` already ``jax.pmap``'d that the suite cannot run as the step it wraps: bound by
    ``functools.partial`` (AlgoPerf's update function with its static workload and optimizer bound; inside the
    suite's own pmap a pmapped function sees no device axis: 'IndexError: tuple index out of range'), or not
    callable as the step form (``adapters.legacy_step`` runs a bare ``jax.pmap(step)`` as its ``step``)."""
    step = port.legacy_step
    bound = step if isinstance(step, functools.partial) else None
    inner = pmapped(bound.func if bound is not None else step)
    if inner is None:
        return
    n, form = _step_call(port)
    name = getattr(inner, '__qualname__', None) or type(inner).__name__
    if bound is None and _binds(step, n):
        return  # run as the step it wraps
    if (
        bound is None and getattr(port, 'step_form', 'carry') != 'state_rng' and _binds(step, 3)
    ):  # p_train_step(s, b, rng)
        raise _error(
            port,
            'legacy_step',
            f"{_where(inner)}is {name}{_signature(step)}, already jax.pmap'd, and step_form "
            f"{getattr(port, 'step_form', 'carry')!r} calls it as {form}: give step_form='state_rng' (and rng_arg= "
            'its key if not third); the suite runs the step it wraps',
        )
    given, instead = (
        (f'functools.partial({name}, ...)', f'functools.partial({name}.__wrapped__, <the same arguments>)')
        if bound is not None
        else (name, f'{name}.__wrapped__, its other arguments bound by functools.partial,')
    )
    raise _error(
        port,
        'legacy_step',
        f"{_where(inner)}is {given}, already jax.pmap'd, and the suite runs legacy_step under its own pmap: pass "
        f'the step it wraps, {instead} called as {form}, with axis_name={getattr(port, "axis_name", "batch")!r} '
        'the axis its pmean names',
    )


def _binds(fn: Callable, n: int) -> bool:
    try:
        _signature(fn).bind(*range(n))
    except (TypeError, ValueError):
        return False
    return True


def _error(port: Any, field: str, text: str) -> ConfigError:
    return ConfigError(f'port {port.name!r}: {field} {text}')


def check_rng_modes(port: Any) -> None:
    modes = port.rng_modes
    if isinstance(modes, str):
        raise _error(port, 'rng_modes', f'is the string {modes!r}, not a tuple: use rng_modes=({modes!r},)')
    if not isinstance(modes, tuple | list) or not modes:
        raise _error(port, 'rng_modes', f'must be a non-empty tuple of {RNG_MODES}, got {modes!r}')
    unknown = [m for m in modes if m not in RNG_MODES]
    if unknown:
        raise _error(port, 'rng_modes', f'has {unknown[0]!r}; known modes are {", ".join(RNG_MODES)}')


def check_names(port: Any) -> None:
    from equivalence.core.port.naming import STRUCTURE

    names = port.names
    if names is None or callable(names) or names == STRUCTURE:
        return
    if isinstance(names, Mapping):
        bad = next(((k, v) for k, v in names.items() if not isinstance(k, str) or not isinstance(v, str)), None)
        if bad is not None:
            raise _error(
                port,
                'names',
                f'maps {bad[0]!r} to {bad[1]!r}: a names dict maps linen path prefixes to NNX path prefixes, both str',
            )
        return
    raise _error(port, 'names', f"is {_what(names)}: use None, a dict of path prefixes, a function or 'structure'")


def check_legacy_model(port: Any) -> None:
    import flax.linen as nn

    model = port.legacy_model
    if isinstance(model, nn.Module):
        cls = type(model).__name__
        raise _error(
            port, 'legacy_model', f'is an instance ({cls}(...)): give the class or a factory, legacy_model={cls}'
        )
    if not callable(model):
        raise _error(port, 'legacy_model', f'is {_what(model)}: give the linen Module class or a factory () -> Module')
    _arity(port, 'legacy_model', model, 0, 'legacy_model()')


def check_nnx_model(port: Any) -> None:
    from flax import nnx

    model = port.nnx_model
    if model is None and 'new_state' in vars(port):  # a loop port's new side built from linen's variables
        if port.names is not None:
            raise _error(port, 'names', 'pairs linen with NNX names: a port without nnx_model keeps linen names')
        return
    if isinstance(model, nnx.Module):
        raise _error(
            port,
            'nnx_model',
            f'is an instance ({type(model).__name__}): give a function of rngs, '
            f'nnx_model=lambda rngs: {type(model).__name__}(rngs=rngs)',
        )
    if not callable(model):
        raise _error(port, 'nnx_model', f'is {_what(model)}: give a function (nnx.Rngs) -> nnx.Module')
    params = _parameters(model)
    if params is None:
        return
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)]
    if positional:
        _arity(port, 'nnx_model', model, 1, 'nnx_model(rngs)')
        return
    if any(p.name == 'rngs' for p in params):
        name = getattr(model, '__name__', 'Model')
        raise _error(
            port,
            'nnx_model',
            f'takes rngs by keyword only, the suite calls nnx_model(rngs): use '
            f'nnx_model=lambda rngs: {name}(rngs=rngs)',
        )
    raise _error(port, 'nnx_model', 'takes no rngs argument: the suite calls nnx_model(nnx.Rngs(0))')


def check_callable(port: Any, field: str, n: int, form: str, optional: bool, keywords: tuple = ()) -> None:
    fn = getattr(port, field)
    if fn is None and optional:
        return
    if fn is None:
        raise _error(port, field, f'is missing: give the function the suite calls as {form}')
    if not callable(fn):
        raise _error(port, field, f'is {_what(fn)}, not a function: the suite calls {form}')
    _arity(port, field, fn, n, form, keywords)


def check_skip(port: Any) -> None:
    skip = getattr(port, 'skip', ())
    if isinstance(skip, str) or not isinstance(skip, tuple | list) or not all(isinstance(s, str) for s in skip):
        raise _error(port, 'skip', f"must be a tuple of legacy field names, e.g. skip=('dynamic_scale',); got {skip!r}")


def _signature(fn: Callable) -> inspect.Signature:
    """A class's constructor signature (an NNX Module's metaclass hides it behind ``*args``), else ``fn``'s."""
    if isinstance(fn, type) and '__init__' in {n for c in fn.__mro__[:-1] for n in vars(c)}:
        init = inspect.signature(fn.__init__)
        return init.replace(parameters=list(init.parameters.values())[1:])  # less self
    return inspect.signature(fn)


def _parameters(fn: Callable) -> list | None:
    try:
        return list(_signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read, the pre-flight calls it
        return None


def _arity(port: Any, field: str, fn: Callable, n: int, form: str, keywords: tuple = ()) -> None:
    """Whether ``fn`` accepts ``n`` positional arguments and ``keywords``, read from its signature when it has one."""
    try:
        _signature(fn).bind(*range(n), **dict.fromkeys(keywords))
    except TypeError as e:
        where = _where(fn)
        raise _error(port, field, f'{where}cannot be called as {form}: {e}') from None
    except ValueError:
        return


def _where(fn: Callable) -> str:
    code = getattr(inspect.unwrap(fn), '__code__', None)
    if code is None:
        return ''
    return f'({code.co_filename.rsplit("/", 1)[-1]}:{code.co_firstlineno}) '


def _what(value: Any) -> str:
    text = repr(value)
    return f'{type(value).__name__} {text[:40]}' if len(text) < 60 else f'a {type(value).__name__}'
