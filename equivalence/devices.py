"""Device setup for the commands, the pytest plugin and programs that call the suite.

The simulated CPU device count must be fixed before JAX starts its backend. Requested
before ``import jax``, it goes through ``JAX_NUM_CPU_DEVICES``; after ``import jax`` but
before the first JAX operation, through ``jax.config``; once the backend is running, the
program has chosen its devices and nothing is changed (the suite then uses what it sees).

A process that runs many checks (the corpus, a pytest session of the plugin) releases the
programs they compiled before the kernel's memory-map limit ends it (``release_compiled_programs``).
"""

import os
import re
import sys

from equivalence import compat

SIMULATED_CPU_DEVICES = 8  # what a CPU-only machine simulates unless told otherwise


def user_chose_cpu_count() -> bool:
    return 'JAX_NUM_CPU_DEVICES' in os.environ or 'xla_force_host_platform_device_count' in os.environ.get(
        'XLA_FLAGS', ''
    )


def default_count() -> int:
    """The devices a single CPU-only process would see: the user's count, else the simulated 8."""
    flag = re.search(r'xla_force_host_platform_device_count=(\d+)', os.environ.get('XLA_FLAGS', ''))
    return int(os.environ.get('JAX_NUM_CPU_DEVICES') or (flag and flag.group(1)) or SIMULATED_CPU_DEVICES)


def without_device_count(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` less its CPU device count (``JAX_NUM_CPU_DEVICES`` and XLA's flag for it), other
    XLA flags kept: the environment of a process that chooses its own count."""
    env = {k: v for k, v in environ.items() if k != 'JAX_NUM_CPU_DEVICES'}
    flags = [f for f in env.pop('XLA_FLAGS', '').split() if 'xla_force_host_platform_device_count' not in f]
    return {**env, 'XLA_FLAGS': ' '.join(flags)} if flags else env


def simulate_cpu_devices(n: int = SIMULATED_CPU_DEVICES) -> None:
    """Ask for ``n`` CPU devices unless the user or the program chose a count. Harmless where
    a GPU exists: JAX's default backend is then the GPU and this only shapes the CPU backend."""
    if user_chose_cpu_count():
        return
    if 'jax' not in sys.modules:
        os.environ['JAX_NUM_CPU_DEVICES'] = str(n)
        if compat.version() < (0, 5):  # jax 0.4 (the recorder's, docs/record.md) reads XLA's flag alone
            os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} --xla_force_host_platform_device_count={n}'
        return
    import jax

    try:
        jax.config.update('jax_num_cpu_devices', n)
    except RuntimeError:  # the backend is running: the program has chosen its devices
        pass


def quiet_xla_warnings() -> None:
    """XLA's own warnings off unless the user set ``TF_CPP_MIN_LOG_LEVEL`` (its errors stay): the recorded
    first step gathers each sharded value for the host, and XLA's partitioner says so once per value
    ('Involuntary full rematerialization'), 48 to 246 lines burying a check's report (tried blind on
    google-research/vdm's port, on a correct MATCH). Read as XLA starts: before ``import jax``."""
    os.environ.setdefault('TF_CPP_MIN_LOG_LEVEL', '2')


def release_compiled_programs(share: float = 0.5) -> None:
    """``jax.clear_caches()`` once this process holds more than ``share`` of the kernel's memory-map
    limit. Every check compiles its own programs and JAX's caches keep some after the check ends
    (measured: mlp at D=1, one executable and about 107 mappings a check; a loop-port Transformer
    MISMATCH about 3,000), and at the default limit of 65,530 the corpus died with "LLVM
    compilation error: Cannot allocate memory" after 41 runs. Clearing on every check instead
    would recompile what checks share (18 s a corpus run against 25 s measured), and would throw
    away a notebook's or a test session's own traces each time: here they go only when the process
    would otherwise die. Not Linux: nothing to read, nothing done."""
    try:
        with open('/proc/self/maps') as f:
            held = sum(1 for _ in f)
        with open('/proc/sys/vm/max_map_count') as f:
            limit = int(f.read())
    except (OSError, ValueError):
        return
    if held > share * limit:
        import jax

        jax.clear_caches()
