"""Simulated CPU devices are requested here, before any test module imports JAX."""

import atexit
import contextlib
import importlib
import os
import shutil
import subprocess
import sys
import tempfile

from equivalence import devices
from equivalence.core.measure import said

devices.simulate_cpu_devices()

# What the suite keeps in the temporary folder (a traceback for exit 3, a long error's whole text, the logs of
# --processes' workers, the stages said) goes, for a test and every process it starts, into one folder of
# this session's (TMPDIR, which tempfile and the processes started read), removed when the session ends: the
# tests leave nothing in the system's. The session's first process makes it; pytest-xdist's workers inherit it.
SESSION_TMP_ENV = 'EQUIVALENCE_TESTS_TMP'
if SESSION_TMP_ENV not in os.environ:
    os.environ[SESSION_TMP_ENV] = os.environ['TMPDIR'] = tempfile.mkdtemp(prefix='equivalence-tests-')
    tempfile.tempdir = None  # read again, from TMPDIR
    atexit.register(shutil.rmtree, os.environ[SESSION_TMP_ENV], True)

# Every stage line a check says, here or in a process a test starts, is recorded in this file (``said``):
# ``message_lines`` tells a command's messages from its stages' lines by these records, not by wording.
os.environ[said.EVENTS_ENV] = os.path.join(tempfile.gettempdir(), f'equivalence-stages-{os.getpid()}.jsonl')

# The tests' programs are compiled the way that compiles fastest while keeping what the tests are
# about, the float32 sums of the pmap and jit programs that differ (docs/development.md):
# - XLA's backend (LLVM) optimisation level 1, not 3: about 1.7 times faster (a Transformer's train
#   step 3.9 -> 2.1 s). Level 0 makes the built-in workloads' two sides' sums equal, so it is used only
#   where the figures are not what a test is about, or stay: the processes a few tests start
#   (at_level_0), and the test files that say why in their AT_LEVEL_0 (at_level_0_in_process).
# - XLA's CPU fusions emitted by its older elemental emitters (``--xla_cpu_use_fusion_emitters=false``),
#   not the MLIR fusion emitters: a train step's compile about 1.5 times faster again (score at 8
#   devices 3.6 -> 2.3 s of compiling per check), the same differences between the sides.
# - LLVM's code generated in one piece (``--xla_cpu_parallel_codegen_split_count=1``), not split over
#   threads: each pytest worker has one core, and the split's threads cost more than they gain
#   (test_locate alone: 52.9 -> 49.2 s of CPU). No number changes (score at D = 4: its losses and
#   differences bitwise the same with and without).
# As the sides' sums differ from one CPU to another, no test depends on the figures. A choice given in
# XLA_FLAGS is kept, so that XLA_FLAGS='--xla_backend_optimization_level=3
# --xla_cpu_use_fusion_emitters=true' runs the tests as users' programs compile. The commands the
# tests start inherit these flags.
CHOSEN_HERE = {}  # flag -> value, for the flags set here, not in the XLA_FLAGS given
LEVEL = 'xla_backend_optimization_level'
for flag, value in (
    (LEVEL, '1'),
    ('xla_cpu_use_fusion_emitters', 'false'),
    ('xla_cpu_parallel_codegen_split_count', '1'),
):
    if flag not in os.environ.get('XLA_FLAGS', ''):
        os.environ['XLA_FLAGS'] = f'{os.environ.get("XLA_FLAGS", "")} --{flag}={value}'.strip()
        CHOSEN_HERE[flag] = value


def at_level_0(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` for the processes a test starts, with XLA's backend at level 0 where this file chose the level:
    compiling about 1.6x faster. Only where the float32 differences are not what the test is about, or stay:
    level 0 makes the built-in mlp's two sides bitwise equal (the default run: every difference 0), while the
    examples' real models keep theirs, their convolutions and attention in XLA's runtime kernels (params, D = 2:
    bridge_port 3.1e-4, score_sde_port 4.0e-5, wmt_port 1.2e-7, imagenet_port 6.0e-8; level 1 about the same)."""
    flags = os.environ['XLA_FLAGS']
    if LEVEL in CHOSEN_HERE:
        flags = flags.replace(f'--{LEVEL}={CHOSEN_HERE[LEVEL]}', f'--{LEVEL}=0')
    return {**(env or {}), 'XLA_FLAGS': flags}


# XLA's persistent compilation cache, on by default in the commands and the plugin
# (equivalence/compilation_cache.py), is turned off here, for the commands the tests start too (a
# segmentation fault inside its serialisation once, and entries some CPUs reject: shared_programs.py;
# and a test must not read what an earlier run left in ~/.cache). Instead the tests of one pytest worker
# share the programs they compile, in memory. One test turns it on, in a directory of its own
# (test_cost.py). Set JAX_COMPILATION_CACHE_DIR yourself to use it in every test.
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
    os.environ['EQUIVALENCE_COMPILATION_CACHE'] = '0'

import jax  # noqa: E402
import pytest  # noqa: E402
import shared_programs  # noqa: E402

shared_programs.install()


@pytest.fixture(scope='module', autouse=True)
def at_level_0_in_process(request):
    """A test file that sets ``AT_LEVEL_0 = '<why its subject is not the float32 rounding>'`` has every
    program it compiles in this worker at XLA's backend level 0 (``shared_programs.with_options``: the
    option given to each compile, not the process's flags, which the worker's other files keep), where this
    file chose the level. Module-scoped and autouse, so the file's module fixtures compile so too; JAX's own
    caches are emptied as the file starts and ends, so no program compiled at one level runs in a file of
    the other."""
    if getattr(request.module, 'AT_LEVEL_0', None) is None or LEVEL not in CHOSEN_HERE:
        yield
        return
    with shared_programs.with_options([(LEVEL, '0')]):
        yield


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def require_devices(n: int) -> None:
    have = len(jax.devices())
    if have < n:
        pytest.skip(f'needs {n} devices, JAX sees {have}; run with JAX_NUM_CPU_DEVICES={n} to simulate them')


def run_module(module: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m module args`` from the repository root, as a user on a fresh shell would:
    no device count inherited from this test process, so the CLI makes its own choice."""
    environ = devices.without_device_count(dict(os.environ))
    return subprocess.run(
        [sys.executable, '-m', module, *args],
        cwd=ROOT,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_pytest_in(folder, *args: str, env: dict[str, str] | None = None, timeout: int = 600):
    """``python -m pytest -q`` in ``folder``, as a team runs its own tests there: no device count
    inherited from this test process; ``env`` adds to the environment (``PYTHONPATH``, with this
    checkout's root: the suite, as installed, and ``tests.shared_programs_plugin``, which shares the
    folder's compiled programs between its checks in memory, as this worker does)."""
    environ = {k: v for k, v in devices.without_device_count(dict(os.environ)).items() if k != 'PYTHONPATH'}
    plugin = ['-p', 'tests.shared_programs_plugin']
    return subprocess.run(
        [sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', *plugin, *args],
        cwd=folder,
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def own_modules(folder: str):
    """The folder's modules (``my_port``, ``legacy_code``, ...) imported afresh from it, and the ones
    another example folder imported under the same names put back after."""
    names = [f[:-3] for f in os.listdir(folder) if f.endswith('.py')]
    saved = {name: sys.modules.pop(name) for name in names if name in sys.modules}
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)
        sys.modules.update(saved)


def import_example(name: str, *modules: str) -> tuple:
    """``modules`` of ``examples/<name>``, imported from its folder as the team's own (``own_modules``)."""
    folder = os.path.join(ROOT, 'examples', name)
    sys.path.insert(0, folder)
    try:
        with own_modules(folder):
            return tuple(importlib.import_module(module) for module in modules)
    finally:
        sys.path.remove(folder)


def assert_one_line_error(proc: subprocess.CompletedProcess, expected: str) -> None:
    """Bad input: exit 2, one ``error: ...`` line on stderr naming the problem, no traceback."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = message_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith('error: ') and expected in lines[0], proc.stderr


def message_lines(stderr: str) -> list[str]:
    """stderr's lines less the stages a check says as it works (those ``said`` recorded): its messages."""
    stages = {s.line.strip() for s in said.read(os.environ[said.EVENTS_ENV])}
    return [line for line in stderr.strip().splitlines() if line.strip() not in stages]


# Two workers (pyproject's addopts). The tests of one file share what they build (module fixtures,
# the programs they compile), so a file goes to one worker whole, except where each test starts
# processes of its own: those go one by one, wherever a worker is free. Every file is handed out in
# the order of its measured time, the longest first (``--no-loadscope-reorder`` keeps this order), so
# that the last ones handed out are short: a worker that takes the next file while its own ends (xdist
# gives a worker more once two of its tests are left) can then not keep the other idle for long at the
# end. (Not ``--dist loadgroup``: pytest-xdist 3.8 renames a test's nodeid to group it, which pytest 9
# no longer reads, so its groups are ignored and module fixtures are built on both workers.)
EACH_TEST_ALONE = ('test_real_examples.py', 'test_distributed.py')
LONGEST_FIRST = (  # summed seconds of each file's tests, whole suite, 2026-12-06 (the rest: under 3 s); the two files
    # whose tests go one by one first
    'test_real_examples.py', 'test_distributed.py', 'test_strategies.py', 'test_recording.py', 'test_where.py',
    'test_checkpoint.py', 'test_locate.py', 'test_hostile_ports.py', 'test_pitfalls.py', 'test_stateful.py',
    'test_reference.py', 'test_equivalence.py', 'test_verdict.py', 'test_bench.py', 'test_twins.py',
    'test_attention_dropout.py', 'test_ports.py', 'test_team_checkpoints.py', 'test_step_forms.py',
    'test_cli_properties.py', 'test_new_sides.py', 'test_one_chip.py', 'test_cli.py', 'test_long_lived.py',
    'test_real_models.py', 'test_explain.py', 'test_bench_advice.py', 'test_checkpoint_safety.py', 'test_cost.py',
    'test_docs.py', 'test_corpus.py', 'test_real_states.py',
)  # fmt: skip


def pytest_collection_modifyitems(items: list) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # a hook of pytest-xdist: absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class FileOrTest(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split('::', 1)[0]
            return nodeid if os.path.basename(file) in EACH_TEST_ALONE else file

    return FileOrTest(config, log)
