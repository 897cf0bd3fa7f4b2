"""Measuring: each path's fused call lowered, compiled and read (imports JAX: called after the
command has set up devices)."""

from typing import Any

from equivalence.explain import hlo
from equivalence.explain.measurements import PathMeasurement
from equivalence.explain.memory import memory
from equivalence.explain.placements import LEGACY, NNX, NNX_LOOP, Layout, copies_spread, flat_inputs, placement


def measure(layout: Layout, compiled: Any, args: tuple, config: Any, notes: tuple[str, ...] = ()) -> PathMeasurement:
    """Reads the compiled call: its HLO text, input shardings and memory analysis; ``notes``: how it was built."""
    text = compiled.as_text()
    header, found = hlo.collectives(text)
    inputs = flat_inputs(args, compiled.input_shardings[0])
    placements = tuple(placement(*layout.leaf(keys, kind), a, s, layout) for keys, kind, a, s in inputs)
    full = [a for (_, _, a, _), p in zip(inputs, placements, strict=True) if p.group == 'params' and p.full_copy]
    traced = (
        'jit + shard_map (per-device code)' if '/shard_map/' in text else 'jit (one global program, partitioned by XLA)'
    )
    program = f'{header}; traced as {traced}; inputs on mesh {placements[0].mesh if placements else {}}'
    return PathMeasurement(
        layout.path,
        layout.title,
        program,
        config.devices,
        config.steps_per_call,
        tuple(found),
        placements,
        memory(compiled),
        copies_spread(full),
        notes,
    )


def measure_legacy(setup: Any, args: tuple) -> PathMeasurement:
    """``setup``: ``setups.LegacySetup``; ``args``: one call's, from ``setup.call_args``."""
    with setup.context():  # a loop port's Dropout bridge, while tracing
        lowered = setup.p_train_step.lower(*args)
    return measure(LEGACY, lowered.compile(), args, setup.config)


def measure_nnx(setup: Any, args: tuple) -> PathMeasurement:
    """``setup``: ``setups.NnxSetup``, its state placed any way; ``args`` from ``setup.call_args``.

    The call carries the state as a plain dict of arrays; its leaves are named from the same
    arrays viewed as an ``nnx.State`` (same paths, same order), whose Variable types tell
    parameters from batch statistics.
    """
    from flax import nnx

    from nnx_sharded import sharding

    (keys, state), batch = args
    typed = nnx.state(nnx.merge(setup.graphdef, state))
    compiled = setup.fused.lower(*args).compile()
    notes = tuple(sharding.take_fallbacks())  # the gradient's all-reduce left where the partitioner puts it, and why
    return measure(NNX, compiled, ((keys, typed), batch), setup.config, notes)


def measure_nnx_loop(setup: Any, args: tuple) -> PathMeasurement:
    """``setup``: ``setups.LoopNewSetup``: the user's call, lowered over its split state."""
    fn, state = setup.as_pure_call()
    inputs = (state, *args)
    return measure(NNX_LOOP, fn.lower(*inputs).compile(), inputs, setup.config)


def measure_both(port: Any, config: Any) -> tuple[PathMeasurement, PathMeasurement]:
    """One call of each path of a port (built-in or user's), compiled and read."""
    from equivalence.core import harness, kinds
    from nnx_sharded import sharding

    sharding.take_fallbacks()  # what earlier calls traced is theirs
    kinds.of(port).one_program_each('explain')
    harness.validate(port, config)
    prepared = harness.prepare(port, config)
    kind, inputs = prepared.kind, prepared.inputs
    legacy_setup = kind.legacy_setup(config, inputs)
    _, legacy_args = legacy_setup.call_args(inputs.rng, inputs.calls[0])
    nnx_setup = kind.new_setup(config, inputs)
    _, nnx_args = nnx_setup.call_args(inputs.rng, inputs.calls[0])
    return measure_legacy(legacy_setup, legacy_args), kind.asked(NewSide(nnx_setup, nnx_args))


class NewSide:
    """The new side's call measured as its kind builds it (``kind.asked``): the suite's own (a model port's
    ``setups.NnxSetup``) or the team's (a loop port's, over its split state)."""

    def __init__(self, setup: Any, args: tuple):
        self.setup, self.args = setup, args

    def model_port(self) -> PathMeasurement:
        return measure_nnx(self.setup, self.args)

    def loop_port(self) -> PathMeasurement:
        return measure_nnx_loop(self.setup, self.args)
