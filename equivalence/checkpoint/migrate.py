"""A legacy checkpoint -> an NNX train state checkpoint, leaf by leaf, through the port's names.

The legacy train state is read (typed, so optax's namedtuples stay namedtuples), its groups
are taken as the comparison takes them (``params``, ``opt_state``, ``model_state``, ``ema``,
``step``), its linen paths are renamed by the same mapping the port check uses
(``naming.resolve`` through ``facts.name_mapping``, then ``naming.rename_path``), and each
leaf is placed where ``nnx_sharded.train.TrainState`` keeps it:

    params/<linen path>                 -> model/<nnx path>
    model_state/batch_stats/<path>      -> model/<nnx path>
    ema/<linen path>                    -> ema/<nnx path>
    opt_state/<...>/<linen path>        -> optimizer/opt_state/<...>/<nnx path>
    step/step                           -> optimizer/step

Every NNX leaf must receive exactly one legacy leaf of the same shape and dtype (counters may
change integer type when every value fits: NNX counts steps in uint32, the linen state in
int32), or nothing is written. Values are copied, never recomputed: the conversion is lossless.
"""

import dataclasses
import os
import shutil
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from equivalence.checkpoint import layout, manifest, store
from equivalence.checkpoint.store import CheckpointError
from equivalence.core import kinds
from equivalence.core.port import naming
from equivalence.core.port.ports import Port
from equivalence.core.run import facts
from equivalence.core.state import convert
from legacy_pmap import checkpoints as legacy_checkpoints
from nnx_sharded import checkpoints as nnx_checkpoints

Spec = dict[str, tuple[tuple[int, ...], str]]  # path -> (shape, dtype)


@dataclasses.dataclass(frozen=True)
class Pair:
    legacy: str  # 'params/Dense_0/kernel', linen names
    nnx: str  # 'model/fc1/kernel', where the NNX train state keeps it
    shape: tuple[int, ...]
    legacy_dtype: str
    nnx_dtype: str


@dataclasses.dataclass
class Migration:
    """What was (or would be) converted, and what could not be."""

    legacy_dir: str
    nnx_dir: str
    step: int
    pairs: list[Pair]
    unmapped: list[str]  # 'legacy opt_state/... [3] float32: no NNX leaf optimizer/...', 'NNX ...: no legacy leaf'
    conflicts: list[str]  # a pair whose shapes or dtypes differ
    written: bool = False
    skipped: list[str] = dataclasses.field(default_factory=list)  # legacy leaves the port's skip= leaves behind
    manifest: str | None = None  # the sha256 manifest written beside the checkpoint

    def problem(self) -> str | None:
        bad = self.conflicts + self.unmapped
        if not bad:
            return None
        return (
            f'{len(bad)} leaves of {self.legacy_dir} step {self.step} could not be mapped, nothing written: ' + bad[0]
        )

    def lines(self) -> list[str]:
        """What the command prints: every pair, then a summary by group, then what was not mapped."""
        rows = [f'legacy checkpoint {self.legacy_dir} step {self.step} -> NNX train state checkpoint {self.nnx_dir}']
        rows.append(f'  {"legacy (linen names)":<44} {"NNX train state":<44} {"shape":<16} dtype')
        for p in self.pairs:
            dtype = p.legacy_dtype if p.legacy_dtype == p.nnx_dtype else f'{p.legacy_dtype} -> {p.nnx_dtype} (exact)'
            rows.append(f'  {p.legacy:<44} {p.nnx:<44} {str(list(p.shape)):<16} {dtype}')
        groups: dict[str, int] = {}
        for p in self.pairs:
            groups[p.legacy.split('/')[0]] = groups.get(p.legacy.split('/')[0], 0) + 1
        summary = ', '.join(f'{g} {n}' for g, n in groups.items())
        rows.append(f'mapped {len(self.pairs)} leaves ({summary}), with the host key chain and the step')
        rows.append('could not map: ' + ('; '.join(self.conflicts + self.unmapped) or 'nothing'))
        if self.skipped:
            rows.append("skipped, as the port's skip= says: " + '; '.join(self.skipped))
        if self.written:
            rows.append(f'wrote {self.nnx_dir} step {self.step}, sha256 of every leaf in {self.manifest}')
        return rows


class MigrationError(CheckpointError):
    """Leaves that do not map: exit 2, nothing written; the migration says what did map."""

    def __init__(self, migration: Migration):
        super().__init__(migration.problem())
        self.migration = migration


def migrate(legacy_dir: str, nnx_dir: str, port: Port, step: int | None = None, force: bool = False) -> Migration:
    """Convert the legacy checkpoint of ``step`` (default: the latest complete one) into an NNX
    train state checkpoint in ``nnx_dir``, which must not exist unless ``force``."""
    from equivalence.core import preflight

    _check_apart(legacy_dir, nnx_dir)
    _check_destination(nnx_dir, force)
    recorded = _refuse_nnx(legacy_dir, step)
    preflight.check_states(kinds.of(port))
    try:
        state, rng, meta = store.read_legacy(legacy_dir, _legacy_target(port), step)
    except store.StateMismatch as e:  # another workload's checkpoint: the one it records is named
        raise CheckpointError(f'{e}{_workload_hint(recorded, port)}') from None
    except CheckpointError as e:
        raise CheckpointError(str(e)) from None
    legacy_leaves, mapping, outside, skipped = _legacy_leaves(port, state)
    abstract = nnx_checkpoints.state_dict(nnx.eval_shape(layout.nnx_init(port)))
    places = layout.group_places(port)
    pairs, unmapped, conflicts = plan(legacy_leaves, nnx_checkpoints.spec(abstract), mapping, places)
    migration = Migration(legacy_dir, nnx_dir, int(meta['step']), pairs, outside + unmapped, conflicts, False, skipped)
    if migration.problem():
        raise MigrationError(migration)
    nnx_state = _fill(abstract, {p.nnx: _cast(legacy_leaves[p.legacy], p) for p in migration.pairs})
    if os.path.exists(nnx_dir) and jax.process_index() == 0:
        shutil.rmtree(nnx_dir)  # --force, checked above; only once everything mapped
    _together('equivalence-migrate-destination-checked')  # several processes: none writes before all checked
    manager = nnx_checkpoints.make_manager(nnx_dir)
    record = {**meta, 'migrated_from': os.path.abspath(legacy_dir)}
    rng = jax.random.PRNGKey(0) if rng is None else rng  # a team's checkpoint: the chain is recomputed on resume
    with store.quiet():
        nnx_checkpoints.save(manager, migration.step, nnx_state, rng, record)
    manager.close()
    pairs = {p.nnx: p.legacy for p in migration.pairs}
    if jax.process_index() == 0:  # several processes: one writer, the others wait for it below
        migration.manifest = manifest.write(nnx_dir, migration.step, legacy_dir, nnx_state, state, pairs)
    _together('equivalence-migrate-manifest-written')
    migration.written = True
    return migration


def _refuse_nnx(legacy_dir: str, step: int | None) -> dict | None:
    """An NNX checkpoint given as the legacy one (one migrate wrote, or an NNX run saved) is said to be
    one, not read as a legacy state that lacks every leaf. Returns the legacy checkpoint's meta (the
    suite's own layout), or None for a team's layout."""
    found = store.suite_record(legacy_dir, step)
    if found is None:
        return None
    step, names, meta = found
    signs = [f'migrated from {meta["migrated_from"]}'] if 'migrated_from' in meta else []
    if os.path.isfile(manifest.path(legacy_dir, step)):
        signs.append(f'it holds the {manifest.NAME} migrate writes')
    if {'model', 'optimizer'} <= names and 'params' not in names:
        signs.append(f"its state holds {', '.join(sorted(names))}: the NNX train state's layout")
    if signs:
        raise CheckpointError(
            f'{legacy_dir} step {step} is already an NNX checkpoint ({"; ".join(signs)}): nothing to migrate; '
            f'migrate reads a legacy (linen, pmap) one, and python -m equivalence.checkpoint verify {legacy_dir} '
            'checks this one'
        )
    return meta


def _workload_hint(meta: dict | None, port: Port) -> str:
    """The workload a legacy checkpoint's meta records (the suite's saves do: ``resume.record``), if not the port's."""
    from equivalence.core.port import workloads

    recorded = (meta or {}).get('workload')
    if not recorded or recorded == port.name:
        return ''
    flag = (
        f'--workload {recorded}'
        if recorded in workloads.WORKLOADS
        else f'the --workload of the port named {recorded!r}'
    )
    return f'; its meta records workload {recorded!r}, not {port.name!r}: pass {flag}'


def _check_apart(legacy_dir: str, nnx_dir: str) -> None:
    """``migrate`` never writes where it reads: not the same directory, not one inside the other."""
    source, target = os.path.realpath(legacy_dir), os.path.realpath(nnx_dir)
    if source == target:
        where = 'is the legacy checkpoint itself'
    elif target.startswith(source + os.sep):
        where = f'lies inside the legacy checkpoint {legacy_dir}'
    elif source.startswith(target + os.sep):
        where = f'holds the legacy checkpoint {legacy_dir}'
    else:
        return
    raise CheckpointError(f'NNX_DIR {nnx_dir} {where}: migrate never writes where it reads, --force or not; '
                          'choose another NNX_DIR')  # fmt: skip


def _together(name: str) -> None:
    """With several processes (a run migrating before it resumes), every one arrives here first."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _check_destination(nnx_dir: str, force: bool) -> None:
    if not os.path.exists(nnx_dir):
        return
    if not force:
        raise CheckpointError(f'{nnx_dir} exists; pass --force to replace it')
    if not os.path.isdir(nnx_dir) or any(not _is_step(name) for name in os.listdir(nnx_dir)):
        raise CheckpointError(
            f'{nnx_dir} holds files that are not Orbax checkpoints; not replacing it, even with --force'
        )


def _is_step(name: str) -> bool:
    """An Orbax step directory (``10``), finalised or not (``10.orbax-checkpoint-tmp-...``)."""
    return name.split('.', 1)[0].isdigit()


def _legacy_target(port: Port) -> Any:
    try:
        return legacy_checkpoints.abstract_state(layout.legacy_init(port))
    except Exception as e:  # noqa: BLE001 -- the user's port failed to build its state: say so in one line
        message = f'port {port.name!r}: building its legacy train state raised {type(e).__name__}: {e}'
        raise CheckpointError(message) from None


def _legacy_leaves(port: Port, state: Any) -> tuple[dict[str, np.ndarray], dict[str, str], list[str], list[str]]:
    """``{'params/Dense_0/kernel': array}`` by group, ``{linen path: nnx path}`` from the port check,
    and the leaves of the train state outside every group: unmapped, or skipped as the port says."""
    groups = layout.legacy_groups(port)(state)
    neutral = convert.groups_to_neutral({g: t for g, t in groups.items() if t is not None})
    variables = {'params': groups['params'], **(groups.get('model_state') or {})}
    mapping = facts.name_mapping(port, variables)  # naming.PortError: one line, exit 2
    leaves = {f'{g}/{p}': a for g, tree in neutral.items() for p, a in tree.items()}
    outside, skipped = outside_groups(state, groups, port.skip)
    return leaves, mapping, outside, skipped


def outside_groups(state: Any, groups: dict, skip: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Legacy leaves no group reads (flax's ``dynamic_scale``, a custom counter): each has no NNX
    place, so it is unmapped (exit 2) unless the port's ``skip=`` names it (or a field above it).
    A leaf is read when a group holds that very array (groups select fields, they do not copy)."""
    read = {id(leaf) for leaf in jax.tree.leaves(groups)}
    outside, skipped = [], []
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if id(leaf) in read:
            continue
        name = legacy_checkpoints.path_str(path)
        text = f'legacy {name} {list(np.shape(leaf))} {np.asarray(leaf).dtype}'
        if any(name == s or name.startswith(s + '/') for s in skip):
            skipped.append(text)
        else:
            outside.append(f"{text}: no group reads it, so it has no NNX place (name it in the port's skip=)")
    return outside, skipped


def nnx_path(legacy_path: str, mapping: dict[str, str], places: dict[str, str] | None = None) -> str:
    """Where the NNX train state keeps a legacy leaf (see the module docstring); with a port's
    ``nnx_groups=``, where its own train state keeps the leaf that group reads (``places``)."""
    group, _, path = legacy_path.partition('/')
    if places is not None:
        return places.get(f'{group}/{naming.rename_path(path, mapping)}', f'(no leaf of nnx_groups {legacy_path})')
    if group == 'step':
        return 'optimizer/step'
    if group == 'model_state':
        collection, _, path = path.partition('/')
        if collection != 'batch_stats':
            return legacy_path  # no place in an NNX model: reported as unmapped
        group = 'params'  # batch statistics live in the model, beside its parameters
    prefix = {'params': 'model', 'ema': 'ema', 'opt_state': 'optimizer/opt_state'}.get(group, group)
    return f'{prefix}/{naming.rename_path(path, mapping)}'


def plan(
    legacy: dict[str, np.ndarray], nnx_spec: Spec, mapping: dict[str, str], places=None
) -> tuple[list, list, list]:
    """``(pairs, unmapped, conflicts)``: every legacy leaf paired with its NNX leaf; what does
    not pair, or pairs with another shape or dtype, described in one phrase each."""
    pairs, unmapped, conflicts, taken = [], [], [], set()
    for path, value in legacy.items():
        target = nnx_path(path, mapping, places)
        shape, dtype = tuple(np.shape(value)), str(value.dtype)
        if target not in nnx_spec:
            unmapped.append(f'legacy {path} {list(shape)} {dtype}: no NNX leaf {target}')
            continue
        taken.add(target)
        nnx_shape, nnx_dtype = nnx_spec[target]
        if nnx_shape != shape or not _dtype_fits(dtype, nnx_dtype):
            conflicts.append(f'{path} {list(shape)} {dtype} vs NNX {target} {list(nnx_shape)} {nnx_dtype}')
        else:
            pairs.append(Pair(path, target, shape, dtype, nnx_dtype))
    unmapped += [f'NNX {p} {list(s)} {d}: no legacy leaf' for p, (s, d) in nnx_spec.items() if p not in taken]
    return pairs, unmapped, conflicts


def _dtype_fits(legacy_dtype: str, nnx_dtype: str) -> bool:
    """Same dtype; or two integer dtypes (a counter), checked value by value when cast."""
    same_kind = np.issubdtype(legacy_dtype, np.integer) and np.issubdtype(nnx_dtype, np.integer)
    return legacy_dtype == nnx_dtype or same_kind


def _cast(value: np.ndarray, pair: Pair) -> np.ndarray:
    value = np.asarray(value)
    out = value.astype(pair.nnx_dtype)
    if not np.array_equal(out.astype(value.dtype), value) or np.any((value < 0) != (out < 0)):
        raise CheckpointError(f'{pair.legacy}: its values do not fit NNX {pair.nnx} as {pair.nnx_dtype}')
    return out


def _fill(abstract: dict, values: dict[str, np.ndarray]) -> dict:
    """The NNX ``state_dict`` structure, with every leaf taken from ``values`` by path."""
    return jax.tree_util.tree_map_with_path(lambda path, _: values[nnx_checkpoints.path_str(path)], abstract)
