"""A port's kind, decided once, and what every kind answers (``Kind``): the one place that asks which
class a port is (``form_of``), beside the declared interface the rest of the suite is written against.

Three kinds: a model port (the suite's own loops train the user's models), a loop port's fused call
(``pmap(scan(step))`` against ``new_call``, K steps per call), and a loop port's step form (a step as
real code writes it: ``(state, batch[, rng]) -> (state, metrics)``, a loss read from the metrics, a
one-step new side). ``equivalence.core.kinds`` holds one object per kind; everything below it is
handed that object and asks it, never the port's class. The setups a kind builds share ``Setup``.
"""

import enum
from typing import Any, Protocol

import numpy as np

from equivalence.core.port.plan import Run
from equivalence.core.port.ports import LoopPort, ModelPort, Port


class Form(enum.Enum):
    MODEL = 'model port'
    FUSED = 'loop port, fused call'
    STEP = 'loop port, step form'


def form_of(port: Port) -> Form:
    """Which kind ``port`` is: the only branch on a port's class in the suite."""
    if isinstance(port, ModelPort):
        return Form.MODEL
    if not isinstance(port, LoopPort):
        raise TypeError(f'a port is a ModelPort or a LoopPort, not a {type(port).__name__}')
    stepped = port.step_form != 'carry' or port.loss is not None or port.new_step is not None
    return Form.STEP if stepped else Form.FUSED


class Setup(Protocol):
    """One side ready to run: a compiled call and the state it carries (``equivalence.core.run``)."""

    config: Run

    def call_args(self, rng: Any, batch_KxG: Any) -> tuple[Any, tuple]:
        """``(the host key chain after this call, the arguments of one call)``."""

    def call(self, args: tuple) -> np.ndarray:
        """One compiled call (blocking); keeps the new state, returns the K losses."""

    def neutral(self) -> dict[str, dict[str, np.ndarray]]:
        """The state it holds now, as the comparison reads it."""

    def forward(self, args: tuple) -> np.ndarray:
        """The K losses of one call from a program of what they and its effects need; no state updated."""

    def shared(self, program: Any = None) -> Any:
        """Its compiled call, or ``program`` (another setup's of the same side) run instead."""


class Kind(Protocol):
    """What the suite asks of a port, answered by the object of its kind (``equivalence.core.kinds``)."""

    port: Port
    form: Form
    axis_name: str  # the pmap axis its step's collectives name

    def validate(self, config: Run) -> None: ...
    def new_ahead(self) -> Any: ...  # what builds the new side ahead (compiled on a thread), or None
    def first_step_probe(self) -> Any: ...  # recorder -> the first step's gradients compared, or None: not seen
    def draws_recorder(self) -> Any: ...  # records a twin's first call's draws (run.draws.FirstCall), or None
    def handed_dropout_keys(self) -> bool | None: ...  # the suite hands the model dropout keys; None: its step
    def recording_mesh(self, setup: Setup) -> Any: ...  # where the recording gathers a new side's values, or None
    def asked(self, asker: Any) -> Any: ...  # a command's question, by kind: asker.model_port() or .loop_port()
    def preflight(self, config: Run, variables: dict, batch_KxG: Any, mapping: dict) -> None: ...
    def legacy_preflight(self, config: Run, variables: dict, batch_KxG: Any) -> None: ...  # a recording's
    def new_preflight(self, config: Run, variables: dict, batch_KxG: Any, mapping: dict) -> None: ...
    def check_states(self, variables: dict, mapping: dict) -> None: ...
    def legacy_setup(self, config: Run, inputs: Any) -> Setup: ...
    def new_setup(self, config: Run, inputs: Any) -> Setup: ...
    def twin_setup(self, config: Run, inputs: Any, twin: Any, lr_scale: float | None = None) -> Setup: ...
    def legacy_accuracy(self, setup: Setup) -> float | None: ...  # held-out accuracy (eval_data), or None
    def new_accuracy(self, setup: Setup) -> float | None: ...
    def legacy_notes(self, setup: Setup) -> list[str]: ...
    def new_notes(self, setup: Setup) -> list[str]: ...
    def described(self) -> list[str]: ...
    def programs(self) -> tuple[str, str]: ...
    def new_side(self) -> str: ...
    def keys(self, config: Run) -> str: ...
    def loss_names(self) -> tuple[str, str]: ...
    def legacy_twin(self, config: Run, n: int, inputs: Any) -> tuple[Any, bool]: ...  # pmap side on n
    def recording(self) -> 'Kind': ...
    def key_draws_per_call(self, config: Run) -> int: ...
    def one_program_each(self, command: str) -> None: ...
