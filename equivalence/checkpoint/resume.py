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
from equivalence.core import harness, kinds
from equivalence.core.port.config import ConfigError, RunConfig
from equivalence.core.port.ports import Port
from equivalence.core.run import adapters, setups, sides
from equivalence.core.verdict import judge
from legacy_pmap import checkpoints as legacy_checkpoints
from nnx_sharded import checkpoints as nnx_checkpoints

RECORDED = ('seed', 'batch_size', 'rng_mode', 'steps_per_call')  # what the data and key streams depend on


def record(config: RunConfig) -> dict:
    """What a checkpoint records beside the step so that a resumed run draws the same data and keys."""
    return {'workload': config.workload, 'devices': config.devices, **{k: getattr(config, k) for k in RECORDED}}


def check_record(meta: dict, config: RunConfig) -> None:
    """A run resumed with other data or keys than the checkpoint's would not continue its streams."""
    for key in RECORDED:
        if key in meta and meta[key] != getattr(config, key):
            raise ConfigError(f'the checkpoint was written with {key} {meta[key]}, this run has {getattr(config, key)}')
    if config.rng_mode == 'per-device' and meta.get('devices', config.devices) != config.devices:
        raise ConfigError(
            f'the checkpoint was written on {meta["devices"]} devices and per-device keys depend on the count: '
            f'resume on {meta["devices"]} devices, or run with --rng global'
        )


def saver(package, state_of: Callable, directory: str, config: RunConfig, every: int, **keep) -> Callable:
    """A harness ``after_call`` hook that saves every ``every`` calls through ``package``'s
    ``checkpoints`` module, as a training loop does."""
    manager = package.make_manager(directory, **keep)

    def after_call(setup, calls_done: int, rng: jax.Array) -> None:
        if calls_done % every == 0:
            with store.quiet():  # orbax warns that the key item has no per-process OCDBT files to merge
                package.save(manager, calls_done * config.steps_per_call, state_of(setup), rng, record(config))

    return after_call


def legacy_saver(directory: str, config: RunConfig, every: int, keep: int | None = None, preserve=()) -> Callable:
    """Saves the replicated state the pmap loop carries (``save`` unreplicates it)."""
    return saver(legacy_checkpoints, lambda setup: setup.pstate, directory, config, every, keep=keep, preserve=preserve)


def nnx_saver(directory: str, config: RunConfig, every: int, keep: int | None = None, preserve=()) -> Callable:
    """Saves the NNX train state the setup trains, as its sharded arrays."""
    state_of = lambda setup: nnx_checkpoints.state_dict(layout.view(setup))  # noqa: E731
    return saver(nnx_checkpoints, state_of, directory, config, every, keep=keep, preserve=preserve)


def restorer(directory: str, config: RunConfig, step: int | None = None, chain=None) -> Callable[[Any], jax.Array]:
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


@dataclasses.dataclass
class LegacyRun:
    """The uninterrupted legacy run, and what NNX needs to resume beside it."""

    result: sides.PathResult
    directory: str  # its checkpoints
    variables: dict  # the linen initialisation both paths start from
    calls: list  # every call's batch, [K, G, ...]
    rng: jax.Array  # the host key chain before the first call


def train_legacy(port: Port, config: RunConfig, options: CheckpointOptions, directory: str, progress=None) -> LegacyRun:
    """All K x C legacy steps, saving every ``save_every`` calls into ``directory`` (the step
    NNX resumes from is kept whatever ``keep`` says)."""
    variables, calls, rng = setups.make_inputs(port, config)
    setups.check_names(port, variables)
    preserve = [options.resume_at] if options.resume_at else []
    hook = legacy_saver(directory, config, options.save_every(config), options.keep, preserve)
    result = sides.run_legacy(kinds.of(port), config, variables, calls, rng, progress or sides.silent, after_call=hook)
    return LegacyRun(result, directory, variables, calls, rng)


def resume_nnx(port: Port, config: RunConfig, legacy: LegacyRun, nnx_dir: str, step: int, progress=None):
    """NNX restored from ``nnx_dir``'s ``step`` onto ``config.devices`` devices, trained on the
    calls after it, and compared with the legacy run's end."""
    after = legacy.calls[step // config.steps_per_call :]
    kind = kinds.of(port)
    draws = kind.key_draws_per_call(config)
    chain = lambda: adapters.chain_at(draws, config, legacy.rng, step // config.steps_per_call)  # noqa: E731
    restore = restorer(nnx_dir, config, step, chain)
    new = sides.run_nnx(kind, config, legacy.variables, after, None, progress or sides.silent, restore=restore)
    inputs = (legacy.variables, after, None)  # the twin restores the same checkpoint, trains the same calls
    return compare_paths(port, config, legacy.result, new, step, inputs, restore=restore)


def run(port: Port, config: RunConfig, options: CheckpointOptions, progress=None, nnx_devices: int | None = None):
    """Both paths with legacy checkpoints; with ``resume_at``, NNX resumes from the migrated one
    (on ``nnx_devices`` devices, default the run's) and is compared with legacy's last step."""
    from equivalence.core import preflight

    harness.validate(port, config)
    options.check(config)
    preflight.check(kinds.of(port), config)
    with _root(options.directory) as root:
        legacy = train_legacy(port, config, options, os.path.join(root, 'legacy'), progress)
        n, note = (
            options.resume_at,
            f'legacy checkpoints every {options.save_every(config)} call(s) in {legacy.directory}',
        )
        if n is None:
            kind, calls = kinds.of(port), legacy.calls
            new = sides.run_nnx(kind, config, legacy.variables, calls, legacy.rng, progress or sides.silent)
            inputs = (legacy.variables, legacy.calls, legacy.rng)
            return compare_paths(port, config, legacy.result, new, 0, inputs, notes=[note])
        nnx_dir = os.path.join(root, 'nnx')
        migration = migrate.migrate(legacy.directory, nnx_dir, port, step=n)
        nnx_config = dataclasses.replace(config, devices=nnx_devices or config.devices)
        result = resume_nnx(port, nnx_config, legacy, nnx_dir, n, progress)
        result.config = config
        result.notes.append(
            f'legacy pmap trained {config.steps} steps without stopping and saved its train state at step {n} '
            f'(Orbax, {legacy.directory}); migrated {len(migration.pairs)} leaves to {nnx_dir}; NNX restored it '
            f'onto {nnx_config.devices} device(s) and trained steps {n + 1}-{config.steps}'
        )
        return result


def compare_paths(
    port: Port, config: RunConfig, old, new, resumed_at: int, inputs: tuple, notes=None, restore=None
) -> judge.RunResult:
    """The usual judgement (``judge.judged``: the twin's measured floor); legacy's losses, metrics
    and per-call parameters cut to the steps NNX ran. ``inputs``: NNX's (variables, calls, rng);
    ``restore``: the hook NNX resumed through, which the twin resumes through too."""
    first_call = resumed_at // config.steps_per_call
    cut = {p: a[resumed_at:] for p, a in old.metrics.items()}
    old = dataclasses.replace(
        old, losses=old.losses[resumed_at:], params_per_call=old.params_per_call[first_call:], metrics=cut
    )
    kind = kinds.of(port)
    tree, lines = sides.compared(kind, old, new)
    result = judge.judged(kind, config, old, new, *inputs, tree, restore=restore, first_call=first_call)
    result.programs = kind.programs()
    result.resumed_at, result.notes = resumed_at, [*lines, *(notes or [])]
    return result
