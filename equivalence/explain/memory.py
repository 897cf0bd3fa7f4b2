"""Memory: what the compiled program reserves per device, and what a strategy saves against pmap DP."""

from typing import Any

from equivalence.explain.measurements import (
    PathMeasurement,
    Placement,
    gradient_operands,
    itemsize,
    size,
    totals,
)


def memory(compiled: Any) -> dict[str, int]:
    """Per device: the program each device runs is the partitioned one."""
    stats = compiled.memory_analysis()
    stats = stats[0] if isinstance(stats, list | tuple) else stats
    if stats is None:  # some backends report nothing
        return {}
    fields = {'arguments': 'argument', 'outputs': 'output', 'aliased': 'alias', 'temporaries': 'temp'}
    return {k: int(getattr(stats, f'{v}_size_in_bytes')) for k, v in fields.items()}


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
        limit = sum(size(p.shape) * itemsize(p.dtype) for p in kernels) / mesh['model']
        name = f'bytes per device of the {len(kernels)} model-split kernels <= 1/{mesh["model"]} of whole'
        # No kernel divides over the model axis: nothing was split, so the target does not apply (None: n/a).
        out.append({'name': name, 'value': value, 'limit': limit, 'pass': value <= limit if kernels else None})
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
