"""``python -m equivalence.explain``: what XLA compiled for one fused call of each path.

It answers three questions from the compiled programs, not from the source: is the model
replicated on every device, does each device run the forward pass on its own slice of the
batch, and how are gradients combined when the NNX code has no ``pmean``. Nothing is
trained: each path's fused call is lowered and compiled once, then read.

Counting: a collective inside the scan's while loop runs K times per call; per step is
per call / K. Bytes are the payload each device puts in (operand sizes), per device.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from equivalence.explain import hlo

COUNTING = (
    'one compiled call of K fused steps; a collective inside the scan loop runs K times per call '
    '(XLA records the trip count); per step = per call / K; bytes = the operands each device puts in, '
    'per device (a ring all-reduce sends about 2(D-1)/D times that over the wire)'
)
MOVERS = ('all-gather', 'all-to-all', 'collective-permute')  # collectives that move data, not sums
QUESTIONS = {
    'replicated': 'Is the model replicated on every device?',
    'own_slice': 'Does each device run the forward pass on its own slice of the batch?',
    'gradients': 'How are the gradients combined?',
}


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one input of the compiled call lives, from the call's own input shardings."""

    group: str  # 'keys', 'params', 'opt_state', 'ema', 'model_state', 'step', 'batch'
    name: str  # e.g. 'params/hidden/kernel', 'model/hidden/kernel', 'x'
    shape: tuple[int, ...]  # of the array the call takes
    dtype: str
    spec: tuple  # the PartitionSpec's entries, e.g. (None, 'data'); () when replicated
    mesh: dict[str, int]  # mesh axis -> size
    devices: int  # devices holding a piece of it
    shard_shape: tuple[int, ...]  # what one device holds
    stacked: bool  # pmap state: axis 0 stacks one copy per device, so a device's slice is a whole copy
    example_axes: tuple[int, ...] = ()  # batch leaves: the axes that index examples ([D, K, B]: 0 and 2)
    sharding: Any = dataclasses.field(default=None, compare=False, repr=False)

    @property
    def logical_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.stacked else self.shape

    @property
    def per_device_shape(self) -> tuple[int, ...]:
        return self.shard_shape[1:] if self.stacked else self.shard_shape

    @property
    def full_copy(self) -> bool:
        """Every device holds all of the leaf."""
        return _size(self.per_device_shape) == _size(self.logical_shape)

    @property
    def pieces(self) -> int:
        """Distinct pieces the leaf is cut into: 1 when every device holds a whole copy."""
        return _size(self.logical_shape) // max(_size(self.per_device_shape), 1)

    @property
    def shard_bytes(self) -> int:
        return _size(self.shard_shape) * _itemsize(self.dtype)

    @property
    def rows_per_device(self) -> int:
        return _size(tuple(self.shard_shape[a] for a in self.example_axes))

    @property
    def global_rows(self) -> int:
        return _size(tuple(self.shape[a] for a in self.example_axes))

    def spec_text(self) -> str:
        return 'PartitionSpec(' + ', '.join(repr(s) for s in self.spec) + ')'


@dataclasses.dataclass(frozen=True)
class PathMeasurement:
    """Everything measured about one path's compiled call; the answers read only this."""

    path: str  # 'legacy' or 'nnx'
    title: str
    program: str  # HLO module header and how the call was traced
    devices: int  # D
    steps_per_call: int  # K
    collectives: tuple[hlo.Collective, ...]  # every one in the program
    placements: tuple[Placement, ...]
    memory: dict[str, int]  # per device, from compiled.memory_analysis()
    copies_spread: float | None  # max |copy on device d - copy on device 0| over full-copy parameters


def _size(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


KEY_BYTES = {'key<fry>': 8, 'key<rbg>': 16, 'key<unsafe_rbg>': 16}  # typed PRNG keys: their uint32 words


def _itemsize(dtype: str) -> int:
    return KEY_BYTES[dtype] if dtype in KEY_BYTES else np.dtype(dtype).itemsize


def per_step(c: hlo.Collective, k: int) -> float | None:
    """Executions of collective ``c`` per training step."""
    return None if c.per_call is None else c.per_call / k


def bytes_per_step(c: hlo.Collective, k: int) -> float | None:
    return None if c.per_call is None else c.per_call * c.bytes / k


def totals(m: PathMeasurement) -> dict[str, dict[str, float | None]]:
    """Per kind: executions and payload bytes per step (None if a loop's trip count is unknown)."""
    out = {}
    for c in m.collectives:
        t = out.setdefault(c.kind, {'count_in_program': 0, 'per_step': 0.0, 'bytes_per_step': 0.0})
        t['count_in_program'] += 1
        for key, value in (
            ('per_step', per_step(c, m.steps_per_call)),
            ('bytes_per_step', bytes_per_step(c, m.steps_per_call)),
        ):
            t[key] = None if value is None or t[key] is None else t[key] + value
    return out


def gradient_operands(m: PathMeasurement) -> list[tuple[hlo.Collective, hlo.Operand]]:
    """``(collective, operand)`` for every operand made by the backward pass."""
    return [(c, o) for c in m.collectives for o in c.operands if o.role == 'gradient']


# -- measuring (imports JAX: called after the CLI has set up devices) -------------------------

LEGACY_GROUPS = {  # train state field -> group (the suite's TrainState, and the usual names of a user's)
    'step': 'step',
    'params': 'params',
    'opt_state': 'opt_state',
    'model_state': 'model_state',
    'batch_stats': 'model_state',
    'params_ema': 'ema',
    'ema_params': 'ema',
    'ema': 'ema',
}


def _legacy_leaf(keys: tuple[str, ...], kind: str) -> tuple[str, str]:
    """``((keys_D, pstate), batch_DxK)`` -> ``(group, name)``."""
    if keys[0] == '1':
        return 'batch', '/'.join(keys[1:])
    if keys[1] == '0':
        return 'keys', 'keys'
    return LEGACY_GROUPS.get(keys[2], 'other'), '/'.join(keys[2:])


def _nnx_leaf(keys: tuple[str, ...], kind: str) -> tuple[str, str]:
    """``((keys, state), batch_KxG)`` -> ``(group, name)``; ``kind`` is the NNX Variable type."""
    if keys[0] == '1':
        return 'batch', '/'.join(keys[1:])
    if keys[1] == '0':
        return 'keys', 'keys'
    rest = keys[2:]
    if rest[0] == 'model':
        return ('params' if kind == 'Param' else 'model_state'), '/'.join(rest)
    if rest[0] == 'ema':
        return 'ema', '/'.join(rest)
    return ('step' if rest == ('optimizer', 'step') else 'opt_state'), '/'.join(rest)


def _nnx_loop_leaf(keys: tuple[str, ...], kind: str) -> tuple[str, str]:
    """A loop port's ``(state, keys, batch_KxG)`` -> ``(group, name)``, by NNX Variable type."""
    if keys[0] == '2':
        return 'batch', '/'.join(keys[1:])
    if keys[0] == '1':
        return 'keys', 'keys'
    name = '/'.join(keys[1:])
    if kind == 'Param':
        return ('ema' if 'ema' in keys[1:-1] else 'params'), name
    if kind == 'BatchStat':
        return 'model_state', name
    if kind.startswith('Opt'):
        return ('step' if keys[-1] == 'step' else 'opt_state'), name
    return 'other', name


def key_name(entry) -> str:
    for attr in ('key', 'name', 'idx'):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flat_inputs(args: tuple, shardings: Any) -> list[tuple[tuple[str, ...], str, Any, Any]]:
    """``(path, NNX Variable type or '', array, sharding)`` for every input of the call."""
    import jax
    from flax import nnx

    is_var = lambda x: isinstance(x, nnx.Variable)
    flat, _ = jax.tree_util.tree_flatten_with_path(args, is_leaf=is_var)
    shards = jax.tree.leaves(shardings)
    if len(flat) != len(shards):
        raise ValueError(f'{len(flat)} inputs but {len(shards)} input shardings')
    out = []
    for (path, leaf), sharding in zip(flat, shards, strict=True):
        kind, array = (type(leaf).__name__, leaf[...]) if is_var(leaf) else ('', leaf)
        out.append((tuple(key_name(k) for k in path), kind, array, sharding))
    return out


@dataclasses.dataclass(frozen=True)
class Layout:
    """How one path lays out the inputs of its fused call."""

    path: str  # 'legacy' or 'nnx'
    title: str
    leaf: Callable  # (path keys, NNX Variable type) -> (group, name)
    stacks_state: bool  # pmap: every state leaf is [D, ...], one whole copy per device
    example_axes: tuple[int, ...]  # the axes of a batch array that index examples


LEGACY = Layout('legacy', 'legacy pmap(scan)', _legacy_leaf, True, (0, 2))  # batch [D, K, B, ...]
NNX = Layout('nnx', 'NNX sharded scan', _nnx_leaf, False, (1,))  # batch [K, G, ...]
NNX_LOOP = Layout('nnx', "the port's NNX call", _nnx_loop_leaf, False, (1,))


def placement(group: str, name: str, array: Any, sharding: Any, layout: Layout) -> Placement:
    shape = tuple(np.shape(array))
    if layout.stacks_state:  # pmap: each process passes [its devices, ...]; the program's input is [D, ...]
        shape = (len(sharding.device_set), *shape[1:])
    return Placement(
        group=group,
        name=name,
        shape=shape,
        dtype=str(array.dtype),
        spec=tuple(getattr(sharding, 'spec', ())),
        mesh={str(k): int(v) for k, v in getattr(getattr(sharding, 'mesh', None), 'shape', {}).items()},
        devices=len(sharding.device_set),
        shard_shape=tuple(sharding.shard_shape(shape)),
        stacked=layout.stacks_state and group not in ('batch', 'keys'),
        example_axes=layout.example_axes if group == 'batch' else (),
        sharding=sharding,
    )


def copies_spread(arrays: list[Any]) -> float | None:
    """Max |device d's copy - device 0's copy| over arrays whose devices each hold a whole copy."""
    spreads = []
    for a in arrays:
        shards = [np.asarray(s.data, np.float64).ravel() for s in getattr(a, 'addressable_shards', [])]
        if len(shards) > 1 and len({s.size for s in shards}) == 1:
            spreads.append(max(float(np.abs(s - shards[0]).max(initial=0.0)) for s in shards))
    return max(spreads) if spreads else None


def memory(compiled: Any) -> dict[str, int]:
    """Per device: the program each device runs is the partitioned one."""
    stats = compiled.memory_analysis()
    stats = stats[0] if isinstance(stats, list | tuple) else stats
    if stats is None:  # some backends report nothing
        return {}
    fields = {'arguments': 'argument', 'outputs': 'output', 'aliased': 'alias', 'temporaries': 'temp'}
    return {k: int(getattr(stats, f'{v}_size_in_bytes')) for k, v in fields.items()}


def measure(layout: Layout, compiled: Any, args: tuple, config: Any) -> PathMeasurement:
    """Reads the compiled call: its HLO text, input shardings and memory analysis."""
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
    )


def measure_legacy(setup: Any, args: tuple) -> PathMeasurement:
    """``setup``: ``harness.LegacySetup``; ``args``: one call's, from ``setup.call_args``."""
    with setup.context():  # a loop port's Dropout bridge, while tracing
        lowered = setup.p_train_step.lower(*args)
    return measure(LEGACY, lowered.compile(), args, setup.config)


def measure_nnx(setup: Any, args: tuple) -> PathMeasurement:
    """``setup``: ``harness.NnxSetup``, its state placed any way; ``args`` from ``setup.call_args``.

    The call carries the state as a plain dict of arrays; its leaves are named from the same
    arrays viewed as an ``nnx.State`` (same paths, same order), whose Variable types tell
    parameters from batch statistics.
    """
    from flax import nnx

    (keys, state), batch = args
    typed = nnx.state(nnx.merge(setup.graphdef, state))
    return measure(NNX, setup.fused.lower(*args).compile(), ((keys, typed), batch), setup.config)


def measure_nnx_loop(setup: Any, args: tuple) -> PathMeasurement:
    """``setup``: ``harness.NnxLoopSetup``: the user's call, lowered over its split state."""
    fn, state = setup.as_pure_call()
    inputs = (state, *args)
    return measure(NNX_LOOP, fn.lower(*inputs).compile(), inputs, setup.config)


def measure_both(port: Any, config: Any) -> tuple[PathMeasurement, PathMeasurement]:
    """One call of each path of a port (built-in or user's), compiled and read."""
    from equivalence.core import adapters, harness

    harness.validate(port, config)
    adapters.one_program_each(port, 'explain')
    variables, calls, rng = harness.make_inputs(port, config)
    harness.check_names(port, variables)
    legacy_setup = harness.legacy_setup(port, config, variables)
    _, legacy_args = legacy_setup.call_args(rng, calls[0])
    nnx_setup = harness.nnx_setup(port, config, variables)
    _, nnx_args = nnx_setup.call_args(rng, calls[0])
    measure_nnx_call = measure_nnx if isinstance(nnx_setup, harness.NnxSetup) else measure_nnx_loop
    return measure_legacy(legacy_setup, legacy_args), measure_nnx_call(nnx_setup, nnx_args)


# -- the three answers: pure functions of a PathMeasurement ------------------------------------


def _dims(shape: tuple[int, ...]) -> str:
    return '[' + ', '.join(map(str, shape)) + ']'


def _bytes(n: float) -> str:
    return f'{n:,.0f} B'


def answer_replicated(m: PathMeasurement) -> dict:
    params = [p for p in m.placements if p.group == 'params']
    if not params:
        return {'yes': False, 'why': 'no: the call takes no parameter leaves'}
    split = [p for p in params if not p.full_copy]
    total = sum(_size(p.logical_shape) * _itemsize(p.dtype) for p in params)
    held = sum(_size(p.per_device_shape) * _itemsize(p.dtype) for p in params)
    if split:
        named = '; '.join(
            f'{p.name} {_dims(p.logical_shape)} is {p.spec_text()}, {_dims(p.per_device_shape)} per device'
            for p in split
        )
        why = f'no: {len(split)} of {len(params)} parameter leaves are split over devices ({named}); '
        return {'yes': False, 'why': why + f'each device holds {_bytes(held)} of the {_bytes(total)} of parameters'}
    specs = ', '.join(sorted({p.spec_text() for p in params}))
    on = ', '.join(str(d) for d in sorted({p.devices for p in params}))
    if all(p.stacked for p in params):
        why = (
            f'yes, by copy: all {len(params)} parameter leaves are stacked [{m.devices}, ...] arrays, {specs} '
            f'on {on} devices, so each device holds one whole copy ({_bytes(held)})'
        )
    else:
        why = f'yes: all {len(params)} parameter leaves are {specs} on {on} devices: each holds all {_bytes(held)}'
    if m.copies_spread is not None:
        why += f'; copies checked: max |copy d - copy 0| = {m.copies_spread:g}'
    return {'yes': True, 'why': why}


def _moves_batch(m: PathMeasurement, batch: list[Placement]) -> list:
    """Data-moving collectives with an operand shaped like a device's batch, or one step of it."""
    shapes = {p.shard_shape for p in batch} | {p.shard_shape[1:] for p in batch}
    movers = [c for c in m.collectives if c.kind in MOVERS]
    return [c for c in movers if any(hlo.dims(o.shape) in shapes for o in c.operands)]


def answer_own_slice(m: PathMeasurement) -> dict:
    batch = [p for p in m.placements if p.group == 'batch']
    if not batch:
        return {'yes': False, 'why': 'no: the call takes no batch'}
    even = all(p.rows_per_device * m.devices == p.global_rows for p in batch)
    rows = sorted({(p.rows_per_device, p.global_rows) for p in batch})
    held = ', '.join(f'{p.name} {_dims(p.shape)} {p.spec_text()} -> {_dims(p.shard_shape)} per device' for p in batch)
    moved, movers = _moves_batch(m, batch), [c for c in m.collectives if c.kind in MOVERS]
    if moved:
        tail = 'but collectives move batch-shaped data between devices: ' + _listing(moved)
    elif movers:
        tail = 'the data-moving collectives carry no batch-shaped operand: ' + _listing(movers)
    else:
        tail = "the program has no all-gather, all-to-all or collective-permute, so no device reads another's examples"
    yes = even and not moved
    counts = ', '.join(f'{r} of {g}' for r, g in rows)
    return {
        'yes': yes,
        'why': f'{"yes" if yes else "no"}: each device holds {counts} examples per step ({held}); {tail}',
    }


def _listing(collectives: list) -> str:
    return ', '.join(f'{c.kind} of {" + ".join(o.shape for o in c.operands)}' for c in collectives)


def answer_gradients(m: PathMeasurement) -> dict:
    grads = gradient_operands(m)
    if not grads:
        return {'how': 'not combined', 'why': 'not combined: no collective carries a backward-pass result'}
    ops = list({id(c): c for c, _ in grads}.values())
    kinds = sorted({c.kind for c in ops})
    k = m.steps_per_call
    count = sum(per_step(c, k) or 0 for c in ops)
    size = sum(o.bytes * (c.per_call or 0) / k for c, o in grads)
    written = sorted({o.source or o.op_name for _, o in grads if o.written})
    inserted = [o for _, o in grads if not o.written]
    origin = (
        'inserted by XLA' if not written else 'written in the code' if not inserted else 'partly written, partly by XLA'
    )
    how = ' + '.join(kinds) + ' ' + origin
    why = f'by {" + ".join(kinds)}: {count:g} op(s) per step carry {len(grads)} gradient arrays '
    why += f'({_bytes(size)} per device)'
    if written:
        why += f'; written in the code (JAX op {grads[0][1].op_name.rsplit("/", 1)[-1]}) at ' + '; '.join(written)
    if inserted and not written:
        why += "; no collective in the code: XLA's SPMD partitioner inserted it to sum the partial gradients"
    elif inserted:
        why += f'; {len(inserted)} of them with no collective in the code, inserted by XLA'
    also = [o for c in ops for o in c.operands if o.role != 'gradient']
    if also:
        listed = ', '.join(f'{o.role} {o.shape}' + (f' ({o.source})' if o.source else '') for o in also)
        why += f'; the same op(s) also carry {listed}'
    return {'how': how, 'why': why}


STATE_GROUPS = ('params', 'opt_state', 'ema')  # what a strategy shards; the batch and keys are the data's


def state_bytes(m: PathMeasurement) -> dict[str, int]:
    """Bytes one device holds of each part of the train state, from the shard shapes."""
    return {g: sum(p.shard_bytes for p in m.placements if p.group == g) for g in STATE_GROUPS}


def sharded_kernels(m: PathMeasurement, axis: str) -> list[Placement]:
    return [p for p in m.placements if p.group == 'params' and axis in p.spec and p.name.endswith('kernel')]


def strategy_targets(legacy: PathMeasurement, nnx: PathMeasurement, config: Any) -> list[dict]:
    """The issue's memory targets, evaluated on the measured shard shapes (applies: 'n/a' otherwise)."""
    out = []
    mesh = nnx.placements[0].mesh if nnx.placements else {}
    dp, got = state_bytes(legacy), state_bytes(nnx)
    if config.strategy in ('fsdp', 'fsdp-tp') and mesh.get('data', 1) > 1:
        limit = (dp['params'] + dp['opt_state']) / mesh['data'] * 1.05
        value = got['params'] + got['opt_state']
        name = f"parameter + optimizer bytes per device <= 1/{mesh['data']} of pmap DP's + 5%"
        out.append({'name': name, 'value': value, 'limit': limit, 'pass': value <= limit})
    if config.strategy in ('tp', 'fsdp-tp') and mesh.get('model', 1) > 1:
        kernels = sharded_kernels(nnx, 'model')
        value = sum(p.shard_bytes for p in kernels)
        limit = sum(_size(p.shape) * _itemsize(p.dtype) for p in kernels) / mesh['model']
        name = f'bytes per device of the {len(kernels)} model-split kernels <= 1/{mesh["model"]} of whole'
        out.append({'name': name, 'value': value, 'limit': limit, 'pass': bool(kernels) and value <= limit})
    return out


def strategy_dict(legacy: PathMeasurement, nnx: PathMeasurement, config: Any, backend: str) -> dict:
    """What the strategy adds in communication and saves in memory, against the pmap DP run."""
    kinds = totals(nnx)
    grads = gradient_operands(nnx)
    by = sorted({c.kind for c, _ in grads})
    note = f'the backward pass runs {" + ".join(by) or "no collective"} ({len(grads)} operands made by it)'
    if config.strategy in ('fsdp', 'fsdp-tp') and 'reduce-scatter' not in kinds:
        note += (
            f"; XLA's {backend.upper()} backend compiled no reduce-scatter (each device keeps the slice of the "
            'summed gradient its shard needs); on GPU and TPU the partitioner emits a reduce-scatter here'
        )
    return {
        'strategy': config.strategy,
        'mesh': nnx.placements[0].mesh if nnx.placements else {},
        'collectives_per_step': {k: {'ops': v['per_step'], 'bytes': v['bytes_per_step']} for k, v in kinds.items()},
        'legacy_collectives_per_step': {
            k: {'ops': v['per_step'], 'bytes': v['bytes_per_step']} for k, v in totals(legacy).items()
        },
        'state_bytes_per_device': {'legacy': state_bytes(legacy), 'nnx': state_bytes(nnx)},
        'gradient_note': note,
        'targets': strategy_targets(legacy, nnx, config),
    }


def answers(m: PathMeasurement) -> dict:
    return {'replicated': answer_replicated(m), 'own_slice': answer_own_slice(m), 'gradients': answer_gradients(m)}


# -- the report: one dict, which is also the JSON; the text renders it ----------------------------


def collective_dict(c: hlo.Collective, k: int) -> dict:
    return {
        'kind': c.kind,
        'hlo_name': c.name,
        'loop_trip_counts': list(c.loop_trips),
        'per_call': c.per_call,
        'per_step': per_step(c, k),
        'replica_group_size': c.group_size,
        'bytes_per_execution': c.bytes,
        'bytes_per_step': bytes_per_step(c, k),
        'operands': [dataclasses.asdict(o) for o in c.operands],
    }


def placement_dict(p: Placement) -> dict:
    return {
        'group': p.group,
        'name': p.name,
        'shape': list(p.shape),
        'dtype': p.dtype,
        'partition_spec': p.spec_text(),
        'mesh': p.mesh,
        'devices': p.devices,
        'per_device_shape': list(p.shard_shape),
        'whole_copy_per_device': p.full_copy,
        'pieces': p.pieces,
    }


def path_dict(m: PathMeasurement) -> dict:
    return {
        'title': m.title,
        'program': m.program,
        'collectives': [collective_dict(c, m.steps_per_call) for c in m.collectives],
        'collective_totals_per_step': totals(m),
        'placement': [placement_dict(p) for p in m.placements],
        'memory_per_device_bytes': m.memory,
        'input_bytes_per_device': sum(p.shard_bytes for p in m.placements),
        'answers': answers(m),
    }


def all_reduce_comparison(legacy: PathMeasurement, nnx: PathMeasurement) -> dict:
    """All-reduce payload per step on both paths, and their ratio (None if unmeasurable)."""
    a = totals(legacy).get('all-reduce', {}).get('bytes_per_step', 0.0)
    b = totals(nnx).get('all-reduce', {}).get('bytes_per_step', 0.0)
    ratio = b / a if a and b is not None else None
    return {'legacy_bytes_per_step': a, 'nnx_bytes_per_step': b, 'nnx_over_legacy': ratio}


def report(legacy: PathMeasurement, nnx: PathMeasurement, config: Any, backend: str, versions: dict) -> dict:
    return {
        'workload': config.workload,
        'backend': backend,
        'devices': config.devices,
        'steps_per_call': config.steps_per_call,
        'batch_size': config.batch_size,
        'per_device_batch': config.per_device_batch,
        'seed': config.seed,
        'rng_mode': config.rng_mode,
        'counting': COUNTING,
        'questions': QUESTIONS,
        'paths': {'legacy': path_dict(legacy), 'nnx': path_dict(nnx)},
        'all_reduce_per_step': all_reduce_comparison(legacy, nnx),
        'strategy': strategy_dict(legacy, nnx, config, backend),
        'versions': versions,
    }


def _size_text(x: float | None) -> str:
    return 'unknown' if x is None else _bytes(x)


def _num(x: float | None) -> str:
    return 'unknown' if x is None else f'{x:g}'


def collectives_text(d: dict) -> list[str]:
    if not d['collectives']:
        return ['  none: the program has no collective']
    rows = [
        f'  {"HLO op":<22} {"per call":>8} {"per step":>8} {"bytes/step":>10}   then per operand: shape, role, origin'
    ]
    for c in d['collectives']:
        size = 'unknown' if c['bytes_per_step'] is None else f'{c["bytes_per_step"]:,.0f}'
        rows.append(f'  {c["hlo_name"]:<22} {_num(c["per_call"]):>8} {_num(c["per_step"]):>8} {size:>10}')
        for o in c['operands']:
            origin = ('written at: ' if o['written'] else 'inserted by XLA for: ') + (o['source'] or o['made_by'])
            rows.append(f'      {o["shape"]:<12} {o["role"]:<9} {origin}')
    for kind, t in d['collective_totals_per_step'].items():
        size = 'unknown' if t['bytes_per_step'] is None else f'{t["bytes_per_step"]:,.0f} B'
        rows.append(
            f'  total {kind}: {t["count_in_program"]} in the program, {_num(t["per_step"])} per step, {size} per step'
        )
    return rows


def placement_text(d: dict) -> list[str]:
    rows = [f'  {"group":<11} {"leaf":<44} {"shape":<14} {"sharding":<32} {"per device":<14} whole copy']
    for p in d['placement']:
        spec = f'{p["partition_spec"]} x{p["devices"]}'
        rows.append(
            f'  {p["group"]:<11} {p["name"]:<44} {_dims(p["shape"]):<14} {spec:<32} '
            f'{_dims(p["per_device_shape"]):<14} {"yes" if p["whole_copy_per_device"] else "no"}'
        )
    return rows


def path_text(d: dict) -> str:
    mem = d['memory_per_device_bytes']
    memory_line = ', '.join(f'{k} {v:,} B' for k, v in mem.items()) or 'not reported by this backend'
    return '\n'.join(
        [
            f'== {d["title"]} ==',
            f'program: {d["program"]}',
            'collectives:',
            *collectives_text(d),
            'placement (the compiled call\'s input shardings; "x8": on 8 devices):',
            *placement_text(d),
            f'memory per device (compiled.memory_analysis()): {memory_line}; '
            f'the inputs above add up to {d["input_bytes_per_device"]:,} B per device',
        ]
    )


def header_text(r: dict) -> str:
    return (
        f'{r["workload"]}: what XLA compiled for one fused call of each path, on {r["devices"]} {r["backend"]} '
        f'device(s), K={r["steps_per_call"]} steps/call, global batch {r["batch_size"]} '
        f'({r["per_device_batch"]}/device)\ncounting: {r["counting"]}'
    )


def answers_text(r: dict) -> str:
    rows = ['== three answers, from the measurements above ==']
    for key, question in r['questions'].items():
        rows.append(question)
        for path in ('legacy', 'nnx'):
            rows.append(f'  {path:<6} {r["paths"][path]["answers"][key]["why"]}')
    c = r['all_reduce_per_step']
    ratio = 'n/a' if c['nnx_over_legacy'] is None else f'{c["nnx_over_legacy"]:.4f}'
    rows.append(
        f'all-reduce payload per step and device: legacy {_size_text(c["legacy_bytes_per_step"])}, '
        f'nnx {_size_text(c["nnx_bytes_per_step"])} (nnx / legacy = {ratio})'
    )
    return '\n'.join(rows)


def strategy_text(r: dict) -> str:
    d = r['strategy']
    rows = [f'== strategy {d["strategy"]} on mesh {d["mesh"]}, against pmap data parallelism ==']
    for path, key in (('legacy', 'legacy_collectives_per_step'), ('nnx', 'collectives_per_step')):
        kinds = d[key]
        listed = ', '.join(f'{k} {v["ops"] or 0:g} op(s), {_size_text(v["bytes"])}' for k, v in sorted(kinds.items()))
        rows.append(f'  collectives per step, {path:<6}: {listed or "none"}')
    for path in ('legacy', 'nnx'):
        b = d['state_bytes_per_device'][path]
        rows.append(f'  state per device, {path:<6}: ' + ', '.join(f'{g} {_bytes(v)}' for g, v in b.items()))
    if d['gradient_note']:
        rows.append(f'  backward: {d["gradient_note"]}')
    for t in d['targets']:
        verdict = 'PASS' if t['pass'] else 'FAIL'
        rows.append(f'  {verdict}  {t["name"]}: {_bytes(t["value"])} (limit {_bytes(t["limit"])})')
    return '\n'.join(rows)


# -- pictures ------------------------------------------------------------------------------------


def picture_view(p: Placement) -> tuple[tuple[int, ...], tuple, str] | None:
    """A 2-D view that keeps the sharding: index 0 of leading unsharded axes (``x[0]``,
    step 0), then merge trailing unsharded axes (pmap's ``[D, ...]`` stack -> ``[D, rest]``)."""
    dims = list(zip(p.shape, list(p.spec) + [None] * (len(p.shape) - len(p.spec)), strict=True))
    dropped = 0
    while len(dims) > 2 and dims[0][1] is None:
        dims, dropped = dims[1:], dropped + 1
    how = p.name + ('[' + ', '.join(['0'] * dropped) + ']' if dropped else '')
    if len(dims) > 2 and all(s is None for _, s in dims[1:]):
        dims = [dims[0], (_size(tuple(d for d, _ in dims[1:])), None)]
        how += ' with trailing axes merged (row d: what device d holds)'
    if len(dims) > 2:
        return None
    return tuple(d for d, _ in dims), tuple(s for _, s in dims), how


def pictured(m: PathMeasurement) -> list[Placement]:
    """The first batch leaf and the first parameter kernel (else the first parameter)."""
    batch = [p for p in m.placements if p.group == 'batch'][:1]
    params = [p for p in m.placements if p.group == 'params']
    kernels = [p for p in params if p.name.endswith('kernel')] or params
    return batch + kernels[:1]


def draw(m: PathMeasurement) -> None:
    """Prints each picture with ``jax.debug.visualize_sharding`` (rich), to stdout."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    for p in pictured(m):
        view = picture_view(p)
        if view is None or not hasattr(p.sharding, 'mesh'):
            print(f'{m.title}: {p.name} {_dims(p.shape)} {p.spec_text()} has no 2-D view to draw')
            continue
        shape, spec, how = view
        print(f'{m.title}: {how}, drawn as {_dims(shape)}; {_dims(p.shape)} {p.spec_text()}')
        jax.debug.visualize_sharding(shape, NamedSharding(p.sharding.mesh, P(*spec)))
