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

import dataclasses
import functools
import warnings
from collections.abc import Callable
from typing import Any

from equivalence.core.port import port_fields
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
    masks the same way on both sides (``equivalence.core.rng.randomness``).
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
    # What a loop port declares and a model port has not, answered alike (class attributes, not fields): the
    # suite's own train states, read by their fields; nothing skipped; the axis named by the suite's pmap.
    legacy_groups = None
    new_groups = None
    skip = ()
    axis_name = None  # the suite's pmap names it (legacy_pmap.train.AXIS)

    def __post_init__(self):
        port_fields.check(self)  # each wrong field: one ConfigError line naming it and the fix


@dataclasses.dataclass(frozen=True)
class LoopPort:
    """Level 2: your own pmap step and your own new side's step; the suite only feeds and compares.

    The suite initialises ``legacy_model`` once; ``legacy_state`` builds your pmap train state from
    those variables. The new side is your train state and your step, in any of the forms real code
    has (``equivalence.core.state.new_side``): the NNX objects ``(model, optimizer)``; a flax ``TrainState``
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
    rng_arg: str | None = None  # 'state_rng': the parameter the pmap step takes its key by (dropout_rng=; its
    # first, train_step(base_rng, state, batch); or any, state and batch its other two: rng_call); None: the 3rd
    new_rng_arg: str | None = None  # the same for new_step; None: rng_arg where new_step has it, else the 3rd
    eval_data = None  # a model port's held-out split (a class attribute, not a field): a loop port has none

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


def field_values(port: Port) -> list:
    """The value of each field of ``port`` (the functions, classes and settings it was built from)."""
    return [getattr(port, f.name) for f in dataclasses.fields(port)]
