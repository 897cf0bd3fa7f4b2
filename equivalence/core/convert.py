"""Both frameworks' state <-> one neutral form: ``{group: {'a/b/c': np.ndarray}}``.

Linen and NNX initialisers split keys differently, so the harness initialises linen once
and copies the variables into the NNX model. Everything the comparison sees goes through
``legacy_to_neutral`` / ``nnx_to_neutral``; ``compare.py`` never sees a framework type.
"""

from typing import Any

import jax
import numpy as np
from flax import nnx

Neutral = dict[str, dict[str, np.ndarray]]  # group ('params', 'opt_state', ...) -> path -> array


def _key_name(entry) -> str:
    for attr in ('key', 'name', 'idx'):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def flatten(tree: Any) -> dict[str, np.ndarray]:
    """``{'a/b/c': host array}``; optax namedtuple fields and NNX dict keys read alike."""
    leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {'/'.join(_key_name(k) for k in path): np.asarray(leaf) for path, leaf in leaves}


def _merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and k in out else v
    return out


def load_linen_variables(model: nnx.Module, variables: dict) -> None:
    """Copy linen variables (every collection) into an NNX model whose paths mirror them."""
    linen = {}
    for collection in variables.values():
        linen = _merge(linen, jax.tree.map(np.asarray, dict(collection)))
    state = nnx.state(model)
    want, got = set(flatten(nnx.to_pure_dict(state))), set(flatten(linen))
    if want != got:
        raise ValueError(f'linen and NNX paths differ: only NNX {sorted(want - got)}, only linen {sorted(got - want)}')
    nnx.replace_by_pure_dict(state, linen)
    nnx.update(model, state)


def legacy_to_neutral(state) -> Neutral:
    """A single-replica ``legacy_pmap.train.TrainState``."""
    return {
        'params': flatten(state.params),
        'opt_state': flatten(state.opt_state),
        'ema': flatten(state.params_ema),
        'model_state': flatten(state.model_state),
        'step': {'step': np.asarray(state.step)},
    }


def nnx_to_neutral(graphdef, state) -> Neutral:
    """The split ``nnx_sharded.train.TrainState``, grouped and named as the linen side."""
    ts = nnx.merge(graphdef, state)
    model_state = {'batch_stats': nnx.to_pure_dict(nnx.state(ts.model, nnx.BatchStat))}
    ema = nnx.to_pure_dict(nnx.state(ts.ema, nnx.Param)) if ts.ema is not None else None
    return {
        'params': flatten(nnx.to_pure_dict(nnx.state(ts.model, nnx.Param))),
        'opt_state': flatten(nnx.to_pure_dict(nnx.state(ts.optimizer.opt_state))),
        'ema': flatten(ema),
        'model_state': flatten(model_state if model_state['batch_stats'] else {}),
        'step': {'step': np.asarray(ts.optimizer.step[...])},
    }
