"""The house's rule, read from the code's own imports (``docs/layout.md``): no import circle anywhere
in ``equivalence/``, the rooms of ``core/`` import only the rooms below them, nothing in ``core`` or
``distributed`` imports a command, and the two implementations import neither ``equivalence`` nor
each other. Every import counts, a function's own included: a circle closed inside a function is
still a circle for whoever reads the code.
"""

import ast
import graphlib
import pathlib
import re

import pytest
from conftest import ROOT

PACKAGES = ('equivalence', 'legacy_pmap', 'nnx_sharded')
# The rooms of core, lowest first: a room may import its own and those of a lower rank.
RANK = {
    'state': 0, 'port': 1, 'rng': 2, 'measure': 2, 'compare': 2, 'record': 3, 'trend': 3, 'run': 4, 'preflight': 5,
    'twins': 5, 'locate': 6, 'reference': 7, 'judge': 8, 'kinds': 9, 'report': 9, 'harness': 10,
}  # fmt: skip
# equivalence's library parts: anything else under equivalence/ is a command (or its shared CLI).
LIBRARY = ('core', 'distributed')


def module_name(path: pathlib.Path, root=ROOT) -> str:
    parts = path.relative_to(root).with_suffix('').parts
    return '.'.join(parts[:-1] if parts[-1] == '__init__' else parts)


def modules(root=ROOT) -> dict[str, pathlib.Path]:
    root = pathlib.Path(root)
    return {module_name(p, root): p for pkg in PACKAGES for p in sorted((root / pkg).rglob('*.py'))}


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


def import_graph(root=ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


@pytest.fixture(scope='module')
def graph() -> dict[str, set[str]]:
    return import_graph()


def circle(graph: dict[str, set[str]]) -> list[str]:
    """The modules of one import circle, or [] where there is none."""
    try:
        list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as e:
        return list(e.args[1])
    return []


def test_no_import_circle(graph):
    assert not circle(graph), f'import circle: {" -> ".join(circle(graph))}'


def room(name: str) -> str | None:
    parts = name.split('.')
    return parts[2] if parts[:2] == ['equivalence', 'core'] and len(parts) > 2 else None


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import of a room from a room beside or above it: ``'a -> b'``."""
    return [
        f'{a} -> {b}'
        for a, targets in graph.items()
        for b in targets
        if room(a) and room(b) and room(a) != room(b) and RANK[room(b)] >= RANK[room(a)]
    ]


def test_rooms_import_downwards_only(graph):
    wrong = upward(graph)
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
# What a kind once answered as a flag its callers branched on: a kind answers with behaviour instead.
KIND_FLAGS = {'suite_loops', 'observes_grads', 'checks_draws', 'records_on_mesh', 'step_form'}
PORTS = re.compile(r'(^|_)(port|wl)$')  # a name that holds a port: port, kind.port, port_kind.port, wl
MAX_LINES = 350  # one job per file: no file of the suite longer than this


def _name(node: ast.AST) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, 'id', '')


def kind_branches(source: str) -> list[int]:
    """The lines of ``source`` that ask a port's kind instead of being answered: ``isinstance(x, LoopPort)``
    (or a tuple of port classes) or on a setup class (``isinstance(s, NnxSetup)``), calls of ``adapted(...)``
    (the predicate that once stood for a loop port's form), a kind's flag read (``kind.suite_loops``,
    ``port.step_form``), and ``getattr``/``hasattr`` on a port (``getattr(port, 'new_groups', None)``)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in KIND_FLAGS:
            found.append(node.lineno)
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func)
        if name == 'adapted':
            found.append(node.lineno)
        if name in ('getattr', 'hasattr') and node.args and PORTS.search(_name(node.args[0])):
            found.append(node.lineno)
        if name == 'isinstance' and len(node.args) == 2:
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            names = {_name(c) for c in classes}
            if names & PORT_CLASSES or any(n.endswith('Setup') for n in names):
                found.append(node.lineno)
    return sorted(set(found))


def test_a_ports_kind_is_asked_only_in_the_port_room_and_the_kinds():
    root = pathlib.Path(ROOT)
    wrong = [
        f'{path.relative_to(root)}:{line}'
        for path in sorted((root / 'equivalence').rglob('*.py'))
        if not str(path.relative_to(root)).startswith(KIND_ROOMS)
        for line in kind_branches(path.read_text())
    ]
    assert not wrong, "a port's kind asked outside core/port and core/kinds (let the kind answer):\n" + '\n'.join(wrong)


def test_a_kind_holds_no_flag():
    """Each kind answers with behaviour: no class attribute of a kind is a bool for its callers to branch on."""
    from equivalence.core import kinds

    flags = [f'{cls.__name__}.{name}' for cls in kinds.CLASSES.values() for klass in cls.__mro__
             for name, value in vars(klass).items() if isinstance(value, bool)]  # fmt: skip
    assert not flags, f'flags on the kinds (answer with a method instead): {flags}'


def test_no_file_of_the_suite_is_longer_than_its_one_job():
    root = pathlib.Path(ROOT)
    long = [f'{p.relative_to(root)}: {n} lines' for pkg in PACKAGES for p in sorted((root / pkg).rglob('*.py'))
            if (n := len(p.read_text().splitlines())) > MAX_LINES]  # fmt: skip
    assert not long, f'files over {MAX_LINES} lines (split them by what they do):\n' + '\n'.join(long)


def test_the_rule_sees_a_circle(tmp_path):
    """Negative control: the real walk (``import_graph``), run over a small package written here, finds a
    circle closed inside a function (a relative import, a plain one), and the room that imports upwards."""
    files = {
        'equivalence/__init__.py': '',
        'equivalence/core/__init__.py': '',
        'equivalence/core/run/__init__.py': '',
        'equivalence/core/run/a.py': 'def f():\n    from ..judge import b\n',
        'equivalence/core/judge/__init__.py': '',
        'equivalence/core/judge/b.py': 'import equivalence.core.run.a\n',
    }
    for path, text in files.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    graph = import_graph(tmp_path)
    assert graph['equivalence.core.run.a'] == {'equivalence.core.judge.b'}, graph
    assert set(circle(graph)) == {'equivalence.core.run.a', 'equivalence.core.judge.b'}
    assert upward(graph) == ['equivalence.core.run.a -> equivalence.core.judge.b']
    (tmp_path / 'equivalence/core/judge/b.py').write_text('import json\n')  # the circle broken: none found
    assert circle(import_graph(tmp_path)) == []


def test_the_rule_sees_a_kind_asked():
    """Negative control: every way of asking a kind instead of being answered, however it is written."""
    assert kind_branches('if isinstance(port, LoopPort): pass') == [1]
    assert kind_branches('x = isinstance(p, (ports.ModelPort, int))\ny = adapters.adapted(p)') == [1, 2]
    assert kind_branches('isinstance(setup, setups.NnxSetup)') == [1]
    assert kind_branches('if kind.suite_loops:\n    pass\nx = feed.kind.observes_grads') == [1, 3]
    assert kind_branches("if self.port.step_form == 'carry': pass") == [1]
    assert kind_branches("getattr(port, 'new_groups', None)\nhasattr(kind.port, 'axis_name')") == [1, 2]
    assert kind_branches("getattr(wl, 'eval_data', None)\ngetattr(port_kind.port, 'x')") == [1, 2]
    assert kind_branches("getattr(setup, 'metrics', [])\nisinstance(x, int)\nkind.first_step_probe()") == []
