"""A loop port's two sides with its fused call, built: the team's own step under the suite's
``pmap(scan(step))`` (``adapters.legacy_step`` unwraps one already pmapped) and the team's ``new_call``
over the train state ``new_state`` builds, placed on the mesh; its twin is that same call on another mesh.
"""

import dataclasses
import functools
from typing import Any

import jax

from equivalence.core.port.plan import Run
from equivalence.core.port.ports import LoopPort
from equivalence.core.rng import randomness
from equivalence.core.run import abstract, adapters
from equivalence.core.run.facts import model_holding
from equivalence.core.run.setups import LegacySetup, LoopNewSetup, nnx_mesh, twin_placed_inputs
from equivalence.core.state import states
from equivalence.distributed import rows
from legacy_pmap import train as legacy
from nnx_sharded import sharding


def legacy_setup(port: LoopPort, config: Run, variables: dict, pstate: Any = None) -> LegacySetup:
    """The team's step under the suite's pmap(scan) over the first D devices, its state replicated (or ``pstate``:
    ``step_side.legacy_setup``'s)."""
    devices, local = jax.devices()[: config.devices], rows.local_devices(config.devices)
    if pstate is None:
        pstate = legacy.replicate(port.legacy_state(variables), local, port.axis_name)
    call = adapters.fused_call(port, devices)  # the pre-flight's (``preflight.trace``): JAX keeps its trace
    context = functools.partial(randomness.bridged, config.rng_mode, port.axis_name)
    return LegacySetup(call, pstate, config, port.legacy_groups or states.legacy_groups, context)


def new_source(port: LoopPort, variables: dict, mapping: dict) -> Any:
    """What a loop port's ``new_state`` takes: its NNX model holding linen's weights (named by ``mapping``),
    or, for a port without an NNX model, linen's variables (``new_side``)."""
    if port.nnx_model is None:
        return variables
    return model_holding(port, variables, mapping)


def new_train_state(port: LoopPort, variables: dict, mapping: dict, mesh) -> Any:
    """The team's new train state, built by ``new_state`` and placed on ``mesh`` (replicated), under the structure
    the pre-flight traced (``abstract.adopted``)."""
    return abstract.adopted(port, sharding.place_objects(port.new_state(new_source(port, variables, mapping)), mesh))


def new_setup(port: LoopPort, config: Run, variables: dict, mapping: dict) -> LoopNewSetup:
    mesh = nnx_mesh(config)
    return LoopNewSetup(port, new_train_state(port, variables, mapping, mesh), mesh, config)


@dataclasses.dataclass
class TwinLoopSetup(LoopNewSetup):
    """A loop port's twin: the user's own fused call on the twin mesh, keys of the checked run."""

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        return twin_placed_inputs(self, rng, batch_KxG)


def twin_setup(port: LoopPort, config: Run, variables: dict, mapping: dict, n: int) -> TwinLoopSetup:
    """The run's own new side on a 1-D data mesh of this process's first ``n`` devices (no collective)."""
    mesh = sharding.make_mesh(n, devices=jax.local_devices())
    return TwinLoopSetup(port, new_train_state(port, variables, mapping, mesh), mesh, config)
