"""A new side's own ``jax.jit`` pinned to a mesh of other devices than the suite's: the port's one line."""

import contextlib

import jax

from equivalence.core.port.config import ConfigError
from equivalence.core.port.ports import LoopPort

# what jax.jit says of inputs placed elsewhere than its shardings: its in_shardings; its out_shardings alone
PINNED = ('does not match the sharding on the respective arg', 'Received incompatible devices for jitted computation')


def pinned(port: LoopPort, mesh, error: ValueError) -> ConfigError:
    """A new step whose ``jax.jit`` names its own shardings (a mesh built from ``jax.devices()`` at import)
    run on a mesh of other devices: the port's, exit 2, with the two ways to run it."""
    field = 'new_step' if port.new_step is not None else 'new_call'
    n, seen = mesh.size, len(jax.devices())
    clause = str(error).split('. Got ', 1)[-1].splitlines()[0][:200]
    return ConfigError(
        f'port {port.name!r}: {field} is a jax.jit pinned to its own shardings ({clause}); the suite placed its '
        f'inputs on {n} of the {seen} devices this process sees: run it with --devices {seen}, or in a process '
        f'that sees {n} devices (JAX_NUM_CPU_DEVICES={n} on CPU)'
    )


@contextlib.contextmanager
def pinned_to_its_mesh(port: LoopPort, mesh):
    """A new side's own ``jax.jit`` whose shardings name a mesh of other devices than the suite's: the
    port's one line (``pinned``), not an internal error."""
    try:
        yield
    except ValueError as e:
        if not any(said in str(e) for said in PINNED):
            raise
        raise pinned(port, mesh, e) from None
