"""The pmap side recorded once (``record``) and read back by a check in its place (``read``): the inputs both
sides were given (linen's initial variables, each call's data, the key chain), the legacy run call by call
(``sides.run_legacy``'s ``PathResult``), and its first steps recorded module by module, as the location and the
gradient probe read them (``recorded_run.first_steps``, the pmap side alone: step 1, its forward pass, and
steps 1 to ``locate.MAX_STEPS``). The file is ``run.reference``'s.

Recorded in linen's names (the recorder pairs nothing with the new side, which need not be importable where
the pmap code ran); a check renames them with its own pairing (``Recorded.named``). What a check cannot read
from a reference, it does not run: the probes that run the pmap side again (the legacy twin, the deterministic
re-run, the masked-loss hint, the default precision's gap) say so (``Inputs.single_process_probes``), but
the legacy twin, which widens a floor, is recorded with the rest, as a check would run it (``_twin``).
"""

import dataclasses

import jax

from equivalence.core.locate import recorded_run
from equivalence.core.locate.locate import MAX_STEPS
from equivalence.core.port import blame
from equivalence.core.port.kind import Kind
from equivalence.core.port.plan import Run
from equivalence.core.record.recorded import Record
from equivalence.core.reference import reference
from equivalence.core.run import facts, sides
from equivalence.core.run.inputs import Inputs
from equivalence.core.run.sides import PathResult
from equivalence.core.state import convert
from equivalence.core.twins import legacy_twin, unverified

TYPES = {'PathResult': PathResult, 'Record': Record}


@dataclasses.dataclass(frozen=True)
class Recorded:
    """The pmap side of a check, as a reference holds it: its run (``legacy``) and its first steps recorded
    (``first``: ``(steps, forward)`` -> ``(PathResult, {label: Record})``)."""

    legacy: PathResult
    first: dict
    path: str
    environment: dict
    output_layer: frozenset  # the paths of the layer the linen model applies last (``unverified.output_layer``)
    twin: dict  # the legacy twin, run where the pmap side was recorded: {'devices': n, 'result': PathResult or
    # None, 'error': what it raised}
    gone: tuple = ()  # the port's pmap-side fields given as RECORDED: its pmap code cannot run here

    def legacy_twin(self, n: int) -> tuple[PathResult, bool]:
        """``(the pmap side on n devices as it ran where it was recorded, whether it drew with the run's D key
        rows)``, as ``kind.legacy_twin`` gives it; raises
        what it raised there, or where it was recorded on another count."""
        if self.twin.get('devices') != n:
            recorded = self.twin.get('devices')
            raise RuntimeError(
                f'the reference holds it on {recorded} device(s), not {n}'
                if recorded
                else 'the reference holds none: no second device count fitted where it was recorded'
            )
        if self.twin.get('result') is None:
            raise RuntimeError(f'where it was recorded it raised {self.twin.get("error")}')
        return dataclasses.replace(self.twin['result']), bool(self.twin.get('by_rows'))

    def named(self, mapping: dict[str, str]) -> 'Recorded':
        """Its leaves under the new side's names (``mapping``: the check's pairing)."""
        legacy = _renamed(self.legacy, mapping)
        first = {at: (_renamed(result, mapping), raw) for at, (result, raw) in self.first.items()}
        ran = self.twin.get('result')
        twin = self.twin if ran is None else {**self.twin, 'result': _renamed(ran, mapping)}
        last = frozenset(mapping.get(p, p) for p in self.output_layer)
        return dataclasses.replace(self, legacy=legacy, first=first, twin=twin, output_layer=last)

    def other_jax(self) -> str:
        """'' where it was recorded on this JAX and backend; else where it was, in words (``jax 0.4.38, cpu``)."""
        here = reference.environment()
        keys = lambda env: (env['versions'].get('jax'), env['versions'].get('jaxlib'), env.get('backend'))  # noqa: E731
        if keys(self.environment) == keys(here):
            return ''
        versions = self.environment.get('versions', {})
        return f'jax {versions.get("jax")} (jaxlib {versions.get("jaxlib")}, {self.environment.get("backend")})'

    def first_steps(self, steps: int, forward: bool) -> tuple[PathResult, dict]:
        """The pmap side's first ``steps`` steps as ``recorded_run.first_steps`` records them; the whole step's
        where its forward pass alone was not recorded (the locator reads the same calls from it)."""
        held = self.first.get((steps, forward)) or self.first.get((steps, False))
        if held is None:
            raise reference.BadReference(f'reference {self.path}: holds no recording of the first {steps} steps')
        return dataclasses.replace(held[0]), dict(held[1])


def _renamed(result: PathResult, mapping: dict[str, str]) -> PathResult:
    if not mapping:
        return result
    one = lambda params: convert.rename({'params': params}, mapping)['params']  # noqa: E731
    return dataclasses.replace(
        result,
        final=convert.rename(result.final, mapping),
        params_per_call=[one(p) for p in result.params_per_call],
        start=None if result.start is None else one(result.start),
    )


def _twin(kind: Kind, config: Run, inputs: Inputs) -> dict:
    """The legacy twin's run, recorded where a check would run it: what ``legacy_twin.run`` reads."""
    n = legacy_twin.count(config)
    if n is None or config.calls < 2:
        return {'devices': None, 'result': None, 'error': None}
    try:
        other, by_rows = kind.legacy_twin(config, n, inputs)
        return {'devices': n, 'result': dataclasses.replace(other, raw=None), 'by_rows': by_rows, 'error': None}
    except Exception as e:  # noqa: BLE001 -- pmap code written for one device count: the check says what it raised
        return {'devices': n, 'result': None, 'error': f'{type(e).__name__}: {blame.first_line(e)}'}


def record(kind: Kind, config: Run, inputs: Inputs) -> dict:
    """What a reference holds of this run's pmap side (``inputs``: unpaired, ``mapping`` empty): the legacy run,
    then its first steps recorded, each as the check's location would ask for them."""
    with facts.linen_alone(kind.port, inputs.calls[0]) as dropout:
        return _record(kind, config, inputs) | {'dropout': dropout}


def _record(kind: Kind, config: Run, inputs: Inputs) -> dict:
    legacy = dataclasses.replace(sides.run_legacy(kind, config, inputs), raw=None)
    total = sum(jax.tree.leaves(call)[0].shape[0] for call in inputs.calls)
    first = []
    for steps, forward in [(1, True), *((n, False) for n in range(1, min(MAX_STEPS, total) + 1))]:
        results, raw = recorded_run.first_steps(kind, config, inputs, None, steps, forward=forward, only_legacy=True)
        first.append([steps, forward, dataclasses.replace(results['legacy'], raw=None), raw['legacy']])
    held = {'variables': inputs.variables, 'calls': inputs.calls, 'rng': inputs.rng}
    last = sorted(unverified.output_layer(kind.port, inputs.variables, inputs.calls[0], {}))
    return {'inputs': held, 'legacy': legacy, 'first_steps': first, 'twin': _twin(kind, config, inputs),
            'output_layer': last}  # fmt: skip


def read(path: str, kind: Kind, config: Run) -> tuple[dict, Recorded]:
    """``(the inputs' fields: variables, calls, rng; the pmap side, in linen's names)`` of the reference at
    ``path``, refused (``reference.BadReference``, exit 2) where it is damaged or does not fit this run."""
    held = reference.load(path)
    held.fits(config, kind.port.name)
    recorded, here = held.environment.get('backend'), jax.default_backend()
    if recorded != here:  # TPU: float32 divides, square roots and transcendentals not rounded as the CPU rounds them
        raise reference.BadReference(
            f'reference {path}: recorded on {recorded}, this check runs on {here}, which rounds float32 otherwise '
            f'(a correct mlp recorded on a TPU is 5 leaves past its floor here): check on {recorded}, or record '
            f'on {here} (docs/record.md)'
        )
    content, handed = held.content(TYPES), kind.handed_dropout_keys()  # None: the port's own step hands them
    try:
        return _recorded(held, content, handed)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:  # a manifest edited: no recording
        raise held.edited(e) from None


def _recorded(held: reference.Reference, content: dict, handed: bool | None) -> tuple[dict, Recorded]:
    """``read``'s answer from the decoded ``content``; ``handed``: whether the suite hands the new model dropout
    keys (None: the port's own step hands them, as it did when the reference was recorded)."""
    path = held.path
    if handed is not None and bool(content['dropout']) != handed:
        said = 'with' if content['dropout'] else 'without'
        raise reference.BadReference(f'reference {path}: recorded {said} dropout keys handed to the model, and the '
                                     f'new model {"has no" if content["dropout"] else "has"} Dropout or attention '
                                     'layer: the two do not draw the same numbers')  # fmt: skip
    first = {(int(s), bool(f)): (result, raw) for s, f, result, raw in content['first_steps']}
    last = frozenset(content['output_layer'])
    recorded = Recorded(content['legacy'], first, path, held.environment, last, content['twin'])
    return content['inputs'], recorded


def where_recorded(environment: dict) -> str:
    """A reference's environment in a few words: ``jax 0.4.38 (cpu)``."""
    return f'jax {environment.get("versions", {}).get("jax", "?")} ({environment.get("device_kind", "?")})'
