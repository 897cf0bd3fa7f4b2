"""What a check's reach is, in words: on MATCH how large a difference it could have missed (``sensitivity``),
and NOT VERIFIED where a trend below the floors is too thin to decide (``thin``). The values are the verdict's
(``verdict.systematic``)."""

from equivalence.core.compare.findings import Thin
from equivalence.core.trend.systematic import Sensitivity


def sensitivity(s: Sensitivity | None) -> str:
    """One line: what a MATCH could have missed, at its steps; '' where nothing was measured."""
    if s is None or (s.learning_rate is None and s.decay is None):
        return ''
    parts = []
    if s.learning_rate is not None:
        parts.append(f'a learning rate off by less than {s.learning_rate:.1e} of itself ({s.learning_rate_leaf})')
    if s.decay is not None:
        parts.append(f'a decoupled weight decay of less than {s.decay:.1e} x the parameter a step (learning rate x '
                     f'weight decay; {s.decay_leaf})')  # fmt: skip
    return (f'sensitivity: at these {s.steps} steps, no leaf would leave its floor for {" or ".join(parts)}; a '
            'difference n times smaller needs about n times the steps, where the floors grow no faster '
            '(differences that grow every call in proportion to the parameter or the update are read too, below the '
            'floors)')  # fmt: skip


def sensitivity_json(s: Sensitivity | None) -> dict | None:
    if s is None:
        return None
    return {'learning_rate': s.learning_rate, 'learning_rate_leaf': s.learning_rate_leaf, 'decay': s.decay,
            'decay_leaf': s.decay_leaf, 'steps': s.steps}  # fmt: skip


def thin(record: Thin) -> str:
    """Why a run whose leaves all pass is NOT VERIFIED: a trend too thin to decide, and the steps that would."""
    top = record.trends[0]
    more = f' and {len(record.trends) - 1} more leaves' if len(record.trends) > 1 else ''
    return (f'params/{top.leaf}{more}: the difference grows every call in proportion to the {top.by} (r² {top.r2:.2f} '
            f"over {top.values} values, the twins' {top.twin_r2:.2f}), as a slip in the update would, too weakly over "
            f'{record.steps} steps to decide; about {record.decide} steps would (--calls)')  # fmt: skip
