"""The readable side-by-side table, and the machine-readable JSON report of one run."""

import platform

import numpy as np

from equivalence.core.compare.outcome import Outcome
from equivalence.core.judge.judge import RunResult
from equivalence.core.measure import clock, peaks
from equivalence.core.report import reach, screen, words

GROUPS = ('params', 'opt_state', 'ema', 'model_state', 'losses')


def header(result: RunResult, backend: str) -> str:
    c = result.config
    return (
        f'{c.workload}: legacy {result.programs[0]} vs {result.programs[1]} on {c.devices} {backend} device(s), '
        f'{c.steps} steps ({c.steps_per_call}/call x {c.calls} calls), '
        f'batch {c.batch_size} ({c.per_device_batch}/device), rng {result.keys or c.rng_mode}, seed {c.seed}'
        + (f', perturb {c.perturb:g}' if c.perturb else '')
        + (f', nnx-form {c.nnx_form}' if c.nnx_form != 'split' else '')
        + device_text(result.device)
    )


def device_text(device) -> str:
    """The accelerator and the precision the check computed at; nothing on the CPU, where float32 is float32."""
    if device is None or device.backend == 'cpu':
        return ''
    said = f'\n{device.count} x {device.kind}: float32 matrix products at {device.precision} precision'
    if device.precision == 'highest':
        said += f" (the backend's default computes them in {device.default_rounding}, which no floor measures)"
    gap = device.default_gap
    if gap:
        said += (
            f'; at the default precision the two sides end {gap["params"]:.2e} apart in the parameters, '
            f'{gap["losses"]:.2e} in the losses (first loss {gap["first_loss"]:.2e}): said, not judged'
        )
    elif gap is not None:
        said += '; at the default precision: not measured (the two sides could not run again at it)'
    elif device.precision == 'highest':
        said += '; how far apart the two sides end at the default precision: --default-gap runs them again at it'
    return said


def placement_lines(result: RunResult) -> list[str]:
    """The NNX side's strategy: its mesh, how many parameters it split, and every one it kept whole."""
    c, decisions = result.config, result.new.placement
    split = [d for d in decisions if any(a is not None for a in d.spec)]
    if result.new.placed_by:  # a loop port: what its own step did with the state the suite gave it
        if not split:
            return []
        return [f'{result.new.placed_by}: {len(split)} of {len(decisions)} parameters split over its devices, '
                'the rest replicated', '']  # fmt: skip
    if c.strategy == 'dp' or not decisions:
        return []
    lines = [f'strategy {c.strategy} on mesh {result.new.mesh}: {len(split)} of {len(decisions)} '
             'parameters and statistics split, the rest replicated']  # fmt: skip
    lines += [f'  kept whole: {d.path} {list(d.shape)}: {d.note}' for d in decisions if d.note]
    return [*lines, '']


def loss_table(result: RunResult) -> list[str]:
    new = 'nnx sharded loss' if result.new_side == 'NNX' else 'jit sharded loss'
    rows = [f'{"step":>5}  {"legacy pmap loss":>17}  {new:>17}  {"|diff|":>9}']
    for i, (a, b) in enumerate(zip(result.legacy.losses, result.new.losses, strict=True), start=result.resumed_at + 1):
        rows.append(f'{i:>5}  {a:>17.9f}  {b:>17.9f}  {abs(float(a) - float(b)):>9.2e}')
    return rows


def leaf_table(result: RunResult, n: int = 8) -> list[str]:
    tol, rule = result.report.tolerance, result.report.floor
    if rule is not None:
        return floor_table(result, n)
    rows = [
        f'worst leaves of {len(result.report.leaves)} '
        f'(ok when |nnx - legacy| <= {tol.atol:g} + {tol.rtol:g} * |legacy|; {tol.reason})',
        f'{"leaf":<40}  {"max abs":>9}  {"max rel":>9}  ok',
    ]
    for leaf in result.report.worst(n):
        rows.append(f'{leaf.name:<40}  {_abs(leaf.max_abs):>9}  {_abs(leaf.max_rel):>9}  {_flag(leaf)}')
    return rows


def floor_table(result: RunResult, n: int) -> list[str]:
    """Each leaf beside its measured floor and the difference it was allowed."""
    rule = result.report.floor
    floor = 'the larger of max |nnx - twin| and max |legacy - legacy twin|' if result.report.legacy_twin else None
    rows = [
        f'worst leaves of {len(result.report.leaves)} (ok when max |nnx - legacy| <= max({rule.safety:g} x floor, '
        f'{rule.min_ulps:g} spacings of max |legacy| in its precision, {rule.flips:g} x moved where narrower state '
        f'feeds it); floor = {floor or "max |nnx - twin|"})',
        f'{"leaf":<40}  {"max abs":>9}  {"floor":>9}  {"allowed":>9}  ok',
    ]
    # failing parameters first, then the rest of the final state, then the first step's leaves (the
    # diagnosis line names those); within each, the worst ratio to the allowed difference first
    ratio = lambda x: x.max_abs / x.limit if x.limit else x.max_abs  # noqa: E731
    rank = lambda x: (x.ok, x.group == 'first_step', x.group != 'params', -ratio(x))  # noqa: E731
    order = sorted(result.report.leaves, key=rank)
    for leaf in order[:n]:
        floor, limit = _abs(leaf.floor), _abs(leaf.limit)
        rows.append(f'{leaf.name:<40}  {_abs(leaf.max_abs):>9}  {floor:>9}  {limit:>9}  {_flag(leaf)}')
    return rows


def _abs(x: float | None) -> str:
    """A figure, or '-' where there is none (a leaf on one side only has no difference)."""
    return '-' if x is None or not np.isfinite(x) else f'{x:.2e}'


def _flag(leaf) -> str:
    if leaf.noise_dominated:
        return 'NOISE-DOMINATED'
    if leaf.ok:
        return 'yes'
    return 'NO' + (f' ({leaf.note})' if leaf.note else f' ({leaf.bad:,} of {leaf.size:,})')


def accuracy_line(result: RunResult) -> list[str]:
    if result.legacy.eval_accuracy is None:
        return []
    a, b = result.legacy.eval_accuracy, result.new.eval_accuracy
    return [f'held-out accuracy (running averages, no dropout): legacy pmap {a:.4f}, nnx sharded {b:.4f}', '']


def verdict(result: RunResult) -> str:
    """The last line: the outcome (``result.outcome``), with the leaves and figures that give it."""
    bad = [leaf for leaf in result.report.leaves if not leaf.ok]
    present = {leaf.group for leaf in result.report.leaves}
    sums = ', '.join(f'{g} {_abs(result.report.max_abs(g))}' for g in GROUPS if g in present)  # no EMA: no ema
    noisy = sum(leaf.noise_dominated for leaf in result.report.leaves)
    noisy_text = f', {noisy} noise-dominated (not verified by value)' if noisy else ''
    n, outcome = len(result.report.leaves), result.outcome
    why = words.unverified(result.verdict.unverified) if result.verdict is not None else ''
    if outcome is Outcome.NOT_VERIFIED and result.report.floor is None:  # no twin measured (judge.unmeasured)
        screen = f'{len(bad)} of {n} leaves outside' if bad else f'all {n} leaves within'
        return f'NOT VERIFIED: {screen} the fixed screen; {why}'
    if outcome is Outcome.NOT_VERIFIED:
        return f'NOT VERIFIED: all {n} leaves within their floor, {noisy} noise-dominated: {why}'
    if outcome is Outcome.MATCH:
        return f'MATCH: all {n} leaves within tolerance{noisy_text} (max abs: {sums})'
    return f'MISMATCH: {len(bad)} of {n} leaves outside tolerance (max abs: {sums})'


def verdict_lines(result: RunResult) -> list[str]:
    """What the verdict measured, noise-dominated leaves, and on MISMATCH the diagnosis line."""
    return [*words.lines(result.verdict), ''] if result.verdict is not None else []


def failure(result: RunResult, backend: str) -> str:
    """The pytest plugin's failure: the header, what the verdict found (diagnosis, ``where:``), the worst
    leaves, the verdict."""
    found = words.found(result.verdict) if result.verdict is not None else []
    return '\n'.join([header(result, backend), *found, *leaf_table(result), verdict(result)])


def verdict_json(result: RunResult) -> dict | None:
    v = result.verdict
    if v is None:
        return None
    noisy = [{'name': leaf.name, 'floor': leaf.floor, 'max_abs': leaf.max_abs} for leaf in v.noise_dominated]
    rule = result.report.floor
    floor = None if rule is None else {'safety': rule.safety, 'min_ulps': rule.min_ulps, 'flips': rule.flips,
                                       'noise_rel': rule.noise_rel,
                                       'legacy_twin': result.report.legacy_twin}  # fmt: skip
    return {'mode': v.mode, 'done': words.done(v), 'twin': words.twin(v.twin), 'kind': str(v.kind),
            'diagnosis': words.diagnosis(v.diagnosis), 'floor_rule': floor, 'noise_dominated': noisy,
            'errors': list(v.errors), 'not_verified': words.unverified(v.unverified),
            'hidden_by_noise': v.hidden_by_noise, 'memory': v.memory,
            'sensitivity': reach.sensitivity_json(v.sensitivity),
            'location': v.location.to_json() if v.location is not None else None,
            'where_disagrees': v.location is not None and v.location.disagrees(v.kind)}  # fmt: skip


def text(result: RunResult, backend: str, verbose: bool = False) -> str:
    """The report: its first screen (``screen``), or with ``verbose`` every leaf, figure and stage."""
    if not verbose:
        return '\n'.join([header(result, backend), *screen.notes(result), '', *placement_lines(result),
                          *loss_table(result), '', *accuracy_line(result), *screen.lines(result)])  # fmt: skip
    return '\n'.join(
        [
            header(result, backend),
            *result.notes,
            '',
            *placement_lines(result),
            *loss_table(result),
            '',
            *verdict_lines(result),
            *leaf_table(result),
            '',
            *accuracy_line(result),
            *([clock.line(result.timing)] if result.timing else []),
            *([said] if result.timing and (said := peaks.line(result.timing.get('memory'))) else []),
            verdict(result),
        ]
    )


def to_json(result: RunResult, versions: dict[str, str]) -> dict:
    c, r = result.config, result.report
    return {
        'match': result.outcome is Outcome.MATCH,
        'outcome': result.outcome.label,
        'new_side': result.new_side,
        'workload': c.workload,
        'devices': c.devices,
        'steps': c.steps,
        'steps_per_call': c.steps_per_call,
        'calls': c.calls,
        'batch_size': c.batch_size,
        'seed': c.seed,
        'rng_mode': c.rng_mode,
        'perturb': c.perturb,
        'strategy': None if result.new.placed_by else c.strategy,  # None: the port's own step placed it
        'mesh': result.new.mesh,
        'nnx_form': c.nnx_form,
        'placement': [{'path': d.path, 'spec': [a for a in d.spec], 'note': d.note} for d in result.new.placement],
        'placed_by': result.new.placed_by or None,  # None: the suite's strategy placed it
        'resumed_at': result.resumed_at,
        'notes': result.notes,
        'losses': {'legacy': _floats(result.legacy.losses), 'new': _floats(result.new.losses)},
        'eval_accuracy': {'legacy': result.legacy.eval_accuracy, 'new': result.new.eval_accuracy},
        'max_abs_diff': {g: _num(r.max_abs(g)) for g in GROUPS},
        'param_divergence_per_call': result.param_divergence(),
        'tolerance': {'rtol': r.tolerance.rtol, 'atol': r.tolerance.atol, 'reason': r.tolerance.reason},
        'verdict': verdict_json(result),
        'leaves': [
            {
                'name': leaf.name,
                'max_abs': _num(leaf.max_abs),
                'max_rel': _num(leaf.max_rel),
                'ok': leaf.ok,
                'note': leaf.note,
                'elements_outside': leaf.bad,
                'elements': leaf.size,
                'floor': leaf.floor,
                'floor_from': leaf.floor_from or None,
                'allowed': leaf.limit,
                'noise_dominated': leaf.noise_dominated,
                'only_on': leaf.one_sided or None,
            }
            for leaf in r.leaves
        ],
        'timing': result.timing,
        'device': result.device.to_json() if result.device is not None else None,
        'versions': versions,
    }


def versions() -> dict[str, str]:
    """The versions behind a report's numbers."""
    import flax
    import jax
    import jaxlib
    import optax

    return {
        'python': platform.python_version(),
        'jax': jax.__version__,
        'jaxlib': jaxlib.__version__,
        'flax': flax.__version__,
        'optax': optax.__version__,
        'numpy': np.__version__,
    }


def _floats(a: np.ndarray) -> list[float]:
    return [float(x) for x in np.asarray(a).ravel()]


def _num(x: float) -> float | None:
    """JSON has no infinity: a leaf missing on one side is reported as null."""
    return float(x) if np.isfinite(x) else None
