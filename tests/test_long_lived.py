"""A long-lived process (a notebook, a pytest worker) stays healthy across many checks: what it
traced stays traced, and the compiled programs the checks leave behind are released before the
kernel's map limit ends the process.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import shared_programs
from flax import nnx

from equivalence import testing
from equivalence.core.port import workloads
from equivalence.core.rng import randomness

_TOLD: list = []


def _tell(tag: str, x) -> None:  # a module-level callback that reads module state, as intercept._store does
    _TOLD.append((tag, float(x)))


def test_the_suites_shared_programs_share_a_callbacks_program_only_where_it_does_the_same():
    """``shared_programs``: a program with a host callback is reused (its first compile's callback runs)
    only where the callback is the same module-level function with the same arguments; another argument
    or a closure compiles anew, and each run tells its own value."""

    def run(callback, x):  # a new function each time: JAX's own caches do not see the repeat
        return jax.jit(lambda v: (jax.debug.callback(callback, v * 2), v)[1])(x).block_until_ready()

    def told(callback, x) -> tuple:
        before = dict(shared_programs.PROGRAMS.counts)
        _TOLD.clear()
        run(callback, x)
        jax.effects_barrier()
        return list(_TOLD), shared_programs.PROGRAMS.counts['hit'] - before.get('hit', 0)

    assert told(functools.partial(_tell, 'a'), jnp.float32(1.0))[0] == [('a', 2.0)]
    assert told(functools.partial(_tell, 'a'), jnp.float32(2.0)) == ([('a', 4.0)], 1)  # shared, its own value
    assert told(functools.partial(_tell, 'b'), jnp.float32(3.0)) == ([('b', 6.0)], 0)  # another argument: anew
    mine: list = []
    before = shared_programs.PROGRAMS.counts['hit']
    for x in (1.0, 2.0):
        run(lambda v: mine.append(float(v)), jnp.float32(x))  # noqa: B023 -- each run its own closure
    jax.effects_barrier()
    assert mine == [2.0, 4.0] and shared_programs.PROGRAMS.counts['hit'] == before  # a closure: never shared


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


def mappings() -> int:
    with open('/proc/self/maps') as f:
        return sum(1 for _ in f)


@pytest.mark.skipif(not os.path.exists('/proc/sys/vm/max_map_count'), reason='reads Linux memory maps')
def test_many_checks_in_one_process_release_their_compiled_programs(monkeypatch):
    """Each ``assert_port_matches`` leaves compiled programs in JAX's caches, so a pytest session of
    hundreds of them would reach the kernel's map limit (the corpus died at 41 runs). The plugin
    releases them past ``RELEASE_AT`` of the limit: lowered here to one check's growth above where
    this process stands, the mappings never end a check more than one check's growth above that
    line, however many run (without the release they climb by one check's growth each time).
    The suite's shared programs are suspended: this is what a user's process holds."""
    with shared_programs.suspended():
        _many_checks(monkeypatch)


def _many_checks(monkeypatch):
    mlp = workloads.get('mlp')
    check = lambda: testing.assert_port_matches(mlp, devices=1, steps_per_call=2, calls=1, verdict='screen')  # noqa: E731
    check()  # what any first check compiles once
    before = mappings()
    check()
    grown = mappings() - before
    assert grown > 0, 'a check left nothing behind: nothing to release'
    with open('/proc/sys/vm/max_map_count') as f:
        line = mappings() + grown
        monkeypatch.setattr(testing, 'RELEASE_AT', line / int(f.read()))
    held = []
    for _ in range(4):
        check()
        held.append(mappings())
    assert max(held) <= line + grown, (line, grown, held)


def test_linen_init_is_traced_once_per_port_model_and_example():
    """A check per device count of one port (a team's test parametrized over D) reuses one ``jax.jit`` of linen's
    init, so that it is traced and compiled once; another port object, a model rebuilt with other settings or
    another example each get their own (the control: the key is not a constant)."""
    import dataclasses

    from equivalence.core.port.config import RunConfig
    from equivalence.core.run import inputs

    port = workloads.get('mlp')

    def init(p, devices=2, seed=0):
        config = RunConfig(workload=p.name, devices=devices, steps_per_call=1, calls=1, batch_size=8, seed=seed)
        return inputs.start(p, config).init

    first = init(port)
    assert init(port, devices=4) is first and init(port, devices=1) is first
    assert init(dataclasses.replace(port)) is not first  # another port object
    assert init(port, seed=1) is not first  # another seed: another example row
    # the same port object whose model is rebuilt with other settings (a global a team changed): initialised anew
    hidden = {'width': 30}
    settable = dataclasses.replace(port, legacy_model=lambda: type(port.legacy_model())(hidden=hidden['width']))
    before = init(settable)
    hidden['width'] = 31
    after = init(settable)
    assert after is not before and init(settable) is after
    shapes = [x.shape for x in jax.tree.leaves(after(jax.random.PRNGKey(0)))]
    assert any(31 in shape for shape in shapes), shapes  # the rebuilt model's own width
