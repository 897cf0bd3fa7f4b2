"""The typed run configuration, and the validation that turns bad input into one clear line."""

import dataclasses

RNG_MODES = ('per-device', 'global')


class ConfigError(ValueError):
    """Bad user input. The CLIs print ``error: <message>`` and exit 2."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    workload: str = 'mlp'  # registry name, see equivalence.core.workloads.WORKLOADS
    devices: int = 8  # D: pmap replicas on the legacy side, mesh size on the NNX side
    steps_per_call: int = 5  # K: steps fused into one compiled call (score_sde's n_jitted_steps)
    calls: int = 4  # C: compiled calls; K * C steps in all
    batch_size: int = 64  # G: global batch, split evenly over the D devices
    seed: int = 0  # one seed for the data, the initial parameters and every key
    rng_mode: str = 'per-device'  # 'per-device' (score_sde) or 'global' (one key per global batch)
    perturb: float = 0.0  # NNX learning rate * (1 + perturb): a deliberate mismatch

    def __post_init__(self):
        for name in ('devices', 'steps_per_call', 'calls', 'batch_size'):
            if getattr(self, name) < 1:
                raise ConfigError(f'{_flag(name)} must be at least 1, got {getattr(self, name)}')
        if self.rng_mode not in RNG_MODES:
            raise ConfigError(f'--rng must be one of {", ".join(RNG_MODES)}, got {self.rng_mode!r}')
        if self.perturb <= -1.0:
            raise ConfigError(f'--perturb must be greater than -1 (it scales the learning rate), got {self.perturb}')
        if self.batch_size % self.devices:
            raise ConfigError(_indivisible(self.batch_size, self.devices))

    @property
    def per_device_batch(self) -> int:
        return self.batch_size // self.devices

    @property
    def steps(self) -> int:
        return self.steps_per_call * self.calls


def check_available(config: RunConfig, available: int) -> None:
    """Raise unless the run fits on the devices JAX sees."""
    if config.devices > available:
        raise ConfigError(
            f'--devices {config.devices} asks for more devices than the {available} available; '
            f'on CPU, set JAX_NUM_CPU_DEVICES={config.devices} to simulate more'
        )


def _flag(field: str) -> str:
    return '--' + field.replace('_', '-')


def _indivisible(batch: int, devices: int) -> str:
    lower, upper = batch - batch % devices, batch - batch % devices + devices
    nearest = f'{lower} or {upper}' if lower else f'{upper}'
    counts = [d for d in range(1, devices + 1) if batch % d == 0]
    return (
        f'--batch-size {batch} is not divisible by --devices {devices}: '
        f'use --batch-size {nearest}, or --devices in {counts}'
    )
