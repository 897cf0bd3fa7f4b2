"""The orchestration of one check: the port validated and traced (pre-flight), both paths run
from the same seed and data (``run.sides``), judged against their measured noise floor
(``verdict.judge``). It sits above every room of ``core``; nothing in ``core`` imports it.
"""

import dataclasses

import jax

from equivalence.core import kinds, preflight
from equivalence.core.port.config import ConfigError, RunConfig
from equivalence.core.port.ports import Port
from equivalence.core.run import randomness
from equivalence.core.run.setups import check_names, has_batch_stats, make_inputs
from equivalence.core.run.sides import Progress, compared, run_legacy, run_nnx, silent
from equivalence.core.verdict import hints
from equivalence.core.verdict.judge import RunResult, judged
from equivalence.core.verdict.outcome import Outcome


def validate(port: Port, config: RunConfig) -> None:
    """What a port cannot do with these flags, as ``ConfigError`` (exit 2), before any work."""
    if config.rng_mode not in port.rng_modes:
        raise ConfigError(f'--rng {config.rng_mode}: port {port.name!r} supports {", ".join(port.rng_modes)}')
    kind = kinds.of(port)
    kind.validate(config)
    if config.strategy == 'shard_map' and has_batch_stats(port):
        raise ConfigError('--strategy shard_map: the model has BatchNorm, whose statistics would be per device here')


def run(port: Port, config: RunConfig, progress: Progress | None = None, diagnose: bool = True) -> RunResult:
    """Both paths, then the comparison of parameters, optimizer state, EMA, stats, losses.

    The two sides' variable names are paired first: a port whose names do not pair stops
    here, before any training (``naming.PortError``). ``progress``, if given, is called
    after each of the 2 * C compiled calls. ``diagnose=False``: a MISMATCH is neither diagnosed nor
    located (a run whose match alone is read, as the masked-loss hint's on 1 device).
    """
    validate(port, config)
    kind = kinds.of(port)
    preflight.check(kind, config)  # every port traced abstractly: a mistake in it is exit 2, before training
    variables, calls, rng = make_inputs(port, config)
    check_names(port, variables)
    randomness.take_unbridged()  # what earlier runs traced is theirs
    old = run_legacy(kind, config, variables, calls, rng, progress or silent)
    new = run_nnx(kind, config, variables, calls, rng, progress or silent)
    tree, notes = compared(kind, old, new)
    result = judged(kind, config, old, new, variables, calls, rng, tree, diagnose)
    result.programs = kind.programs()
    result.notes += notes
    if diagnose:  # the hint runs both sides again on 1 device: part of a MISMATCH's diagnosis
        on_one = lambda: _matches_on_one(port, config)  # noqa: E731
        result.notes += hints.masked_loss(config.devices, calls[0], result.outcome, on_one)
    return result


def _matches_on_one(port: Port, config: RunConfig) -> bool:
    """Whether the same run matches on one device (data parallel, one process): the masked-loss hint's test."""
    if jax.process_count() != 1 or config.strategy != 'dp':
        return False
    try:
        return run(port, dataclasses.replace(config, devices=1), diagnose=False).outcome is Outcome.MATCH
    except ConfigError:
        return False


def check(port: Port, diagnose: bool = True, **flags) -> RunResult:
    """Run both paths of ``port`` on this process's devices and compare them: the library form
    of ``python -m equivalence.run``. ``flags`` are ``RunConfig`` fields (``devices`` defaults
    to every device JAX sees, ``batch_size`` to the port's); bad values raise ``ConfigError``.
    ``diagnose=False``: a MISMATCH is the verdict and its leaves only, with no diagnosis, location or
    hint, each of which runs both sides' first steps again (about half a MISMATCH's time): for a
    test that expects a slip to fail."""
    flags.setdefault('devices', len(jax.devices()))
    flags.setdefault('batch_size', port.default_batch)
    flags.setdefault('rng_mode', port.rng_modes[0])
    config = RunConfig(workload=port.name, available=len(jax.devices()), **flags)
    return run(port, config, diagnose=diagnose)
