"""What both runs of a check are given, made once: the linen variables, the data of each call, the key
chain, and the two sides' names paired (``Inputs``). The verdict's re-runs are given the same.

One seed fixes everything: the data (numpy), the linen initialisation (copied into NNX, since the two
initialisers differ) and the host key chain both paths draw call keys from.
"""

import collections
import dataclasses
import hashlib
import weakref
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from equivalence.core.port.plan import Run
from equivalence.core.port.ports import Port, init_inputs
from equivalence.core.run import freshness
from equivalence.core.run.facts import name_mapping
from equivalence.core.run.setups import input_rows
from equivalence.distributed import rows


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What both runs were given; the verdict's re-runs take the same (``dataclasses.replace`` for fewer calls)."""

    variables: dict  # linen's initial variables, which both sides start from
    calls: list  # this process's rows of each call, [K, G, ...] (all of them with one process)
    rng: jax.Array | None  # the host key chain before the first call (None: a restore gives it)
    mapping: dict = dataclasses.field(default_factory=dict)  # linen leaf path -> NNX leaf path
    whole: list | None = dataclasses.field(default=None, repr=False)  # every row of each call (several processes)
    restore: Callable | None = None  # --resume-at: loads the checkpoint into a setup, returns the key chain
    first_call: int = 0  # --resume-at: the calls are those from this one on
    recorded: Any = None  # --reference: the pmap side read from a reference (verdict.referenced.Recorded), not run

    @property
    def whole_calls(self) -> list:
        """The calls with every row of the global batch: what a run on this process's devices alone takes."""
        return self.calls if self.whole is None else self.whole

    def single_process_probes(self) -> str:
        """Why the probes that re-run both sides cannot run here; '' when they can."""
        if self.recorded is not None:
            return 'the pmap side is a recorded reference'
        return self.first_steps_unrecorded()

    def first_steps_unrecorded(self) -> str:
        """Why the first steps cannot be recorded module by module here (the location, the first gradients);
        '' when they can: a reference holds the pmap side's."""
        if self.restore is not None:
            return 'resumed from a checkpoint'
        return 'several processes' if jax.process_count() > 1 else ''


def make(port: Port, config: Run, mapping: dict | None = None, started: 'Start | None' = None) -> Inputs:
    """The inputs of a run of ``port`` under ``config``: ``make_inputs``, the names paired once
    (``mapping``, when the pre-flight has paired them already), every row of each call where this
    process reads only some. ``started``: ``start``'s, made already (its init compiled meanwhile)."""
    whole = global_calls(port, config) if jax.process_count() > 1 else None
    variables, calls, rng = make_inputs(port, config, started)
    mapping = name_mapping(port, variables) if mapping is None else mapping
    return Inputs(variables, calls, rng, mapping, whole)


def unpaired(port: Port, config: Run) -> Inputs:
    """The inputs ``make`` makes, in one process, with nothing of the new side asked: linen's variables from
    the same key, every row of each call, the same key chain; no names paired (a reference's recording)."""
    calls = global_calls(port, config)
    rng, init_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    args, kwargs = init_inputs(port, jax.tree.map(lambda v: v[0, :1], calls[0]))
    variables = dict(_init_program(port, args, kwargs)(init_rng))
    return Inputs(variables, calls, rng, {})


@dataclasses.dataclass(frozen=True)
class Start:
    """What ``make_inputs`` makes before linen's initialisation runs: the data, the key chain, and the
    initialisation as one ``jax.jit`` (``lowered``: traced, for a thread to compile while the pre-flight runs)."""

    whole: list  # every call's whole batch (``global_calls``): this process's rows are taken from it later
    rng: jax.Array
    init_rng: jax.Array
    init: Callable  # jax.jit(key -> linen's variables)

    def lowered(self):
        return self.init.lower(self.init_rng)

    def shapes(self) -> dict:
        """linen's variables, shapes only, from the trace ``lowered`` made (JAX keeps it): the pre-flight's."""
        return self.init.eval_shape(self.init_rng)


def start(port: Port, config: Run) -> Start:
    whole = global_calls(port, config)
    rng, init_rng = jax.random.split(jax.random.PRNGKey(config.seed))
    example = jax.tree.map(lambda v: v[0, :1], whole[0])
    args, kwargs = init_inputs(port, example)
    return Start(whole, rng, init_rng, _init_program(port, args, kwargs))


_INITS: collections.OrderedDict = collections.OrderedDict()  # key -> (the port, weakly; its jitted init)
freshness.kept(_INITS.clear)
KEPT_INITS = 8  # the initialisations kept, the least recently used going first


def _init_program(port: Port, args: tuple, kwargs: dict) -> Callable:
    """linen's initialisation as one compiled program, not one per operation (10 of the 21 s of a cold ResNet
    run were op by op; on the built-ins it is bitwise the same). The same port initialised from the same
    example again in this process (a check per device count, a team's parametrized test) reuses the same
    ``jax.jit``, so that JAX traces, lowers and compiles it once: keyed by the port itself (weakly: a port
    that is gone is never matched), its linen model's repr and the example's structure, shapes, dtypes and
    bytes."""
    try:
        leaves, treedef = jax.tree.flatten((args, kwargs))
        # the model's repr too (its constructor's fields): a module rebuilt with other settings is another init
        key = (id(port), repr(port.legacy_model()), str(treedef), tuple(_leaf_key(x) for x in leaves))
        ref = weakref.ref(port)
    except Exception:  # noqa: BLE001 -- a port not weakly referable, an argument with no stable key, a model
        # that cannot be built here (the pre-flight says why): not kept
        return _jitted_init(port.legacy_model, args, kwargs)
    hit = _INITS.get(key)
    if hit is not None and hit[0]() is port:
        _INITS.move_to_end(key)
        return hit[1]
    init = _jitted_init(lambda: ref().legacy_model(), args, kwargs)  # the port weakly: kept, it keeps no port alive
    _INITS[key] = (ref, init)
    while len(_INITS) > KEPT_INITS:
        _INITS.popitem(last=False)
    return init


def _jitted_init(model: Callable, args: tuple, kwargs: dict) -> Callable:
    """``jax.jit(key -> linen's variables)`` of the linen module ``model()`` builds."""
    return jax.jit(lambda k: model().init({'params': k, 'dropout': k}, *args, **kwargs))


def _leaf_key(x: Any) -> tuple:
    """An argument of the init as a key: an array by shape, dtype and bytes; a plain value by itself."""
    if isinstance(x, np.ndarray | jax.Array):
        try:
            a = np.asarray(x)
        except Exception as e:  # noqa: BLE001 -- a key array, or one not addressable here: not kept
            raise TypeError(f'no stable key for {type(x).__name__}') from e
        return (a.shape, str(a.dtype), hashlib.sha1(a.tobytes()).hexdigest())
    if x is None or isinstance(x, bool | int | float | str):
        return (type(x).__name__, x)
    raise TypeError(f'no stable key for {type(x).__name__}')


def make_inputs(port: Port, config: Run, started: Start | None = None) -> tuple[dict, list, jax.Array]:
    """Linen variables, the data of each call (pytrees of ``[K, G, ...]``; with several processes,
    only this process's rows ``[K, G*n/D, ...]``), and the training key. ``started``: ``start``'s."""
    s = started or start(port, config)
    return dict(s.init(s.init_rng)), local_calls(s.whole, config), s.rng


def local_calls(whole: list, config: Run) -> list:
    """This process's rows of each call (``input_rows``), ``[K, G*n/D, ...]``; all of them with one process."""
    held = input_rows(config)
    return [rows.local_batch(batch_KxG, config.devices, held) for batch_KxG in whole]


def global_calls(port: Port, config: Run) -> list:
    """Every call's whole batch, ``[K, G, ...]``, in every process: what ``make_inputs`` splits
    between processes, and what a run on this process's devices alone (the twin across processes)
    is fed. ``make_data`` is seeded, so each process draws the same rows."""
    data = port.make_data(np.random.default_rng(config.seed), config.steps, config.batch_size)
    k = config.steps_per_call
    return [jax.tree.map(lambda v, c=c: v[c * k : (c + 1) * k], data) for c in range(config.calls)]
