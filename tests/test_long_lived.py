"""A long-lived process (a notebook, a pytest worker) stays healthy across many checks: what it
traced stays traced.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from equivalence.core import randomness


def test_a_trace_is_reused_only_where_the_dropout_bridge_did_the_same():
    """One jitted step with a Dropout (a loop port's own call) traced as the user runs it, with the
    bridge, and with the bridge's dropout off (the deterministic re-run): each is traced once and kept,
    none is reused where another holds, and no cache is cleared for it."""
    layer, traced = nnx.Dropout(0.5), []

    @jax.jit
    def step(x, key):
        traced.append(1)
        return layer(x, rngs=key)

    x, key = jnp.ones((8, 16)), jax.random.key(0)
    own = step(x, key)
    with randomness.bridged('global'):
        bridged = step(x, key)
    with randomness.dropout_off(), randomness.bridged('global'):
        off = step(x, key)
    assert len(traced) == 3, 'the bridged and the dropout-off calls must each be traced, not reuse a trace'
    assert not np.array_equal(bridged, own)  # the bridge draws fold_in(key, 0), the layer key itself
    np.testing.assert_array_equal(off, x)
    np.testing.assert_array_equal(step(x, key), own)  # the user's own trace, kept
    with randomness.bridged('global'):
        np.testing.assert_array_equal(step(x, key), bridged)  # the bridged trace, kept
    assert len(traced) == 3, 'a trace made before must stay cached'
