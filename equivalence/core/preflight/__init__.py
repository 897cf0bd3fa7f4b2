"""Pre-flight: every port traced abstractly before anything trains, so that a mistake in the
port is one line (exit 2) in seconds, not an internal error after the legacy run.

What runs is what the harness will run (the kind's ``legacy_setup`` / ``new_setup``), traced with
``jax.eval_shape`` on abstract inputs of the run's real shapes (the linen variables, both train
states, one call's keys and batch); only ``make_data`` runs for real, since its arrays are
what is checked. Found here, each named with the port field, the user's file:line, expected
against given and the fix where one is known:

- ``make_data``: a generator, non-array or object leaves, leading axes other than
  ``[n_steps, global_batch]`` (``[batch, steps]`` named as such), ragged leaves;
- ``init_args``, ``init_kwargs``, ``legacy_model``, ``nnx_model``: what building and initialising them raises;
- a loop port's step in a real form (``step_form``, ``new_step``, ``loss``): one step of each side
  as ``adapters`` calls it (``preflight/steps.py``): ``(state, out)``, the ``loss`` reader;
- ``legacy_step`` / ``new_call`` (a loop port) or ``legacy_loss`` / ``nnx_loss`` / ``noise`` /
  ``make_tx`` (a model port): signatures, return structures, carries that change structure,
  unbound axis names, loss shapes;
- ``legacy_state`` / ``new_state`` and their groups: train states the comparison cannot read
  (no ``params`` and ``opt_state`` found by name without ``legacy_groups=``, a new train state of
  no known form without ``new_groups=``), and groups of another shape than it reads
  (``preflight/shapes.py``: ``step`` is ``{'step': x}``). A pytree train state (``new_side``) is
  traced as it is, never split.
"""

from typing import Any

import jax
import numpy as np

from equivalence.core.port import blame
from equivalence.core.port.kind import Kind
from equivalence.core.port.plan import Run
from equivalence.core.preflight.data import abstract_variables, check_names, check_recordable, make_data
from equivalence.core.preflight.errors import PreflightError, blamed, line
from equivalence.core.run import facts

__all__ = ['PreflightError', 'blamed', 'check', 'check_legacy', 'check_new', 'check_states', 'line']


def check(kind: Kind, config: Run, n_steps: int | None = None, variables: dict | None = None) -> dict[str, str]:
    """Everything a run of ``kind``'s port under ``config`` will trace, traced abstractly; raises
    ``PreflightError`` (exit 2) on the first mistake. ``n_steps``: the steps ``make_data`` is
    asked for (default the run's, ``config.steps``). What is traced is the kind's (``kind.preflight``).
    ``variables``: linen's variables, shapes only, where the run's own initialisation traced them already
    (``run.inputs.Start.shapes``), else traced here. Returns the two sides' names paired (linen leaf path ->
    NNX leaf path), which the run keeps."""
    port = kind.port
    blame.set_port(port)
    n_steps = config.steps if n_steps is None else n_steps
    data = make_data(port, config.seed, n_steps, config.batch_size, f'--calls x --steps-per-call = {n_steps}')
    variables = abstract_variables(port, data, variables)
    mapping = check_names(port, variables)
    kind.preflight(config, variables, _one_call(data, config), mapping)
    return mapping


def check_legacy(kind: Kind, config: Run) -> None:
    """The pmap side's half of ``check``, all that ``record`` can trace (where the pmap code runs, the new side
    need not import): ``make_data``, the linen init, the legacy step or losses, the legacy train state's groups.
    The port's facts are read from its linen model (``facts.linen_alone``), as the recording reads them."""
    port = kind.port
    blame.set_port(port)
    data = make_data(port, config.seed, config.steps, config.batch_size, f'--calls x --steps-per-call = {config.steps}')
    check_recordable(port, data)  # its batches, as the reference will hold them
    variables = abstract_variables(port, data)
    with facts.linen_alone(port, data):
        kind.legacy_preflight(config, variables, _one_call(data, config))


def check_new(kind: Kind, config: Run, variables: dict, batch_KxG: Any, mapping: dict) -> None:
    """The new side's half of ``check``, against the pmap side a reference holds: its ``variables`` and one
    call's batch (concrete or abstract), its names already paired (``mapping``)."""
    blame.set_port(kind.port)
    shapes = lambda tree: jax.tree.map(lambda v: jax.ShapeDtypeStruct(np.shape(v), v.dtype), tree)  # noqa: E731
    kind.new_preflight(config, shapes(variables), batch_KxG, mapping)  # arrays: traced as the run's call takes them


def _one_call(data: Any, config: Run) -> Any:
    """The first call's batch ``[K, G, ...]`` of ``data`` ``[n_steps, G, ...]``: the arrays the run's own first call
    is given, which the traces read as shapes (and the pre-flight of the run's own programs places as the run does,
    ``run.abstract``)."""
    return jax.tree.map(lambda v: v[: config.steps_per_call], data)


def check_states(kind: Kind) -> None:
    """What ``checkpoint migrate`` builds of a port (its data of one example, both train states and
    their groups), checked abstractly; nothing is traced beyond that (``kind.check_states``)."""
    port = kind.port
    blame.set_port(port)
    data = make_data(port, 0, 1, 1, '1 (checkpoint layout)')
    variables = abstract_variables(port, data)
    kind.check_states(variables, check_names(port, variables))
