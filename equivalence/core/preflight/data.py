"""``make_data``, ``init_args`` and the linen variables: the inputs every trace starts from."""

import inspect
from collections.abc import Iterator
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from equivalence.core.port.naming import PortError
from equivalence.core.port.ports import Port
from equivalence.core.preflight.errors import PreflightError, blamed, fail, kind
from equivalence.core.run import encoding, facts


def check_names(port: Port, variables: dict) -> dict:
    """The two sides' variables paired (``facts.name_mapping``), its one line naming ``names=``."""
    try:
        with blamed(port, 'nnx_model', 'nnx_model(rngs) -> nnx.Module'):
            return facts.name_mapping(port, variables) or {}
    except PreflightError:
        raise
    except PortError as e:
        raise fail(port, 'names', f'does not pair the two models: {e}') from None


def make_data(port: Port, seed: int, n_steps: int, batch: int, steps_text: str) -> Any:
    """``make_data`` run for real, its result checked leaf by leaf."""
    with blamed(port, 'make_data', 'make_data(rng, n_steps, global_batch) -> pytree of [n_steps, global_batch, ...]'):
        data = port.make_data(np.random.default_rng(seed), n_steps, batch)
    if inspect.isgenerator(data) or isinstance(data, Iterator):
        raise fail(
            port,
            'make_data',
            f'returned a {type(data).__name__}: return the whole pytree of arrays '
            f'[n_steps, global_batch, ...] at once (the suite cuts it into calls)',
        )
    flat = jax.tree_util.tree_flatten_with_path(data)[0]
    if not flat:
        raise fail(port, 'make_data', f'returned {type(data).__name__} with no arrays in it')
    for path, leaf in flat:
        check_leaf(port, jax.tree_util.keystr(path) or 'its result', leaf, (n_steps, batch), steps_text, flat)
    return data


def check_recordable(port: Port, data: Any) -> None:
    """``make_data``'s batches as a reference holds them and a check reads them back (``run.encoding``): one that
    cannot be is refused before ``record`` trains."""
    arrays: list = []
    try:
        encoding.decode(encoding.encode(data, arrays), dict(enumerate(arrays)), {})
    except encoding.Unheld as e:
        held = f'{e.held.__module__}.{e.held.__qualname__}'
        raise fail(port, 'make_data', f'returns batches holding a {held}, a pytree of its own flatten functions, '
                   'which a reference cannot hold: make it a dataclass (jax.tree_util.register_dataclass, '
                   'flax.struct.dataclass) or a NamedTuple, or return dicts') from None  # fmt: skip
    except encoding.Unreadable as e:  # a class a check cannot find by its module and name
        raise fail(
            port, 'make_data', f'returns batches that a check could not read back from a reference: it {e}'
        ) from None


def check_leaf(port: Port, name: str, leaf: Any, expected: tuple[int, int], steps_text: str, flat: list) -> None:
    n, g = expected
    if not isinstance(leaf, np.ndarray | jax.Array):
        raise fail(
            port,
            'make_data',
            f'leaf {name} is a {type(leaf).__name__}, not an array: every leaf must be '
            f'an array [n_steps={n}, global_batch={g}, ...] (np.asarray it)',
        )
    if leaf.dtype.kind not in 'biufc':
        raise fail(port, 'make_data', f'leaf {name} has dtype {leaf.dtype}: the suite feeds numeric arrays only')
    shape = tuple(leaf.shape)
    head = f'leaf {name} has shape {list(shape)}; expected [n_steps={n}, global_batch={g}, ...]'
    if len(shape) < 2:
        raise fail(port, 'make_data', f'{head}: one axis for the steps, one for the examples')
    if shape[:2] == (n, g):
        return
    if shape[:2] == (g, n):
        raise fail(port, 'make_data', f'{head}: this is [batch, steps, ...]; swap the first two axes')
    if shape[0] != n:
        raise fail(port, 'make_data', f'{head}: {shape[0]} steps, the run needs {steps_text}')
    others = sorted({tuple(np.shape(v))[1:2] for _, v in flat} - {shape[1:2]})
    ragged = f' (other leaves have {others[0][0]} rows: ragged)' if others else ''
    raise fail(port, 'make_data', f'{head}: {shape[1]} examples per step, --batch-size is {g}{ragged}')


def abstract_variables(port: Port, data: Any, traced: dict | None = None) -> dict:
    """The linen variables, shapes only, initialised from one example as ``make_inputs`` does; ``traced``: the
    run's own initialisation's, traced already (its arguments are checked all the same)."""
    example = jax.tree.map(lambda v: v[0, :1], data)
    with blamed(port, 'init_args', 'init_args(batch_of_one_example) -> tuple of the linen init arguments'):
        args = port.init_args(example)
    if not isinstance(args, tuple):
        raise fail(
            port,
            'init_args',
            f"returned a {type(args).__name__}, not a tuple: return the linen init's "
            "positional arguments, e.g. init_args=lambda batch: (batch['x'],)",
        )
    kwargs, key = init_kwargs(port, example), jax.random.PRNGKey(0)
    if traced is not None:
        return dict(traced)
    with blamed(port, 'legacy_model', 'legacy_model().init(rngs, *init_args(example), **init_kwargs(example))'):
        model = port.legacy_model()
        if not isinstance(model, nn.Module):
            raise fail(port, 'legacy_model', f'returned {kind(model)}; expected a linen Module')
        return dict(jax.eval_shape(lambda: model.init({'params': key, 'dropout': key}, *args, **kwargs)))


def init_kwargs(port: Port, example: Any) -> dict:
    """``init_kwargs(example)``, checked: a dict of keyword arguments (``{}`` when the port gives none)."""
    if port.init_kwargs is None:
        return {}
    with blamed(port, 'init_kwargs', 'init_kwargs(batch_of_one_example) -> dict of the linen init keyword arguments'):
        kwargs = port.init_kwargs(example)
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise fail(
            port,
            'init_kwargs',
            f"returned {kind(kwargs)}, not a dict of names: return the linen init's keyword arguments, "
            "e.g. init_kwargs=lambda batch: {'train': False}",
        )
    return kwargs
