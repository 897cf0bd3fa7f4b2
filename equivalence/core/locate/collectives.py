"""The pmap step's own collectives, read from its recorded first step before any stage: a step whose
replicas of the parameters part after one step applied each device's own gradients (no ``lax.pmean``
of them: pitfall 1), and a step that reports each device's own loss (no ``lax.pmean`` of the loss:
the suite reads device 0's, every parameter agreeing). Both are the pmap code's, and the forward pass,
the gradients and the update of the new side may all be right; each names what it read.
"""

import jax
import numpy as np

from equivalence.core.compare import compare
from equivalence.core.compare.location import Location, sci
from equivalence.core.compare.rule import MEASURED_FLOOR
from equivalence.core.state.paths import key_name

GRADIENT_PITFALL = 'missing_pmean'  # equivalence/pitfalls/missing_pmean.py, pitfall 1


def replicas_apart(legacy_state, groups=None) -> tuple[str, float] | None:
    """``(a parameter or optimizer-state leaf whose replicas differ, by how much)``, or None: every device
    of the pmap side holds the same parameters and optimizer state after the step (as a pmean'd gradient
    gives). ``groups``: the port's reading of one replica (its params and opt_state), applied to the
    replicated state; without it, every float leaf of the state."""
    try:
        tree = groups(legacy_state) if groups is not None else legacy_state
        tree = {g: tree[g] for g in ('params', 'opt_state') if g in tree} if isinstance(tree, dict) else tree
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    except Exception:  # noqa: BLE001 -- a state the groups cannot read stacked: not read
        return None
    worst = None
    for path, leaf in flat:
        try:
            a = np.asarray(leaf)
        except Exception:  # noqa: BLE001 -- several processes: not every replica is here
            return None
        if a.ndim == 0 or a.shape[0] < 2 or not compare.is_float(a.dtype):
            continue
        a64 = a.astype(np.float64)
        apart = float(np.abs(a64 - a64[:1]).max(initial=0.0))
        if apart > MEASURED_FLOOR.min_ulps * compare.spacing32(float(np.abs(a64[0]).max(initial=0.0))):
            name = '/'.join(key_name(k) for k in path)
            if worst is None or apart > worst[1]:
                worst = (name, apart)
    return worst


def gradients_not_averaged(legacy_state, groups=None) -> Location | None:
    found = replicas_apart(legacy_state, groups)
    if found is None:
        return None
    name, apart = found
    return Location(
        'collective', 'the pmap step (its gradients)', '-',
        f"the pmap side's replicas of {name} are {sci(apart)} apart after one step: each device applied its own "
        'gradients, which the pmap step does not lax.pmean over its axis; the suite reads device 0. Pitfall 1: '
        f'python -m equivalence.pitfalls --only {GRADIENT_PITFALL}',
    )  # fmt: skip


def loss_not_averaged(device_losses, new_losses: np.ndarray) -> Location | None:
    """The pmap step's first reported loss differs from device to device while the new side's is their mean:
    the pmap step reports each device's own loss (the suite reads device 0's)."""
    if device_losses is None:
        return None
    try:
        per_device = np.asarray(device_losses, np.float64)[:, 0]
    except Exception:  # noqa: BLE001 -- several processes, or a loss of another shape
        return None
    if per_device.size < 2 or not np.isfinite(per_device).all():
        return None
    spread = float(per_device.max() - per_device.min())
    ulps = MEASURED_FLOOR.min_ulps * compare.spacing32(float(np.abs(per_device).max()))
    new = float(np.asarray(new_losses, np.float64)[0])
    mean = float(per_device.mean())
    if spread <= ulps or abs(new - mean) > max(ulps, 1e-6 * abs(mean)) * 8:
        return None
    return Location(
        'collective', 'the pmap step (its reported loss)', '-',
        f"the pmap side's first loss differs from device to device ({per_device.min():.6g} to {per_device.max():.6g}: "
        f'each device reports its own), and the new side reports their mean ({new:.6g}); the suite reads device 0. '
        'The pmap step does not lax.pmean its loss: what it reports is not what it trains on, which may agree',
    )  # fmt: skip
