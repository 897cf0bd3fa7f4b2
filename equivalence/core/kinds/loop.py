"""A loop port: the team's own pmap step and its own new side; the suite lays out data and keys, places
the inputs and compares. Its fused form (``FusedLoop``: ``pmap(scan(step))`` against ``new_call``) and
its step form (``StepLoop``: a step as real code writes it, ``run.adapters``) share ``Loop``."""

import dataclasses
from typing import Any

import jax
from flax import nnx

from equivalence.core.port.config import ConfigError
from equivalence.core.port.kind import Form, Setup
from equivalence.core.port.plan import Run
from equivalence.core.port.ports import LoopPort
from equivalence.core.preflight import groups, steps, trace
from equivalence.core.rng import draws
from equivalence.core.run import adapters, loop_side, nudge, setups, sides, step_side
from equivalence.core.run.inputs import Inputs
from equivalence.core.state import new_side, states
from equivalence.core.twins import legacy_twin
from legacy_pmap import train as legacy
from nnx_sharded import sharding


@dataclasses.dataclass(frozen=True)
class Loop:
    """What both forms of a loop port answer alike: its step is its own (gradients not seen, random
    numbers drawn as its code says), its train states are its own."""

    port: LoopPort

    @property
    def axis_name(self) -> str:
        return self.port.axis_name

    def new_ahead(self) -> None:
        """None: the team's own new call compiles its programs as it runs, while the pmap side compiles."""

    def first_step_probe(self) -> None:
        """None: a loop port's gradients are its own step's, not seen (its first moment is read for them)."""

    def draws_recorder(self) -> draws.FirstCall:
        """Its step draws as its own code says: a twin's first call is recorded, its draws checked against the run's."""
        return draws.FirstCall()

    def handed_dropout_keys(self) -> None:
        """None: its own step hands its model the keys it draws with, whatever the model holds (an
        ``nnx.bridge.ToNNX`` model holds linen's Dropouts, which no NNX fact sees)."""

    def asked(self, asker: Any) -> Any:
        """What a command above the core asks of a loop port (its bench variants, its new side measured):
        ``asker.loop_port()``, its own pmap step and new call."""
        return asker.loop_port()

    def validate(self, config: Run) -> None:
        if (config.strategy, config.nnx_form) != ('dp', 'split'):
            raise ConfigError("--strategy and --nnx-form place the suite's NNX loop; a loop port brings its own")
        if config.perturb:
            raise ConfigError(
                "--perturb scales the suite's NNX optimizer: a loop port brings its own (perturb it there)"
            )
        adapters.check(self.port)

    def legacy_accuracy(self, setup: Setup) -> None:
        """None: a loop port gives no held-out split."""

    def new_accuracy(self, setup: Setup) -> None:
        """None: a loop port gives no held-out split."""

    def legacy_notes(self, setup: Setup) -> list[str]:
        return states.legacy_not_compared(legacy.unreplicate_to_host(setup.pstate), self.port.legacy_groups)

    def new_notes(self, setup: Setup) -> list[str]:
        return new_side.not_compared(setup.train_state, self.port.new_groups)

    def loss_names(self) -> tuple[str, str]:
        return "the pmap step's loss", "the new step's loss"

    def keys(self, config: Run) -> str:
        """How its steps get their keys, for the report's header: ``--rng``'s mode, or, for a step that takes
        none (``step_form='state'``), that it keeps its own in its train state."""
        if self.port.step_form == 'state':
            return 'none handed (the step keeps its key in its state)'
        return config.rng_mode

    def new_side(self) -> str:
        """What the new side is, as a report names it: NNX where the port has an NNX model, else linen
        under ``jax.jit`` (its new state built from linen's variables)."""
        return 'NNX' if self.port.nnx_model is not None else 'linen under jax.jit'

    def legacy_twin(self, config: Run, n: int, inputs: Inputs) -> tuple[Any, bool]:
        """``(its pmap step run on n devices, False)``: the step draws as its own code says, with the keys the
        suite hands it (its legacy twin is judged by its losses)."""
        return sides.run_legacy(self, legacy_twin.on(config, n), inputs), False

    def recording(self) -> 'Loop':
        """As it is: its step is its own, only its modules are seen."""
        return self

    def legacy_train_state(self, variables: dict) -> Any:
        return self.port.legacy_state(variables)

    def checkpoint_state(self) -> nnx.Module:
        """The team's new train state, viewed under ``nnx_sharded.train.TrainState``'s names
        (``setups.View``); with ``new_groups=`` its own layout (``checkpoint.layout.group_places``)."""
        train_state = self.port.new_state(self.port.nnx_model(nnx.Rngs(0)))
        return train_state if self.port.new_groups is not None else setups.View.of(train_state)


@dataclasses.dataclass(frozen=True)
class FusedLoop(Loop):
    """``legacy_step((rng, state), batch)`` under the suite's pmap(scan), against ``new_call``: K steps
    in one call on each side."""

    form = Form.FUSED

    def recording_mesh(self, setup: Setup) -> Any:
        """The mesh the first-step recording gathers each value of a new side onto: its own."""
        return setup.mesh

    def preflight(self, config: Run, variables: dict, batch_KxG: Any, mapping: dict) -> None:
        old_state = trace.trace_legacy_loop(self.port, config, variables, batch_KxG)
        new_state = trace.trace_nnx_loop(self.port, config, batch_KxG, variables)
        groups.check_groups(self.port, old_state, new_state, variables, mapping)

    def legacy_preflight(self, config: Run, variables: dict, batch_KxG: Any) -> None:
        """The pmap side's half of ``preflight``: all a recording traces (it never builds the new side)."""
        old_state = trace.trace_legacy_loop(self.port, config, variables, batch_KxG)
        groups.check_legacy_groups(self.port, old_state, variables)

    def new_preflight(self, config: Run, variables: dict, batch_KxG: Any, mapping: dict) -> None:
        """The new side's half of ``preflight``: all a check against a reference traces."""
        new_state = trace.trace_nnx_loop(self.port, config, batch_KxG, variables)
        groups.check_new_state_groups(self.port, new_state, variables, mapping)

    def check_states(self, variables: dict, mapping: dict) -> None:
        old_state, new_state = trace.legacy_state(self.port, variables), trace.nnx_train_state(self.port, variables)
        groups.check_groups(self.port, old_state, new_state, variables, mapping)

    def legacy_setup(self, config: Run, inputs: Inputs) -> Setup:
        return loop_side.legacy_setup(self.port, config, inputs.variables)

    def new_setup(self, config: Run, inputs: Inputs) -> Setup:
        return loop_side.new_setup(self.port, config, inputs.variables, inputs.mapping)

    def twin_setup(self, config: Run, inputs: Inputs, twin, lr_scale: float | None = None) -> Setup:
        if isinstance(twin, nudge.Nudged):  # the run's own side, from its inputs nudged
            return self.new_setup(config, nudge.inputs(inputs, twin))
        return loop_side.twin_setup(self.port, config, inputs.variables, inputs.mapping, twin)

    def described(self) -> list[str]:
        return adapters.wrapped_notes(self.port)

    def programs(self) -> tuple[str, str]:
        return 'pmap(scan)', 'NNX new_call' if self.port.nnx_model is not None else 'new_call (linen, jax.jit)'

    def key_draws_per_call(self, config: Run) -> int:
        return 1

    def one_program_each(self, command: str) -> None:
        """Both sides are one compiled call each."""


@dataclasses.dataclass(frozen=True)
class StepLoop(Loop):
    """A step as real code writes it (``step_form``, ``loss``, ``legacy_loop``, ``new_step``): adapted by
    ``run.adapters`` and run by ``run.step_side``; its pre-flight traces one step of each side."""

    form = Form.STEP

    def recording_mesh(self, setup: Setup) -> None:
        """None: the team's own programs, a value is recorded where it is."""

    def preflight(self, config: Run, variables: dict, batch_KxG: Any, mapping: dict) -> None:
        old_state, new_state = steps.trace_steps(self.port, config, variables, batch_KxG, mapping)
        groups.check_groups(self.port, old_state, new_state, variables, mapping, states.legacy_groups)

    def legacy_preflight(self, config: Run, variables: dict, batch_KxG: Any) -> None:
        """The pmap side's half of ``preflight``: all a recording traces (it never builds the new side)."""
        old_state = steps.trace_legacy_step(self.port, config, variables, batch_KxG)
        groups.check_legacy_groups(self.port, old_state, variables, states.legacy_groups)

    def new_preflight(self, config: Run, variables: dict, batch_KxG: Any, mapping: dict) -> None:
        """The new side's half of ``preflight``: all a check against a reference traces."""
        new_state = steps.trace_new_steps(self.port, config, batch_KxG, variables, mapping)
        groups.check_new_state_groups(self.port, new_state, variables, mapping)

    def check_states(self, variables: dict, mapping: dict) -> None:
        """Nothing beyond the data and names: its states are checked when its steps are traced."""

    def legacy_setup(self, config: Run, inputs: Inputs) -> Setup:
        return step_side.legacy_setup(self.port, config, inputs.variables)

    def new_setup(self, config: Run, inputs: Inputs) -> Setup:
        source = loop_side.new_source(self.port, inputs.variables, inputs.mapping)
        return step_side.new_setup(self.port, config, source, setups.nnx_mesh(config))

    def twin_setup(self, config: Run, inputs: Inputs, twin, lr_scale: float | None = None) -> Setup:
        if isinstance(twin, nudge.Nudged):  # the run's own side, from its inputs nudged
            return self.new_setup(config, nudge.inputs(inputs, twin))
        mesh = sharding.make_mesh(twin, devices=jax.local_devices())  # this process's own: no collective
        source = loop_side.new_source(self.port, inputs.variables, inputs.mapping)
        return step_side.new_setup(self.port, config, source, mesh)

    def described(self) -> list[str]:
        return [adapters.describe(self.port), *adapters.wrapped_notes(self.port)]

    def programs(self) -> tuple[str, str]:
        return adapters.programs(self.port)

    def key_draws_per_call(self, config: Run) -> int:
        return adapters.key_draws_per_call(self.port, config)

    def one_program_each(self, command: str) -> None:
        adapters.one_program_each(self.port, command)
