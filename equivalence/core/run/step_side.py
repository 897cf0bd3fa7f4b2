"""The setups of a loop port whose step is written as teams write it (``adapters``): the pmap side
runs ``adapters.legacy_program`` (pmap(step) K times, or pmap(scan(step))), the new side the team's
``new_call`` or its ``new_step`` K times; both read what the step returns through ``adapters.read_output``.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from equivalence.core.port import step_forms
from equivalence.core.port.plan import Run
from equivalence.core.port.ports import LoopPort
from equivalence.core.record import pruned
from equivalence.core.rng import randomness
from equivalence.core.run import abstract, adapters, setups
from equivalence.core.run.adapters import legacy_program, new_step_call, read_output, replica_outputs
from equivalence.core.run.pinned import pinned_to_its_mesh
from equivalence.core.state import new_side, states
from equivalence.distributed import rows
from legacy_pmap import train as legacy
from nnx_sharded import sharding
from nnx_sharded import train as sharded


@dataclasses.dataclass
class StepLegacySetup(setups.LegacySetup):
    """The pmap side of a loop port with a real step (``p_train_step`` is ``legacy_program``)."""

    port: LoopPort = None
    step: adapters.TwoOf = None  # the step its program runs: how many outputs after (state, out) it left out
    metrics: list = dataclasses.field(default_factory=list)  # per call: {metric path: [K, ...]}
    notes: list = dataclasses.field(default_factory=list)
    uneven: set = dataclasses.field(default_factory=set)  # metric paths that differ between devices

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        n, mode, k = self.config.devices, self.config.rng_mode, self.config.steps_per_call
        n_local, form = len(rows.positions(n)), step_forms.of(self.port)
        rng, keys = form.keys(legacy.next_call_keys, rng, n, mode, k)
        keys = None if keys is None else rows.local_keys(form.legacy_keys(keys), n)  # [D, 2] or [D, K, 2]
        batch_nxK = jax.tree.map(lambda v: legacy.shard_batch(v, n_local), batch_KxG)
        return rng, (self.pstate, batch_nxK, keys)

    def call(self, args: tuple) -> np.ndarray:
        with self.context():
            self.pstate, out_nxK = self.p_train_step(*args)
        out_K, uneven = replica_outputs(out_nxK)
        losses_K, metrics = read_output(self.port, out_K)
        self.metrics.append(metrics)
        self.uneven.update(uneven)
        why = "differs between pmap devices (no pmean or psum in the step): the pmap side's value is not global"
        self.notes[:] = [states.Uncompared(f'metrics/{p}', states.Skip.PER_DEVICE, why) for p in sorted(self.uneven)]
        self.notes += adapters.unread('legacy_step', self.step.extra if self.step else 0)
        return losses_K

    def forward(self, args: tuple) -> np.ndarray:
        """The K losses alone (``setups.LegacySetup.forward``); the state is not updated."""
        with self.context():
            out_nxK = pruned.call(pruned.traceable(self.p_train_step), args, pruned.LOSSES, self.ready)
        return read_output(self.port, replica_outputs(out_nxK)[0])[0]


def legacy_setup(port: LoopPort, config: Run, variables: dict, pstate: Any = None) -> StepLegacySetup:
    """The pmap side, its state linen's ``variables`` replicated; or ``pstate`` (``abstract.replicas``: the setup
    the pre-flight traces the run's own program with)."""
    devices, local = jax.devices()[: config.devices], rows.local_devices(config.devices)
    if pstate is None:
        pstate = legacy.replicate(port.legacy_state(variables), local, port.axis_name)
    context = lambda: randomness.bridged(config.rng_mode, port.axis_name)  # noqa: E731
    groups = port.legacy_groups or states.legacy_groups
    one = adapters.one_step(port)
    return StepLegacySetup(legacy_program(port, devices, one), pstate, config, groups, context, port, one)


# -- the NNX side ------------------------------------------------------------------------------


@dataclasses.dataclass
class StepNewSetup(setups.LoopNewSetup):
    """The NNX side of a loop port with a real step: the user's fused call, or their one step K times."""

    metrics: list = dataclasses.field(default_factory=list)
    notes: list = dataclasses.field(default_factory=list)  # what its step returned that is not read (adapters.unread)

    def call_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        form = step_forms.of(self.port)
        return form.program(lambda: setups.placed_inputs(self, rng, batch_KxG), lambda: self._step_args(rng, batch_KxG))

    def _step_args(self, rng, batch_KxG) -> tuple[jax.Array, tuple]:
        """A call's arguments where the key chain is not the call's carry: a key per step, or none."""
        n, mode, k = self.config.devices, self.config.rng_mode, self.config.steps_per_call
        rng, keys = step_forms.of(self.port).keys(sharded.next_call_keys, rng, n, mode, k)
        if self.port.new_step is None:  # the user's fused call: one key per step, stacked
            stacked = None if keys is None else sharding.put(jnp.stack(keys), sharding.replicated(self.mesh))
            return rng, (stacked, sharding.place_batch(batch_KxG, self.mesh))
        rows_ = NamedSharding(self.mesh, P(sharding.DATA))
        batches = [jax.tree.map(lambda v, i=i: sharding.put(v[i], rows_), batch_KxG) for i in range(k)]
        placed = [None] * k if keys is None else [sharding.place_keys(key, self.mesh, mode) for key in keys]
        return rng, (placed, batches)

    def call(self, args: tuple) -> np.ndarray:
        with randomness.bridged(self.config.rng_mode):
            with pinned_to_its_mesh(self.port, self.mesh):
                out_K = self._fused(*args) if self.port.new_step is None else self._steps(*args)
        losses_K, metrics = read_output(self.port, jax.tree.map(np.asarray, out_K))
        self.metrics.append(metrics)
        return losses_K

    def forward(self, args: tuple) -> np.ndarray:
        """The K losses alone (``setups.LoopNewSetup.forward``)."""
        out = self.forward_outputs(args)
        if self.port.new_step is not None:  # one output a step
            out = jax.tree.map(lambda *a: np.stack(a), *out)
        return read_output(self.port, jax.tree.map(np.asarray, out))[0]

    def _fused(self, keys, batch_KxG):
        self.train_state, out_K = self.port.new_call(self.train_state, keys, batch_KxG)
        return out_K

    def _steps(self, keys: list, batches: list):
        outs, step = [], new_step_call(self.port)
        for key, batch in zip(keys, batches, strict=True):
            self.train_state, out, extra = adapters.state_and_out(step(self.train_state, batch, key), self.train_state)
            self.notes[:] = adapters.unread('new_step', extra, 'new')
            outs.append(jax.tree.map(np.asarray, jax.block_until_ready(out)))
        return jax.tree.map(lambda *a: np.stack(a), *outs)

    def as_pure_call(self) -> tuple[Callable, Any]:
        """``(jax.jit(call over split state), typed state)``, as ``LoopNewSetup``'s, of the new step run K
        times in one function where the port gives ``new_step`` (what ``draws.alone`` traces)."""
        if self.port.new_step is None:
            return super().as_pure_call()
        objects = new_side.form(self.train_state) != new_side.PYTREE
        graphdef, state = nnx.split(self.train_state) if objects else (None, self.train_state)
        step, rng_mode = new_step_call(self.port), self.config.rng_mode

        def pure(state, keys: list, batches: list):
            ts, outs = nnx.merge(graphdef, state) if objects else state, []
            with randomness.bridged(rng_mode):
                for key, batch in zip(keys, batches, strict=True):
                    ts, out, _ = adapters.state_and_out(step(ts, batch, key), ts)
                    outs.append(out)
            return (nnx.state(ts) if objects else ts), outs

        return jax.jit(pure, keep_unused=True), state


def new_setup(port: LoopPort, config: Run, source: Any, mesh) -> StepNewSetup:
    """``source``: what ``new_state`` takes (``loop_side.new_source``: the NNX model, or linen's variables); its
    train state under the structure the pre-flight traced (``abstract.adopted``)."""
    return StepNewSetup(
        port, abstract.adopted(port, sharding.place_objects(port.new_state(source), mesh)), mesh, config
    )
