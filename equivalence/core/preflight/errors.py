"""The pre-flight's one line: the port field, the user's frame, expected against given, the fix."""

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import jax

from equivalence.core.port import blame
from equivalence.core.port.config import ConfigError
from equivalence.core.port.naming import PortError
from equivalence.core.port.ports import Port
from equivalence.core.run import adapters
from legacy_pmap import train as legacy

EXPECTED = {
    'legacy_step': 'legacy_step((rng, state), batch) -> ((rng, state), loss)',
    'new_call': 'new_call(train_state, keys, batch_KxG) -> (train_state, losses_K)',
    'legacy_loss': 'legacy_loss(model, params, model_state, batch, noise) -> losses_B or (losses_B, model_state)',
    'nnx_loss': 'nnx_loss(model, batch, noise) -> losses_B',
}
FIXES = (  # (pattern in the error, fix); {axis} is the port's axis_name
    (
        re.compile(r'unbound axis name: ([\w-]+)'),
        "the port declares axis_name={axis!r}: set axis_name='{0}' or pmean over {axis!r}",
    ),
    (re.compile(r'should match the mesh passed to shard_map'), 'give the step itself: the suite pmaps it'),
    (re.compile(r'carry'), 'return the carry ((rng, state)) with the structure, shapes and dtypes it came in with'),
    (re.compile(r"no attribute '(params|opt_state|step)'"), 'give the port legacy_groups='),
    (  # one key a call, handed --rng per-device's [D, 2]: the port's first rng mode is per-device
        re.compile(r'(?:split|fold_in) accepts a single key, but was given a key array of shape \((\d+), 2\)'),
        "the step takes one key and was handed per-device keys ([{0}, 2]): give the port rng_modes=('global',), "
        'or split the keys per device as docs/randomness.md#per-device-keys-and-nnx-layers shows',
    ),
    (  # pmap-era data code written for np.random.RandomState (randint, rand, randn), handed a Generator
        re.compile(r"'(?:numpy\.random\._generator\.)?Generator' object has no attribute '(\w+)'"),
        'make_data is given a numpy Generator (np.random.default_rng(seed)), not a RandomState, which has no {0}: '
        'call its own methods (integers, random, standard_normal), or make one: '
        'np.random.RandomState(rng.integers(2**31))',
    ),
)


# A model port's step is the suite's, under a pmap that names its axis ``legacy_pmap.train.AXIS``: a model port
# has no axis_name of its own to set, so the fix is in the model.
SUITE_AXIS = (
    "the suite's pmap names its axis {axis!r}: give the model's collectives (a linen BatchNorm's axis_name, a "
    'pmean or psum) the name {axis!r} while training (a ModelPort has no axis_name field)'
)


# A model port's make_tx serves both sides: nnx.Optimizer initialises it on the NNX parameters (an nnx.State,
# each leaf's path ending in '.value'), where the pmap side hands it linen's params dict.
NNX_PARAMS = (
    "when nnx.Optimizer initialised it on the NNX side's parameters (an nnx.State, not linen's params dict); fix: "
    'write what it calls on the parameters (a weight-decay mask) for any pytree, with jax.tree.map or '
    'jax.tree_util.tree_map_with_path, not dict keys or flax.traverse_util'
)


# What code that runs eagerly on the host (np.asarray of a result, a Python branch on a value) raises
# when traced: such a callable cannot be checked abstractly, so the pre-flight leaves it to the run.
HOST_ONLY = (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError)


class PreflightError(PortError):
    """A port that cannot run as given: exit 2, one line, before any training; ``whole``: the text of
    the error the line shortened (the command writes it to a file the line names), else ''."""

    def __init__(self, message: str, whole: str = ''):
        super().__init__(message)
        self.whole = whole


def raised(port: Port, field: str, error: BaseException, expected: str = '', fix: str = '') -> PreflightError:
    """``PreflightError`` of ``line``, with the whole text of ``error`` when the line shortened it."""
    whole = blame.whole_text(error) if blame.elided(error) else ''
    return PreflightError(line(port, field, error, expected, fix), whole)


def fail(port: Port, field: str, text: str) -> PreflightError:
    return PreflightError(f'port {port.name!r}: {field} {text}')


def line(port: Port, field: str, error: BaseException, expected: str = '', fix: str = '') -> str:
    """The one line for an exception raised while tracing ``field``; ``fix``: what to do, where no pattern says."""
    field = blame.port_field(error, port) or field
    frame = blame.innermost_user(error)
    where = f' at {frame.where}' if frame else ''
    inside = pmapped_inside(error)
    if inside and frame is not None:  # the step calls upstream's own pmapped function: no device axis there
        return (
            f"port {port.name!r}: {field} calls {inside}, a jax.pmap'd function ({frame.where}), and the suite "
            f'runs {field} under its own pmap, where a pmapped function sees no device axis '
            f'({blame.first_line(error)}); fix: call the function it wraps, {inside}.__wrapped__, or give {inside} '
            f'itself as {field}'
        )
    text = f'port {port.name!r}: {field} raised {blame.first_line(error)}{where}'
    expected = expected or EXPECTED.get(field, '')
    text += f'; expected {expected}' if expected else ''
    for pattern, known in FIXES:
        m = pattern.search(str(error))
        if m and pattern is FIXES[0][0] and port.axis_name is None:  # a model port: the suite's pmap axis
            known = SUITE_AXIS
        if m:
            return text + '; fix: ' + known.format(*m.groups(), axis=port.axis_name or legacy.AXIS)
    return f'{text}, {fix}' if fix else text


def pmapped_inside(error: BaseException) -> str:
    """The name of a ``jax.pmap``'d function the innermost user frame calls, or '' (``adapters.pmapped``)."""
    return next((n for n, v in blame.named_in_innermost_user(error).items() if adapters.pmapped(v) is not None), '')


@contextlib.contextmanager
def blamed(port: Port, field: str, expected: str = '', fix: str = '') -> Iterator[None]:
    """Whatever the port's code raises inside -> ``PreflightError`` naming ``field``."""
    try:
        yield
    except ConfigError:  # already one line: a name mapping, a Dropout the bridge refuses, a check below
        raise
    except Exception as e:  # noqa: BLE001 -- the user's code failed while traced: say where, in one line
        raise raised(port, field, e, expected, fix) from None


def kind(value: Any) -> str:
    return f'an array of shape {list(value.shape)}' if hasattr(value, 'shape') else f'a {type(value).__name__}'
