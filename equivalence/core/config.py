"""The typed run configuration, and the validation that turns bad input into one clear line."""

import dataclasses

RNG_MODES = ('per-device', 'global')
STRATEGIES = ('dp', 'fsdp', 'tp', 'fsdp-tp', 'shard_map')  # nnx_sharded.sharding.STRATEGIES, without importing JAX
NNX_FORMS = ('split', 'graph')


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
    strategy: str = 'dp'  # how the NNX side places its state: dp, fsdp, tp, fsdp-tp, shard_map (README: Strategies)
    mesh: tuple[tuple[str, int], ...] | None = None  # fsdp-tp's mesh, e.g. (('data', 4), ('model', 2))
    nnx_form: str = 'split'  # 'split': jax.jit(lax.scan) over split state; 'graph': nnx.jit(nnx.scan) over objects

    def __post_init__(self):
        self._check_placement()
        for name in ('devices', 'steps_per_call', 'calls', 'batch_size'):
            if getattr(self, name) < 1:
                raise ConfigError(f'{_flag(name)} must be at least 1, got {getattr(self, name)}')
        if self.rng_mode not in RNG_MODES:
            raise ConfigError(f'--rng must be one of {", ".join(RNG_MODES)}, got {self.rng_mode!r}')
        if self.perturb <= -1.0:
            raise ConfigError(f'--perturb must be greater than -1 (it scales the learning rate), got {self.perturb}')
        if self.batch_size % self.devices:
            raise ConfigError(_indivisible(self.batch_size, self.devices))

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
            raise ConfigError(f'--mesh {mesh_text(self.mesh)} has {self.mesh[0][1] * self.mesh[1][1]} devices, '
                              f'--devices is {self.devices}')  # fmt: skip

    @property
    def mesh_axes(self) -> dict[str, int] | None:
        return dict(self.mesh) if self.mesh else None

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


def _indivisible(batch: int, devices: int) -> str:
    lower, upper = batch - batch % devices, batch - batch % devices + devices
    nearest = f'{lower} or {upper}' if lower else f'{upper}'
    counts = [d for d in range(1, devices + 1) if batch % d == 0]
    return (
        f'--batch-size {batch} is not divisible by --devices {devices}: '
        f'use --batch-size {nearest}, or --devices in {counts}'
    )
