"""The printed report: one dict, which is also the JSON; the text renders it."""

import dataclasses
from typing import Any

from equivalence.explain import hlo
from equivalence.explain.answers import answers
from equivalence.explain.measurements import (
    COUNTING,
    QUESTIONS,
    PathMeasurement,
    Placement,
    bytes_per_step,
    bytes_text,
    dims_text,
    per_step,
    totals,
)
from equivalence.explain.memory import strategy_dict


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
        'notes': list(m.notes),
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
    return 'unknown' if x is None else bytes_text(x)


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
            f'  {p["group"]:<11} {p["name"]:<44} {dims_text(p["shape"]):<14} {spec:<32} '
            f'{dims_text(p["per_device_shape"]):<14} {"yes" if p["whole_copy_per_device"] else "no"}'
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
            *[f'note: {n}' for n in d['notes']],
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
        rows.append(f'  state per device, {path:<6}: ' + ', '.join(f'{g} {bytes_text(v)}' for g, v in b.items()))
    if d['gradient_note']:
        rows.append(f'  backward: {d["gradient_note"]}')
    for t in d['targets']:
        if t['pass'] is None:
            rows.append(f'  n/a   {t["name"]}: no kernel divides over the model axis, none is split')
            continue
        verdict = 'PASS' if t['pass'] else 'FAIL'
        rows.append(f'  {verdict}  {t["name"]}: {bytes_text(t["value"])} (limit {bytes_text(t["limit"])})')
    return '\n'.join(rows)
