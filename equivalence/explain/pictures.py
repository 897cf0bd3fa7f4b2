"""Pictures of where the first batch leaf and the first kernel live (``jax.debug.visualize_sharding``)."""

from equivalence.explain.measurements import PathMeasurement, Placement, dims_text, size


def picture_view(p: Placement) -> tuple[tuple[int, ...], tuple, str] | None:
    """A 2-D view that keeps the sharding: index 0 of leading unsharded axes (``x[0]``,
    step 0), then merge trailing unsharded axes (pmap's ``[D, ...]`` stack -> ``[D, rest]``)."""
    dims = list(zip(p.shape, list(p.spec) + [None] * (len(p.shape) - len(p.spec)), strict=True))
    dropped = 0
    while len(dims) > 2 and dims[0][1] is None:
        dims, dropped = dims[1:], dropped + 1
    how = p.name + ('[' + ', '.join(['0'] * dropped) + ']' if dropped else '')
    if len(dims) > 2 and all(s is None for _, s in dims[1:]):
        dims = [dims[0], (size(tuple(d for d, _ in dims[1:])), None)]
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
            print(f'{m.title}: {p.name} {dims_text(p.shape)} {p.spec_text()} has no 2-D view to draw')
            continue
        shape, spec, how = view
        print(f'{m.title}: {how}, drawn as {dims_text(shape)}; {dims_text(p.shape)} {p.spec_text()}')
        jax.debug.visualize_sharding(shape, NamedSharding(p.sharding.mesh, P(*spec)))
