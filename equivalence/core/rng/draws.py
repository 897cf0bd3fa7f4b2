"""The random numbers a run draws, recorded, so that a twin that draws others is refused.

A twin measures noise only if it computes what the checked run computes, random numbers
included. Its first two losses can agree while its draws do not: a zero-initialised head gives
the same loss whatever the dropout masks, and a warmup whose first learning rate is 0 keeps the
second too (issue 29's ViT: an NNX step that derived its dropout keys from the mesh size drew
other masks on the twin's mesh, whose floors then rose to 9e-2 and excused nearly every leaf).
So the twin's draws are compared with the run's themselves.

Every sampler of ``jax.random`` takes its bits from one function, ``prng.random_bits``
(jax 0.10). While ``recording`` is active it is replaced by one that also hands a digest of
what the bits are drawn from to the host (``jax.debug.callback``): the shape and width of the
bits, the PRNG, and the keys' data, its sum and a position-weighted sum, both in uint32 with
wraparound, so exact whatever order the reduction runs in and whatever the sharding. The bits are
a function of exactly these (JAX's random numbers never depend on the sharding), so two draws with
the same digest draw the same bits, and the digest needs no bit computed for it: a program of the
draws alone (``alone``) keeps only the keys' derivation. A first call is run under a
``jax.make_user_context`` of its own, so every jitted function is traced afresh (with the
callbacks) and the run's own compiled programs are left as they are: the checked run's first call
is traced so, while a twin records its own run (recording may change its rounding, never its
arithmetic; it is a reordering twin still). Two runs draw the same numbers when the multisets of
their digests are equal (the order of callbacks is not fixed).
"""

import collections
import contextlib
import functools
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.random import prng  # the one function every jax.random sampler draws its bits from

Draws = collections.Counter  # ((bits' shape, bit width, PRNG), keys' sum, weighted sum) -> times drawn
_RECORDING = jax.make_user_context(default_value=False)  # a jit cache key: traces made while recording are their own
_GOLDEN = 2654435761  # Knuth's multiplicative hash: position weights that differ for every position


def _digest(data: jax.Array) -> tuple[jax.Array, jax.Array]:
    flat = data.astype(jnp.uint32).ravel()
    weights = jnp.arange(flat.size, dtype=jnp.uint32) * jnp.uint32(_GOLDEN) + jnp.uint32(1)
    return jnp.sum(flat, dtype=jnp.uint32), jnp.sum(flat * weights, dtype=jnp.uint32)


_log: list | None = None  # where the callbacks of the recording under way append; traces made while recording
# are cached under their own jit key and reused by later recordings, so the callbacks read it when they run


@contextlib.contextmanager
def recording(log: list) -> Iterator[None]:
    """Every random draw traced or run eagerly in this block appends its digest (``Draws``' key) to ``log``
    when it runs (``jax.effects_barrier()`` waits for them)."""
    global _log
    original, _log = prng.random_bits, log

    def random_bits(keys, bit_width, shape):
        bits = original(keys, bit_width, shape)
        data = jax.random.key_data(keys) if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key) else keys
        said = (tuple(bits.shape), int(bit_width), str(getattr(keys.dtype, '_impl', keys.dtype)))
        said += (BRIDGE,) if getattr(_bridge, 'on', False) else ()
        jax.debug.callback(functools.partial(_record, said), *_digest(data))
        return bits

    prng.random_bits = random_bits
    try:
        with _RECORDING(True):
            yield
        jax.effects_barrier()
    finally:
        prng.random_bits, _log = original, None


BRIDGE = 'bridge'  # a draw's tag: the dropout bridge's own mask
_bridge = threading.local()


@contextlib.contextmanager
def bridge() -> Iterator[None]:
    """Draws traced in this block are tagged ``BRIDGE``: the dropout bridge's masks, drawn otherwise on each
    side by design (per device under pmap, per row on the mesh; compared as the Dropout's output), but the
    same on a twin as on its run."""
    previous, _bridge.on = getattr(_bridge, 'on', False), True
    try:
        yield
    finally:
        _bridge.on = previous


def own(drawn: Draws) -> frozenset:
    """The draws of a step's own code (the bridge's masks left out), each once and by its size: what two
    sides that draw the same numbers both draw, whatever the count (a global key's draw on every pmap device,
    once on the mesh) and the shape (JAX's partitionable threefry draws the same bits for (B,) and (B, 1))."""
    return frozenset(
        ((int(np.prod(shape)), *rest), total, weighted)
        for (shape, *rest), total, weighted in drawn
        if BRIDGE not in rest
    )


def into(log: list) -> None:
    """Where the recording under way appends from now on (each side of a recorded first step its own log;
    the callbacks read it when they run, whenever their program was traced)."""
    global _log
    if _log is not None:
        _log = log


def _record(drawn: tuple, total, weighted) -> None:
    if _log is not None:
        _log.append((drawn, int(total), int(weighted)))


class FirstCall:
    """The draws of a run's first call, kept by ``after_call`` (``sides.run_calls``'s hook) while its
    calls run under ``recording(self.log)`` (``twin.run_twin``): a twin records its own run, compiled once."""

    def __init__(self) -> None:
        self.log: list = []
        self.draws: Draws | None = None

    def after_call(self, setup, calls_done: int, rng) -> None:
        if calls_done == 1:
            jax.effects_barrier()
            self.draws = Draws(self.log)


def first_call(setup, batch_KxG, rng) -> Draws:
    """What ``setup``'s first call (``call_args`` then ``call``, as ``sides.run_calls`` runs it) draws.
    Where the call traces as one function of arrays (``setup.as_pure_call``), from a program of its draws
    alone (``alone``); else the call itself is run again, and ``setup`` is consumed: build one for this."""
    try:
        return alone(setup, batch_KxG, rng)
    except Exception:  # noqa: BLE001 -- a call that does host work while it runs: run as it is, below
        pass
    log: list = []
    with recording(log):
        _, args = setup.call_args(rng, batch_KxG)
        setup.call(args)
        jax.effects_barrier()
    return Draws(log)


def alone(setup, batch_KxG, rng) -> Draws:
    """The draws of ``setup``'s first call from a program that computes nothing else: the call traced
    with the recording (``as_pure_call``), every value that no draw needs removed (JAX's own dead-code
    elimination, ``dce_jaxpr``: the model, its gradients and the optimizer go, the keys, counters and
    draws stay), and run once. The draws are integers computed by the same operations from the same
    inputs as in the call itself, so they are its draws, bit for bit, for a fraction of its compile
    (score_sde's fused call: its whole program is compiled again otherwise). ``setup`` is not consumed."""
    from jax._src import core
    from jax._src.interpreters import partial_eval as pe

    fn, state = setup.as_pure_call()
    _, args = setup.call_args(rng, batch_KxG)
    log: list = []
    with recording(log):
        closed = jax.make_jaxpr(fn)(state, *args)
        jaxpr, used = pe.dce_jaxpr(closed.jaxpr, [False] * len(closed.jaxpr.outvars), instantiate=False)
        kept = [x for x, keep in zip(jax.tree.leaves((state, *args)), used, strict=True) if keep]
        jax.jit(functools.partial(core.eval_jaxpr, jaxpr, closed.consts))(*kept)
    return Draws(log)


def refusal(run: Draws, twin: Draws) -> str:
    """'' when the twin drew the run's random numbers; else why it is refused as a floor."""
    if run == twin:
        return ''
    missing, extra = sum((run - twin).values()), sum((twin - run).values())
    return (
        f"refused: it draws other random numbers than the new side's run ({missing} of {sum(run.values())} draws "
        f'of the first call not drawn by the twin, {extra} drawn only by it): its spread would be randomness, not the '
        'order of sums (a step that derives its keys from the mesh size or the device count does this)'
    )
