"""The three answers: pure functions of a ``PathMeasurement``."""

from equivalence.explain import hlo
from equivalence.explain.measurements import (
    MOVERS,
    PathMeasurement,
    Placement,
    bytes_text,
    dims_text,
    gradient_operands,
    itemsize,
    per_step,
    size,
)


def answer_replicated(m: PathMeasurement) -> dict:
    params = [p for p in m.placements if p.group == 'params']
    if not params:
        return {'yes': False, 'why': 'no: the call takes no parameter leaves'}
    split = [p for p in params if not p.full_copy]
    total = sum(size(p.logical_shape) * itemsize(p.dtype) for p in params)
    held = sum(size(p.per_device_shape) * itemsize(p.dtype) for p in params)
    if split:
        named = '; '.join(
            f'{p.name} {dims_text(p.logical_shape)} is {p.spec_text()}, {dims_text(p.per_device_shape)} per device'
            for p in split
        )
        why = f'no: {len(split)} of {len(params)} parameter leaves are split over devices ({named}); '
        return {
            'yes': False,
            'why': why + f'each device holds {bytes_text(held)} of the {bytes_text(total)} of parameters',
        }
    specs = ', '.join(sorted({p.spec_text() for p in params}))
    on = ', '.join(str(d) for d in sorted({p.devices for p in params}))
    if all(p.stacked for p in params):
        why = (
            f'yes, by copy: all {len(params)} parameter leaves are stacked [{m.devices}, ...] arrays, {specs} '
            f'on {on} devices, so each device holds one whole copy ({bytes_text(held)})'
        )
    else:
        why = f'yes: all {len(params)} parameter leaves are {specs} on {on} devices: each holds all {bytes_text(held)}'
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
    held = ', '.join(
        f'{p.name} {dims_text(p.shape)} {p.spec_text()} -> {dims_text(p.shard_shape)} per device' for p in batch
    )
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
    why += f'({bytes_text(size)} per device)'
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


def answers(m: PathMeasurement) -> dict:
    return {'replicated': answer_replicated(m), 'own_slice': answer_own_slice(m), 'gradients': answer_gradients(m)}
