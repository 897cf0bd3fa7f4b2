"""The house's rule, read from the code's own imports (``docs/layout.md``): no import circle anywhere
in ``equivalence/``, the rooms of ``core/`` import only the rooms below them, nothing in ``core`` or
``distributed`` imports a command, and the two implementations import neither ``equivalence`` nor
each other. Every import counts, a function's own included: a circle closed inside a function is
still a circle for whoever reads the code.
"""

import ast
import graphlib
import pathlib

import pytest
from conftest import ROOT

PACKAGES = ('equivalence', 'legacy_pmap', 'nnx_sharded')
# The rooms of core, lowest first: a room may import its own and those of a lower rank.
RANK = {'port': 0, 'run': 1, 'preflight': 2, 'verdict': 2, 'kinds': 3, 'report': 3, 'harness': 4}
# equivalence's library parts: anything else under equivalence/ is a command (or its shared CLI).
LIBRARY = ('core', 'distributed')


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix('').parts
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def modules() -> dict[str, pathlib.Path]:
    root = pathlib.Path(ROOT)
    return {module_name(p): p for pkg in PACKAGES for p in sorted((root / pkg).rglob('*.py'))}


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The suite's modules that ``name`` imports, anywhere in its body."""
    package = name if path.name == '__init__.py' else name.rpartition('.')[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ''
            if node.level:
                base = '.'.join(
                    package.split('.')[: len(package.split('.')) - node.level + 1] + ([base] if base else [])
                )
            found |= {f'{base}.{a.name}' if f'{base}.{a.name}' in known else base for a in node.names}
    return {m for m in found if m in known and m != name}


@pytest.fixture(scope='module')
def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def test_no_import_circle(graph):
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f'import circle: {" -> ".join(e.args[1])}')


def room(name: str) -> str | None:
    parts = name.split('.')
    return parts[2] if parts[:2] == ['equivalence', 'core'] and len(parts) > 2 else None


def test_rooms_import_downwards_only(graph):
    wrong = [
        f'{a} -> {b}'
        for a, targets in graph.items()
        for b in targets
        if room(a) and room(b) and room(a) != room(b) and RANK[room(b)] >= RANK[room(a)]
    ]
    assert not wrong, 'a room imports its own floor or a higher one:\n' + '\n'.join(wrong)


def test_library_imports_no_command(graph):
    def part(name: str) -> str:
        parts = name.split('.')
        return parts[1] if parts[0] == 'equivalence' and len(parts) > 1 else parts[0]

    wrong = [
        f'{a} -> {b}'
        for a, targets in graph.items()
        for b in targets
        if part(a) in LIBRARY and b.startswith('equivalence') and part(b) not in LIBRARY
    ]
    assert not wrong, 'the library imports a command:\n' + '\n'.join(wrong)


def test_nothing_below_imports_the_orchestration(graph):
    wrong = [f'{a} -> {b}' for a, targets in graph.items() for b in targets
             if b == 'equivalence.core.harness' and room(a)]  # fmt: skip
    assert not wrong, '\n'.join(wrong)


def test_implementations_stand_alone(graph):
    wrong = [
        f'{a} -> {b}'
        for a, targets in graph.items()
        for b in targets
        if a.split('.')[0] in ('legacy_pmap', 'nnx_sharded') and b.split('.')[0] != a.split('.')[0]
    ]
    assert not wrong, '\n'.join(wrong)


# A port's kind is decided once (``core/port/kind.py``) and answered by one object per kind (``core/kinds/``):
# nowhere else may code ask a port's class, nor the old predicate that stood for it.
KIND_ROOMS = ('equivalence/core/port/', 'equivalence/core/kinds/')
PORT_CLASSES = {'LoopPort', 'ModelPort', 'Port'}
MAX_LINES = 350  # one job per file: no file of the suite longer than this


def kind_branches(source: str) -> list[int]:
    """The lines of ``source`` that branch on a port's class: ``isinstance(x, LoopPort)`` (or a tuple of
    port classes), and calls of ``adapted(...)``, the predicate that once stood for a loop port's form."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, 'id', '')
        if name == 'adapted':
            found.append(node.lineno)
        if name == 'isinstance' and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            names = {c.attr if isinstance(c, ast.Attribute) else getattr(c, 'id', '') for c in classes}
            if names & PORT_CLASSES:
                found.append(node.lineno)
    return found


def test_a_ports_kind_is_asked_only_in_the_port_room_and_the_kinds():
    root = pathlib.Path(ROOT)
    wrong = [
        f'{path.relative_to(root)}:{line}'
        for path in sorted((root / 'equivalence').rglob('*.py'))
        if not str(path.relative_to(root)).startswith(KIND_ROOMS)
        for line in kind_branches(path.read_text())
    ]
    assert not wrong, "a branch on a port's class outside core/port and core/kinds (ask the kind):\n" + '\n'.join(wrong)


def test_no_file_of_the_suite_is_longer_than_its_one_job():
    root = pathlib.Path(ROOT)
    long = [f'{p.relative_to(root)}: {n} lines' for pkg in PACKAGES for p in sorted((root / pkg).rglob('*.py'))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]  # fmt: skip
    assert not long, f'files over {MAX_LINES} lines (split them by what they do):\n' + '\n'.join(long)


def test_the_rule_sees_a_circle():
    """Negative control: the walk finds a circle closed inside a function, and a room importing upwards."""
    fake = {
        'equivalence.core.run.a': {'equivalence.core.verdict.b'},
        'equivalence.core.verdict.b': {'equivalence.core.run.a'},
    }
    with pytest.raises(graphlib.CycleError):
        list(graphlib.TopologicalSorter(fake).static_order())
    source = 'def f():\n    from equivalence.core.verdict import judge\n'
    tree_imports = {f'{n.module}.{a.name}' for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)
                    for a in n.names}  # fmt: skip
    assert tree_imports == {'equivalence.core.verdict.judge'}
    assert RANK[room('equivalence.core.verdict.judge')] >= RANK[room('equivalence.core.run.sides')]
    # and a branch on a port's class, however it is written
    assert kind_branches('if isinstance(port, LoopPort): pass') == [1]
    assert kind_branches('x = isinstance(p, (ports.ModelPort, int))\ny = adapters.adapted(p)') == [1, 2]
    assert kind_branches('isinstance(setup, NnxSetup)') == []
