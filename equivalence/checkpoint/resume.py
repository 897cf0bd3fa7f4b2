"""The proof behind ``python -m equivalence.run --resume-at N``: NNX resumes from a migrated
legacy checkpoint and ends where legacy, trained without stopping, ends.

Legacy trains all K x C steps and, as a pmap-era loop did, saves its unreplicated train state
every ``--checkpoint-every`` calls (a real Orbax directory). The checkpoint of step N is
migrated by ``migrate.migrate``, the function the command calls, and NNX restores it straight
onto its mesh and trains the steps after N. The data continue at step N (the harness cuts
the same stream) and the keys at the host key chain the checkpoint recorded; its record also
holds the seed, batch and RNG mode, checked before NNX resumes. The comparison is the usual
one, on the final states and on the losses of steps N+1 onwards.
"""

import contextlib
import dataclasses
import os
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import jax

from equivalence.checkpoint import layout, manifest, migrate, store
from equivalence.checkpoint.options import CheckpointOptions
from equivalence.core import harness
from equivalence.core.harness import Prepared, Resume
from equivalence.core.port.config import ConfigError, RunConfig
from equivalence.core.port.plan import Run
from equivalence.core.port.ports import Port
from equivalence.core.run import adapters, sides
from legacy_pmap import checkpoints as legacy_checkpoints
from nnx_sharded import checkpoints as nnx_checkpoints

RECORDED = ('seed', 'batch_size', 'rng_mode', 'steps_per_call')  # what the data and key streams depend on


def record(config: Run) -> dict:
    """What a checkpoint records beside the step so that a resumed run draws the same data and keys."""
    return {'workload': config.workload, 'devices': config.devices, **{k: getattr(config, k) for k in RECORDED}}


def check_record(meta: dict, config: Run) -> None:
    """A run resumed with other data or keys than the checkpoint's would not continue its streams."""
    for key in RECORDED:
        if key in meta and meta[key] != getattr(config, key):
            raise ConfigError(f'the checkpoint was written with {key} {meta[key]}, this run has {getattr(config, key)}')
    if config.rng_mode == 'per-device' and meta.get('devices', config.devices) != config.devices:
        raise ConfigError(
            f'the checkpoint was written on {meta["devices"]} devices and per-device keys depend on the count: '
            f'resume on {meta["devices"]} devices, or run with --rng global'
        )


def saver(package, state_of: Callable, directory: str, config: Run, every: int, **keep) -> Callable:
    """A harness ``after_call`` hook that saves every ``every`` calls through ``package``'s
    ``checkpoints`` module, as a training loop does."""
    manager = package.make_manager(directory, **keep)

    def after_call(setup, calls_done: int, rng: jax.Array) -> None:
        if calls_done % every == 0:
            with store.quiet():  # orbax warns that the key item has no per-process OCDBT files to merge
                package.save(manager, calls_done * config.steps_per_call, state_of(setup), rng, record(config))

    return after_call


def legacy_saver(directory: str, config: Run, every: int, keep: int | None = None, preserve=()) -> Callable:
    """Saves the replicated state the pmap loop carries (``save`` unreplicates it)."""
    return saver(legacy_checkpoints, lambda setup: setup.pstate, directory, config, every, keep=keep, preserve=preserve)


def nnx_saver(directory: str, config: Run, every: int, keep: int | None = None, preserve=()) -> Callable:
    """Saves the NNX train state the setup trains, as its sharded arrays."""
    state_of = lambda setup: nnx_checkpoints.state_dict(layout.view(setup))  # noqa: E731
    return saver(nnx_checkpoints, state_of, directory, config, every, keep=keep, preserve=preserve)


def restorer(directory: str, config: Run, step: int | None = None, chain=None) -> Callable[[Any], jax.Array]:
    """A harness ``restore`` hook: the NNX checkpoint read straight onto the setup's mesh and
    loaded into its train state; returns the key chain (``chain()`` when the checkpoint was
    migrated from a team's own, which records none). The target carries the placement the
    setup chose for each array (whatever the strategy), so the compiled call's shardings fit."""

    def restore(setup) -> jax.Array:
        train_state = layout.view(setup)
        target = jax.tree.map(placed_like, nnx_checkpoints.state_dict(train_state))
        with store.quiet():
            manifest.verify(directory, step=step, required=False)  # a changed byte is exit 2, before it trains
        state, rng, meta = store.read_nnx(directory, target, step)
        check_record(meta, config)
        if meta.get('rng_recorded') is False and chain is not None:
            rng = chain()
        nnx_checkpoints.load_into(train_state, state)
        setup.restored(train_state)
        return rng

    return restore


def placed_like(x: jax.Array) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)


@contextlib.contextmanager
def _root(directory: str | None) -> Iterator[str]:
    if directory is not None:
        yield directory
        return
    with tempfile.TemporaryDirectory(prefix='equivalence-checkpoints-') as tmp:
        yield tmp


@dataclasses.dataclass(frozen=True)
class Checkpoints:
    """``harness.Checkpoints`` for ``run``'s checkpoint flags: the legacy side saves as a pmap-era loop did,
    and with ``resume_at`` the new side resumes from the migrated checkpoint (on ``nnx_devices`` devices,
    default the run's)."""

    options: CheckpointOptions
    nnx_devices: int | None = None

    @contextlib.contextmanager
    def session(self, prepared: Prepared) -> Iterator['Session']:
        with _root(self.options.directory) as root:  # the twins restore from it while the verdict runs
            yield Session(self, prepared.run, root)


@dataclasses.dataclass
class Session:
    """One check's checkpoints: where they are, the legacy saver, the migration and the resume."""

    checkpoints: Checkpoints
    config: Run
    root: str
    notes: list = dataclasses.field(default_factory=list)

    def __post_init__(self):
        options = self.checkpoints.options
        self.directory = os.path.join(self.root, 'legacy')
        preserve = [options.resume_at] if options.resume_at else []
        every = options.save_every(self.config)
        self.after_legacy_call = legacy_saver(self.directory, self.config, every, options.keep, preserve)
        if options.resume_at is None:
            self.notes.append(f'legacy checkpoints every {every} call(s) in {self.directory}')

    def resume(self, prepared: Prepared, legacy: sides.PathResult) -> Resume | None:
        """The legacy checkpoint of ``resume_at`` migrated (``migrate.migrate``, the command's function) and
        the new side's restore from it; None without ``resume_at``."""
        n, config = self.checkpoints.options.resume_at, self.config
        if n is None:
            return None
        nnx_dir = os.path.join(self.root, 'nnx')
        migration = migrate.migrate(self.directory, nnx_dir, prepared.kind.port, step=n)
        nnx_config = dataclasses.replace(config, devices=self.checkpoints.nnx_devices or config.devices)
        note = (f'legacy pmap trained {config.steps} steps without stopping and saved its train state at step {n} '
                f'(Orbax, {self.directory}); migrated {len(migration.pairs)} leaves to {nnx_dir}; NNX restored it '
                f'onto {nnx_config.devices} device(s) and trained steps {n + 1}-{config.steps}')  # fmt: skip
        restore = restorer(nnx_dir, nnx_config, n, key_chain(prepared, nnx_config, n))
        return Resume(n, nnx_config, restore, (note,))


def key_chain(prepared: Prepared, config: Run, step: int):
    """The host key chain at ``step``, recomputed from the seed as the setups draw it: for a checkpoint
    that records none (a team's own)."""
    draws = prepared.kind.key_draws_per_call(config)
    return lambda: adapters.chain_at(draws, config, prepared.inputs.rng, step // config.steps_per_call)


def run(port: Port, config: RunConfig, options: CheckpointOptions, progress=None, nnx_devices: int | None = None,
        say=None):  # fmt: skip
    """``harness.run`` with legacy checkpoints; with ``resume_at``, NNX resumes from the migrated one."""
    return harness.run(port, config, progress, checkpoints=Checkpoints(options, nnx_devices), say=say)
