"""A model port: the suite's own loops train the team's two models, with their losses and optimizer."""

import dataclasses
from collections.abc import Callable
from typing import Any

from flax import nnx

from equivalence.core.locate import first_step
from equivalence.core.port.kind import Form, Setup
from equivalence.core.port.plan import Run
from equivalence.core.port.ports import ModelPort
from equivalence.core.preflight import trace
from equivalence.core.record import intercept
from equivalence.core.run import facts, model_side, nudge, sides
from equivalence.core.run.inputs import Inputs
from equivalence.core.run.model_side import TwinKind
from equivalence.core.twins import legacy_twin
from legacy_pmap import losses as legacy_losses
from legacy_pmap import train as legacy
from nnx_sharded import train as sharded


@dataclasses.dataclass(frozen=True)
class Model:
    """``ModelPort``: its optimizer and losses run inside the suite's loops, so its first step's gradients
    and per-example losses are seen, and its random numbers are the suite's to draw."""

    port: ModelPort
    form = Form.MODEL
    axis_name = legacy.AXIS

    def validate(self, config: Run) -> None:
        """Every flag applies to the suite's own loops."""

    def preflight(self, config: Run, variables: dict, batch_KxG: Any, mapping: dict) -> None:
        trace.trace_legacy_model(self.port, config, variables, batch_KxG)
        trace.trace_nnx_model(self.port, config, batch_KxG)

    def legacy_preflight(self, config: Run, variables: dict, batch_KxG: Any) -> None:
        """The pmap side's half of ``preflight``: all a recording traces (it never builds the new side)."""
        trace.trace_legacy_model(self.port, config, variables, batch_KxG)

    def new_preflight(self, config: Run, variables: dict, batch_KxG: Any, mapping: dict) -> None:
        """The new side's half of ``preflight``: all a check against a reference traces."""
        trace.trace_nnx_model(self.port, config, batch_KxG)

    def check_states(self, variables: dict, mapping: dict) -> None:
        """Both train states are the suite's: nothing of the port's to check."""

    def legacy_setup(self, config: Run, inputs: Inputs) -> Setup:
        return model_side.legacy_setup(self.port, config, inputs.variables)

    def new_setup(self, config: Run, inputs: Inputs) -> Setup:
        return model_side.new_setup(self.port, config, inputs.variables, inputs.mapping)

    def twin_setup(self, config: Run, inputs: Inputs, twin: TwinKind, lr_scale: float | None = None) -> Setup:
        if isinstance(twin, nudge.Nudged):  # the run's own side, from its inputs nudged
            return self.new_setup(config, nudge.inputs(inputs, twin))
        return model_side.twin_setup(self.port, config, inputs.variables, inputs.mapping, twin, lr_scale)

    def new_ahead(self) -> Callable[[Run, Inputs], Setup]:
        """What builds the new side before the legacy side runs, so that it compiles on a thread too: the
        new side's program is the suite's own."""
        return self.new_setup

    def first_step_probe(self) -> Callable[[Any], Any]:
        """The first step's gradients, seen: the suite's optimizer is given them (``first_step.grads_report``)."""
        return first_step.grads_report

    def draws_recorder(self) -> None:
        """None: the suite draws a model port's numbers from the run's keys, the same by construction, so a
        twin's draws are not checked against the run's."""

    def recording_mesh(self, setup: Setup) -> Any:
        """The mesh the first-step recording gathers each value of a new side (or twin) onto: its own."""
        return setup.mesh

    def asked(self, asker: Any) -> Any:
        """What a command above the core asks of a model port (its bench variants, its new side measured):
        ``asker.model_port()``, the suite's own loops over its two models."""
        return asker.model_port()

    def legacy_accuracy(self, setup: Setup) -> float | None:
        """The pmap side's held-out accuracy (``eval_data``, a classifier's), or None without one."""
        port = self.port
        if port.eval_data is None:
            return None
        state, data = legacy.unreplicate_to_host(setup.pstate), port.eval_data()
        logits = port.legacy_predict(port.legacy_model(), state.params, state.model_state, data['x'])
        return sides.accuracy(logits, data['y'])

    def new_accuracy(self, setup: Setup) -> float | None:
        """The new side's held-out accuracy, or None without ``eval_data``."""
        if self.port.eval_data is None:
            return None
        data = self.port.eval_data()
        return sides.accuracy(self.port.nnx_predict(setup.model, data['x']), data['y'])

    def legacy_notes(self, setup: Setup) -> list[str]:
        return []

    def new_notes(self, setup: Setup) -> list[str]:
        return []

    def described(self) -> list[str]:
        return []

    def programs(self) -> tuple[str, str]:
        return 'pmap(scan)', 'NNX sharded scan'

    def keys(self, config: Run) -> str:
        """How its steps get their keys, for the report's header: ``--rng``'s mode."""
        return config.rng_mode

    def new_side(self) -> str:
        """What the new side is, as a report names it: the suite's own NNX loop."""
        return 'NNX'

    def loss_names(self) -> tuple[str, str]:
        return tuple(getattr(f, '__qualname__', repr(f)) for f in (self.port.legacy_loss, self.port.nnx_loss))

    def legacy_twin(self, config: Run, n: int, inputs: Inputs) -> tuple[Any, bool]:
        """``(the pmap side run on n devices, whether it drew with the run's D key rows)``: where its step
        consumes random numbers in per-device mode, each example gets the numbers it got in the run
        (``legacy_twin.with_rows``), whatever the count."""
        if config.rng_mode == 'per-device' and self.draws_random_numbers():
            return legacy_twin.with_rows(self.port, config, n, inputs), True
        return sides.run_legacy(self, legacy_twin.on(config, n), inputs), False

    def handed_dropout_keys(self) -> bool:
        """Whether the suite's loops hand the models dropout keys: where the NNX model has Dropout or attention."""
        return facts.uses_dropout(self.port)

    def draws_random_numbers(self) -> bool:
        """Whether its step consumes random numbers (Dropout, attention, its own noise)."""
        return facts.uses_dropout(self.port) or self.port.noise not in (None, legacy_losses.no_noise)

    def recording(self) -> 'Model':
        """The same port, its losses and optimizer recording what they compute (``intercept``)."""
        return Model(intercept.recording_port(self.port))

    def key_draws_per_call(self, config: Run) -> int:
        return 1

    def one_program_each(self, command: str) -> None:
        """Both sides are one compiled call each."""

    def legacy_train_state(self, variables: dict) -> Any:
        """The legacy train state the suite's pmap loop carries (one replica), as checkpoints hold it."""
        return legacy.create_state(variables, self.port.make_tx(1.0), self.port.ema_rate)

    def checkpoint_state(self) -> nnx.Module:
        """The NNX train state its checkpoints hold: ``nnx_sharded.train.TrainState``."""
        return sharded.TrainState(self.port.nnx_model(nnx.Rngs(0)), self.port.make_tx(1.0), self.port.ema_rate)
