"""The typed run configuration, and the validation that turns bad input into one clear line.

Every value a user can type is checked here (``RunConfig.__post_init__`` and the small
``check_*`` functions the commands share), before any work starts: a bad value is a
``ConfigError``, which the commands print as one ``error: ...`` line and exit 2.
"""

import dataclasses
import math

from equivalence.core.port import installed
from equivalence.core.port.plan import Judging, Run, Shape, part

RNG_MODES = ('per-device', 'global')
STRATEGIES = ('dp', 'fsdp', 'tp', 'fsdp-tp', 'shard_map')  # nnx_sharded.sharding.STRATEGIES, without importing JAX
NNX_FORMS = ('split', 'graph')
VERDICTS = ('measured', 'strict', 'screen')  # equivalence.core.judge.judge: what the verdict measures
PRECISIONS = ('auto', 'highest', 'default')  # equivalence.core.measure.precision: matrix products' precision
TWINS = ('program', 'devices')  # equivalence.core.twins.twin: what measures the floor
SEED_LIMIT = 2**32  # np.random.default_rng takes any seed >= 0, jax.random.PRNGKey keeps only 32 bits
MAX_EXAMPLES = 2**22  # examples generated on the host for one run (steps x global batch): ~0.7 GB for mlp
MAX_PERTURB = 1e3  # a deliberate mismatch needs 1e-3; a 1001x learning rate is far past any use


class ConfigError(ValueError):
    """Bad user input. The CLIs print ``error: <message>`` and exit 2."""


@dataclasses.dataclass(frozen=True)
class RunConfig(Shape):
    workload: str = 'mlp'  # registry name, see equivalence.core.port.workloads.WORKLOADS
    devices: int = 8  # D: pmap replicas on the legacy side, mesh size on the NNX side
    steps_per_call: int = 5  # K: steps fused into one compiled call (score_sde's n_jitted_steps)
    calls: int = 4  # C: compiled calls; K * C steps in all
    batch_size: int = 64  # G: global batch, split evenly over the D devices
    seed: int = 0  # one seed for the data, the initial parameters and every key; 0 <= seed < 2**32
    rng_mode: str = 'per-device'  # 'per-device' (score_sde) or 'global' (one key per global batch)
    perturb: float = 0.0  # NNX learning rate * (1 + perturb): a deliberate mismatch
    strategy: str = 'dp'  # how the NNX side places its state: dp, fsdp, tp, fsdp-tp, shard_map (docs/strategies.md)
    mesh: tuple[tuple[str, int], ...] | None = None  # fsdp-tp's mesh, e.g. (('data', 4), ('model', 2))
    nnx_form: str = 'split'  # 'split': jax.jit(lax.scan) over split state; 'graph': nnx.jit(nnx.scan) over objects
    verdict: str = 'measured'  # measured: twin floor always; strict: + first-step gradients; screen: twin if it fails
    locate: bool | None = None  # where the first step parts (verdict.locate): None: on MISMATCH; True: MATCH too
    precision: str = 'auto'  # auto: highest on an accelerator (said), as it is on CPU
    default_gap: bool = False  # --default-gap: on an accelerator at highest, both sides again at the default (said)
    twin: str = 'program'  # the floor's twin: the run's own program, inputs one spacing off; or other device counts
    reference: str | None = None  # --reference: the pmap side read from this recording, not run (verdict.referenced)
    available: dataclasses.InitVar[int | None] = None  # devices JAX sees; None: not checked (library use)
    data_k: dataclasses.InitVar[int] = 1  # bench: each call's data covers max(K, data_k) steps

    def __post_init__(self, available: int | None, data_k: int):
        for name in ('devices', 'steps_per_call', 'calls', 'batch_size'):
            check_count(_flag(name), getattr(self, name))
        check_seed(self.seed)
        if self.rng_mode not in RNG_MODES:
            raise ConfigError(f'--rng must be one of {", ".join(RNG_MODES)}, got {self.rng_mode!r}')
        check_perturb(self.perturb)
        if self.verdict not in VERDICTS:
            raise ConfigError(f'--verdict must be one of {", ".join(VERDICTS)}, got {self.verdict!r}')
        if self.precision not in PRECISIONS:
            raise ConfigError(f'--precision must be one of {", ".join(PRECISIONS)}, got {self.precision!r}')
        if self.twin not in TWINS:
            raise ConfigError(f'--twin must be one of {", ".join(TWINS)}, got {self.twin!r}')
        self._check_placement()
        if available is not None:
            check_available(self.devices, available)  # before divisibility: its suggestions assume D fits
        check_examples(self.calls, self.steps_per_call, self.batch_size, data_k)
        if self.batch_size % self.devices:
            data_steps = self.calls * max(self.steps_per_call, data_k)
            raise ConfigError(_indivisible(self.batch_size, self.devices, available, data_steps))

    def _check_placement(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ConfigError(f'--strategy must be one of {", ".join(STRATEGIES)}, got {self.strategy!r}')
        if self.nnx_form not in NNX_FORMS:
            raise ConfigError(f'--nnx-form must be one of {", ".join(NNX_FORMS)}, got {self.nnx_form!r}')
        if self.strategy == 'shard_map' and self.nnx_form == 'graph':
            raise ConfigError(
                '--strategy shard_map is per-device code over split state; --nnx-form graph does not apply'
            )
        if self.mesh is None:
            return
        if self.strategy != 'fsdp-tp':
            raise ConfigError(f'--mesh shapes the 2-D fsdp-tp mesh; --strategy {self.strategy} has a 1-D mesh')
        if [name for name, _ in self.mesh] != ['data', 'model'] or any(size < 1 for _, size in self.mesh):
            raise ConfigError(f'--mesh must be data=A,model=B with A, B >= 1, got {mesh_text(self.mesh)}')
        if self.mesh[0][1] * self.mesh[1][1] != self.devices:
            raise ConfigError(
                f'--mesh {mesh_text(self.mesh)} has {self.mesh[0][1] * self.mesh[1][1]} devices, '
                f'--devices is {self.devices}'
            )

    @property
    def run(self) -> Run:
        """What the two sides need of this check (``plan.Run``): the part every side's room is handed."""
        return part(Run, self)

    @property
    def judging(self) -> Judging:
        """What the verdict measures beyond the two runs (``plan.Judging``)."""
        return part(Judging, self)


def check_count(flag: str, value: int, maximum: int | None = None) -> None:
    """A count the user typed: at least 1, and at most ``maximum`` when there is one."""
    if value < 1:
        raise ConfigError(f'{flag} must be at least 1, got {value}')
    if maximum is not None and value > maximum:
        raise ConfigError(f'{flag} must be at most {maximum:,}, got {value:,}')


def check_seed(seed: int) -> None:
    if not 0 <= seed < SEED_LIMIT:
        raise ConfigError(f'--seed must be in 0 .. {SEED_LIMIT - 1} (a 32-bit JAX key), got {seed}')


def check_perturb(perturb: float) -> None:
    if not math.isfinite(perturb) or not -1.0 < perturb <= MAX_PERTURB:
        raise ConfigError(
            f'--perturb must be a finite number above -1 and at most {MAX_PERTURB:g} '
            f'(the NNX learning rate is multiplied by 1 + REL), got {perturb}'
        )


def check_available(devices: int, available: int) -> None:
    """Raise unless ``devices`` fit on the devices JAX sees."""
    if devices > available:
        raise ConfigError(
            f'--devices {devices} asks for more devices than the {available} available; '
            f'on CPU, set {installed.cpu_devices(devices)} to simulate more'
        )


def check_examples(calls: int, steps_per_call: int, batch: int, data_k: int = 1) -> None:
    """The host generates the data of every call up front: refuse what would not fit in memory."""
    steps = calls * max(steps_per_call, data_k)
    if steps * batch > MAX_EXAMPLES:
        k = f'--steps-per-call {steps_per_call}' if data_k <= 1 else f'max(--steps-per-call {steps_per_call}, {data_k})'
        raise ConfigError(
            f'--calls {calls} x {k} = {steps:,} steps of --batch-size {batch} is {steps * batch:,} examples, '
            f'more than the {MAX_EXAMPLES:,} this suite generates on the host; lower one of them'
        )


def parse_mesh(text: str) -> tuple[tuple[str, int], ...]:
    """``'data=4,model=2'`` -> ``(('data', 4), ('model', 2))``; ConfigError on anything else."""
    try:
        pairs = [part.split('=') for part in text.split(',')]
        return tuple((name.strip(), int(size)) for name, size in pairs)
    except ValueError:
        raise ConfigError(f'--mesh must be data=A,model=B (e.g. data=4,model=2), got {text!r}') from None


def mesh_text(mesh) -> str:
    return ','.join(f'{name}={size}' for name, size in mesh)


def _flag(field: str) -> str:
    return '--' + field.replace('_', '-')


def _indivisible(batch: int, devices: int, available: int | None, data_steps: int) -> str:
    """The error, naming only batches and device counts that would themselves be accepted."""
    lower = batch - batch % devices
    batches = [b for b in (lower, lower + devices) if 1 <= b and data_steps * b <= MAX_EXAMPLES]
    counts = [d for d in range(1, min(available or devices, batch) + 1) if batch % d == 0]  # no divisor > batch
    use = f'use --batch-size {" or ".join(map(str, batches))}, or ' if batches else 'use '
    return f'--batch-size {batch} is not divisible by --devices {devices}: {use}--devices in {counts}'
