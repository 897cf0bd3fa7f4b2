"""Guides that cannot rot: README.md and docs/*.md checked against the code.

- Every ``python -m equivalence...`` line of a fenced shell block goes through that command's
  own validation, with no training: it must be accepted, or, marked ``# exit 2`` or
  ``# refused`` in its comment, refused with one ``error:`` line. A line that starts with
  ``cd FOLDER &&`` names its port from that folder (``examples/mlp_port`` otherwise).
- Every Python block marked ``<!-- complete example: FOLDER/FILE -->`` is written over a fresh
  copy of FOLDER, and that folder's tests run there.
- Every relative link resolves, to a file and, with ``#anchor``, to a heading (GitHub's rules).
- The help teaches: every ``--help`` names ``module:NAME``; ``python -m equivalence`` lists the
  commands and every guide, and imports no JAX.
"""

import dataclasses
import glob
import importlib
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, message_lines, own_modules, run_pytest_in

from equivalence import cli
from equivalence.distributed import launch, worker

PAGES = ['README.md', *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'docs', '*.md')))]
SHELL = {'bash', 'sh', 'shell', 'console'}
REFUSED = re.compile(r'#.*\b(exit 2|refused)\b')  # the comment that marks an example of refused input
COMPLETE = re.compile(r'<!--\s*complete example:\s*(\S+)\s*-->')
COMMANDS = {
    'equivalence': 'equivalence.__main__',
    'equivalence.run': 'equivalence.run',
    'equivalence.record': 'equivalence.record',
    'equivalence.explain': 'equivalence.explain.__main__',
    'equivalence.bench': 'equivalence.bench.__main__',
    'equivalence.pitfalls': 'equivalence.pitfalls.__main__',
    'equivalence.checkpoint': 'equivalence.checkpoint.__main__',
    'equivalence.corpus': 'equivalence.corpus.__main__',
}
EXAMPLE = os.path.join(ROOT, 'examples', 'mlp_port')  # where the guides' `my_port:NAME` lines run


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    lang: str
    text: str
    marker: str  # the HTML comment on the line before the fence, if any


@dataclasses.dataclass(frozen=True)
class Command:
    page: str
    line: int
    module: str  # 'equivalence.run'
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]  # NAME=value words before `python`
    refused: bool
    folder: str = ''  # `cd FOLDER && python -m ...`: where its `my_port:NAME` is imported from

    def __str__(self) -> str:
        return f'{self.page}:{self.line}: python -m {self.module} {shlex.join(self.argv)}'


def read(page: str) -> str:
    with open(os.path.join(ROOT, page), encoding='utf-8') as f:
        return f.read()


def blocks(page: str) -> list[Block]:
    """The fenced blocks of a page, with their language and the comment line before each."""
    found, lines, i = [], read(page).splitlines(), 0
    while i < len(lines):
        if lines[i].startswith('```'):
            start, lang = i, lines[i][3:].strip()
            i += 1
            while i < len(lines) and not lines[i].startswith('```'):
                i += 1
            before = next((line for line in reversed(lines[:start]) if line.strip()), '')
            found.append(Block(page, start + 1, lang, '\n'.join(lines[start + 1 : i]), before.strip()))
        i += 1
    return found


def shell_lines(block: Block) -> list[tuple[int, str]]:
    """``(line number, command line)``: continuations joined; in console blocks only ``$`` lines."""
    out, pending, first = [], '', 0
    for n, line in enumerate(block.text.splitlines(), block.line + 1):
        if block.lang == 'console':
            if not line.startswith('$ '):
                continue
            line = line[2:]
        pending, first = (pending + ' ' + line.rstrip('\\').strip(), first or n)
        if not line.endswith('\\'):
            out.append((first, pending.strip()))
            pending, first = '', 0
    return [(n, line) for n, line in out if line and not line.startswith('#')]


def parse_line(page: str, n: int, line: str) -> list[Command]:
    """Every ``python -m equivalence...`` of one shell line (``&&``, ``;`` and ``|`` separate commands)."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, '#'
    segments, current = [], []
    for token in lexer:
        if token and set(token) <= set('&|;()<>'):
            segments.append(current)
            current = []
        else:
            current.append(token)
    segments.append(current)
    refused = bool(REFUSED.search(line))
    folder = next((words[1] for words in segments if len(words) == 2 and words[0] == 'cd'), '')
    return [dataclasses.replace(c, folder=folder) for words in segments if (c := command(page, n, words, refused))]


def command(page: str, n: int, words: list[str], refused: bool) -> Command | None:
    for i, word in enumerate(words[:-2]):
        if re.fullmatch(r'python3?', word) and words[i + 1] == '-m' and words[i + 2].split('.')[0] == 'equivalence':
            env = tuple(tuple(w.split('=', 1)) for w in words[:i] if re.fullmatch(r'[A-Z_][A-Z0-9_]*=.*', w))
            return Command(page, n, words[i + 2], tuple(words[i + 3 :]), env, refused)
    return None


def documented_commands() -> list[Command]:
    return [
        c
        for page in PAGES
        for block in blocks(page)
        if block.lang in SHELL
        for n, line in shell_lines(block)
        for c in parse_line(page, n, line)
    ]


DOCUMENTED = documented_commands()


class Accepted(BaseException):
    """Raised where a command would start working: every check before it passed. A BaseException,
    so that the commands' own ``except Exception`` (exit 3) does not catch it."""


def validate(cmd: Command, monkeypatch) -> int:
    """The command's own entry point, stopped where work would start: 0 accepted, else the exit
    code. Nothing trains, compiles or starts a process: the work, the launcher's start and the
    worker's join are replaced; device counts are those a fresh CPU-only shell would see."""
    module = importlib.import_module(COMMANDS[cmd.module])
    devices = dict(cmd.env).get('JAX_NUM_CPU_DEVICES', '8')
    for name, value in cmd.env:
        monkeypatch.setenv(name, value)
    monkeypatch.setenv('JAX_NUM_CPU_DEVICES', devices)
    monkeypatch.delenv(cli.INJECT_INTERNAL_ERROR, raising=False)
    monkeypatch.setattr(cli, 'available_devices', lambda n=None: int(devices) if n is None else n)
    monkeypatch.setattr(launch, 'start', lambda *a, **k: _accept())
    monkeypatch.setattr(worker, 'run', lambda args, run_command: run_command())
    if hasattr(module, 'work'):
        monkeypatch.setattr(module, 'work', lambda validated: _accept())
    try:
        return module.main(list(cmd.argv))
    except Accepted:
        return 0
    except SystemExit as e:  # --help (0), or bad input (2)
        return e.code


def _accept():
    raise Accepted


@pytest.mark.parametrize('cmd', DOCUMENTED, ids=str)
def test_documented_command_line_passes_its_commands_validation(cmd, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)  # relative report and checkpoint paths name nothing that exists
    _references_recorded(cmd.argv)
    folder = os.path.join(ROOT, cmd.folder) if cmd.folder else EXAMPLE
    monkeypatch.syspath_prepend(folder)
    with own_modules(folder):
        code = validate(cmd, monkeypatch)
    err = capsys.readouterr().err
    if cmd.refused:
        assert code == 2, f'{cmd}\nis marked as refused input, but exit {code}'
        lines = message_lines(err)
        assert len(lines) == 1 and lines[0].startswith('error: '), f'{cmd}\n{err}'
    else:
        assert code == 0, f'{cmd}\nis refused (exit {code}):\n{err}'


def _references_recorded(argv: tuple[str, ...]) -> None:
    """Each ``--reference FILE`` a documented line reads (its run's flags, as it validates them) written as the
    guide's ``record`` line writes it: examples/mlp_port's LOOP, 2 devices, record's defaults (nothing recorded)."""
    from equivalence.core.port.config import RunConfig
    from equivalence.core.reference import reference

    config = RunConfig(workload='mlp-port-loop', devices=2, rng_mode='global')  # K = 5, C = 4, batch 64: record's
    for flag, path in zip(argv, argv[1:], strict=False):
        if flag == '--reference':
            reference.save(path, config, 'mlp-port-loop', {})


def test_every_command_is_documented_and_some_refusals_are_shown():
    assert {c.module for c in DOCUMENTED} == set(COMMANDS)
    assert sum(c.refused for c in DOCUMENTED) >= 5
    assert any('--processes' in c.argv for c in DOCUMENTED)
    assert any(a.startswith('my_port:') for c in DOCUMENTED for a in c.argv)


# -- complete examples, executed from a fresh directory --------------------------------------------


def complete_examples() -> dict[str, dict[str, str]]:
    """``{folder: {file: code}}``; blocks marked for the same file are joined in page order."""
    examples: dict[str, dict[str, str]] = {}
    for page in PAGES:
        for block in blocks(page):
            if block.lang == 'python' and (m := COMPLETE.fullmatch(block.marker)):
                folder, file = os.path.split(m.group(1))
                files = examples.setdefault(folder, {})
                files[file] = files.get(file, '') + block.text + '\n\n'
    return examples


EXAMPLES = complete_examples()


def test_the_readme_has_complete_examples():
    assert 'examples/mlp_port' in EXAMPLES and {'my_port.py', 'test_port.py'} <= set(EXAMPLES['examples/mlp_port'])


@pytest.mark.parametrize('folder', sorted(EXAMPLES))
def test_complete_example_runs_from_a_fresh_directory(folder, tmp_path):
    """The blocks over a copy of their folder; then that folder's tests, on 1 simulated device
    (the larger device counts skip, saying how to get them; the example's test across 2 processes
    of 2 devices starts its workers): the documented code trains to a MATCH, and the plugin's warning
    filter is in force (the pmap side donates its batch, which XLA cannot reuse: a warning without it)."""
    for name in os.listdir(os.path.join(ROOT, folder)):
        if name.endswith('.py'):
            shutil.copy(os.path.join(ROOT, folder, name), tmp_path)
    for name, code in EXAMPLES[folder].items():
        (tmp_path / name).write_text(code)
    # this checkout's suite, as `pip install -e` gives
    proc = run_pytest_in(tmp_path, env={'PYTHONPATH': ROOT, 'JAX_NUM_CPU_DEVICES': '1'}, timeout=300)
    assert proc.returncode == 0 and ' passed' in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert 'Some donated buffers' not in proc.stdout, proc.stdout[-3000:]


# -- links ------------------------------------------------------------------------------------------

LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)(?:\s+"[^"]*")?\)')


def prose(page: str) -> str:
    """The page without its fenced blocks and inline code, where links are not links."""
    text = re.sub(r'^```.*?^```', '', read(page), flags=re.S | re.M)
    return re.sub(r'`[^`\n]*`', '', text)


def anchors(page: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    counts: dict[str, int] = {}
    found = set()
    for line in prose_lines_with_code(page):
        if m := re.match(r'#{1,6} (.*)', line):
            text = re.sub(r'!?\[([^\]]*)\]\([^)]*\)', r'\1', m.group(1)).strip().lower()
            slug = re.sub(r'[^\w\- ]', '', text).replace(' ', '-')
            n = counts.get(slug, 0)
            found.add(slug if n == 0 else f'{slug}-{n}')
            counts[slug] = n + 1
    return found


def prose_lines_with_code(page: str) -> list[str]:
    """The page's lines outside fenced blocks (headings keep their inline code)."""
    return re.sub(r'^```.*?^```', '', read(page), flags=re.S | re.M).splitlines()


def links() -> list[tuple[str, str]]:
    return [(page, target) for page in PAGES for target in LINK.findall(prose(page))]


@pytest.mark.parametrize('page, target', links())
def test_relative_link_resolves(page, target):
    if re.match(r'[a-z]+:', target):  # https:, mailto:
        return
    path, _, anchor = target.partition('#')
    resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
    assert os.path.exists(os.path.join(ROOT, resolved)), f'{page}: {target} -> {resolved} does not exist'
    if anchor:
        assert resolved.endswith('.md'), f'{page}: {target}: an anchor into a file that is not markdown'
        assert anchor in anchors(resolved), f'{page}: {target}: no heading #{anchor} in {resolved}'


def test_anchors_follow_githubs_rules():
    assert {'python--m-equivalencerun', 'your-port-as-modulename', 'exit-codes'} <= anchors('docs/commands.md')
    assert 'rung-0-to-1-linen-under-jaxjit' in anchors('docs/ladder.md')


# -- the README, and help that teaches ----------------------------------------------------------------


def test_readme_is_short_and_ci_runs_its_test_command_word_for_word():
    readme = read('README.md')
    assert len(readme.splitlines()) <= 250
    [test_command] = [line for line in readme.splitlines() if 'pip install' in line and 'pytest' in line]
    assert "'.[test,data]'" in test_command and test_command in read('.ci/run')


@pytest.mark.parametrize(
    'module, argv, names',
    [
        ('equivalence.run', ['--help'], 'package.module:NAME'),
        ('equivalence.explain.__main__', ['--help'], 'package.module:NAME'),
        ('equivalence.bench.__main__', ['--help'], 'package.module:NAME'),
        ('equivalence.checkpoint.__main__', ['migrate', '--help'], 'module:NAME'),
    ],
)
def test_every_help_names_module_NAME_for_a_port(module, argv, names, capsys):
    with pytest.raises(SystemExit) as done:
        importlib.import_module(module).parse(argv)
    assert done.value.code == 0 and names in ' '.join(capsys.readouterr().out.split())


def test_python_m_equivalence_lists_the_commands_and_every_guide_without_importing_jax():
    code = 'import sys; from equivalence.__main__ import main; code = main([]); print("jax" in sys.modules, code)'
    environ = {**os.environ, 'PYTHONPATH': ROOT}
    proc = subprocess.run([sys.executable, '-c', code], cwd=ROOT, env=environ, capture_output=True, text=True)
    assert proc.stdout.strip().endswith('False 0'), proc.stdout + proc.stderr
    for name in COMMANDS:
        assert f'python -m {name}' in proc.stdout
    listed = set(re.findall(r'docs/[\w-]+\.md', proc.stdout))
    assert listed == {p for p in PAGES if p.startswith('docs/')}, listed
