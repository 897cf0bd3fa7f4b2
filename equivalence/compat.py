"""What the recorder needs of a JAX older than the suite's (``python -m equivalence.record`` where the pmap
code ran: jax 0.4.x with the flax linen of its time, docs/record.md), given where that JAX lacks it.

The pmap side's modules import five names that jax 0.4.38 and flax 0.10.2 do not have; ``install`` gives each
where it is missing, and does nothing on the JAX the suite pins (each is there):

- ``jax.make_user_context`` (a value that keys JAX's trace cache: ``draws``, ``masks``, ``intercept``): here a
  context whose every change outside a trace clears JAX's caches, so that no trace made under one value is
  taken under another (slower, the same traces);
- ``jax.extend.core.get_opaque_trace_state``: JAX's own, from ``jax._src.core``, where 0.4.38 keeps it;
- ``jax.sharding.AxisType`` and ``jax.typeof``: read by the new side alone (an explicit mesh's axes), which the
  recorder never runs; an enum of the three axis types and JAX's abstract value stand in;
- ``flax.nnx.Pytree``: what ``read_groups`` (which a port's ``legacy_groups`` may start from) asks a train state
  to hold for NNX objects; flax 0.10 calls it ``nnx.Object``.

The device count: 0.4.38 reads no ``JAX_NUM_CPU_DEVICES``, only XLA's flag (``devices.simulate_cpu_devices``).
"""

import contextlib
import enum

from equivalence.core.port import installed

version = installed.version  # ``package``'s installed version as numbers, read without importing it: (0, 4, 38)


# the names ``install`` gives where JAX lacks them: code the recorder runs may use these on any JAX
GIVEN = ('jax.make_user_context', 'jax.extend.core.get_opaque_trace_state', 'jax.sharding.AxisType', 'jax.typeof',
         'flax.nnx.Pytree')  # fmt: skip


class _UserContext:
    """``jax.make_user_context`` where JAX has none: the value, and JAX's caches cleared on each change."""

    def __init__(self, default_value=None):
        self.value = default_value

    @contextlib.contextmanager
    def __call__(self, value):
        before, self.value = self.value, value
        _clear()
        try:
            yield
        finally:
            self.value = before
            _clear()


def _clear() -> None:
    """JAX's caches cleared, unless a trace is under way (a value entered inside a traced function: clearing
    then would free what the trace holds)."""
    import jax
    from jax._src import core

    if core.trace_state_clean():
        jax.clear_caches()


class _AxisType(enum.Enum):
    Auto = 'auto'
    Explicit = 'explicit'
    Manual = 'manual'


def install() -> list[str]:
    """Each missing name given (see the module's text); the names given, none on the suite's own JAX."""
    import jax
    import jax.extend.core
    import jax.sharding

    given = []
    if not hasattr(jax, 'make_user_context'):
        jax.make_user_context, given = _UserContext, [*given, 'jax.make_user_context']
    if not hasattr(jax.extend.core, 'get_opaque_trace_state'):
        from jax._src.core import get_opaque_trace_state

        jax.extend.core.get_opaque_trace_state = get_opaque_trace_state
        given.append('jax.extend.core.get_opaque_trace_state')
    if not hasattr(jax.sharding, 'AxisType'):
        jax.sharding.AxisType, given = _AxisType, [*given, 'jax.sharding.AxisType']
    if not hasattr(jax, 'typeof'):
        jax.typeof, given = jax.core.get_aval, [*given, 'jax.typeof']
    from flax import nnx

    if not hasattr(nnx, 'Pytree'):
        nnx.Pytree, given = nnx.Object, [*given, 'flax.nnx.Pytree']
    return given
