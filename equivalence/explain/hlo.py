"""Reads the collectives out of a compiled program's HLO text (``compiled.as_text()``).

What it counts, and how:
- every all-reduce, all-gather, reduce-scatter, collective-permute and all-to-all (their
  async ``-start`` forms too; ``-done`` halves are not counted twice);
- how often each runs per call: an op inside a while body runs once per iteration, so its
  count is multiplied by the loop's trip count (``known_trip_count``, which XLA records
  for a ``lax.scan``); an op in a loop of unknown trip count gets ``None``;
- its payload: the bytes of the operands each device contributes, read from the operand
  instructions' shapes (an algorithm such as a ring all-reduce sends about 2(n-1)/n times
  that over the wire; that is the runtime's choice, not in the program);
- for each operand, what produced it (a backward-pass op, ``transpose(jvp(...))``, is a
  gradient) and whether the collective was written in the code (``psum``/``pmean`` and
  friends name a JAX collective primitive) or inserted by XLA's SPMD partitioner.
"""

import dataclasses
import functools
import linecache
import os
import re

KINDS = ('all-reduce', 'all-gather', 'reduce-scatter', 'collective-permute', 'all-to-all')
# JAX primitives that lower to a collective: an op named after one was written in the code.
WRITTEN = ('psum', 'pmean', 'pmax', 'pmin', 'all_gather', 'psum_scatter', 'reduce_scatter', 'ppermute', 'all_to_all')
DTYPE_BYTES = {'pred': 1, 's8': 1, 'u8': 1, 's16': 2, 'u16': 2, 'f16': 2, 'bf16': 2, 's64': 8, 'u64': 8, 'f64': 8}
DTYPE_BYTES |= {'s32': 4, 'u32': 4, 'f32': 4, 'c64': 8, 'c128': 16}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: sources we can name

_INSTR = re.compile(
    r'^\s*(?:ROOT )?%(?P<name>\S+) = (?P<shape>.*?) (?P<op>[a-z][a-z0-9\-]*)\((?P<args>[^)]*)\)(?P<rest>.*)$'
)
_COMP = re.compile(r'^(?P<entry>ENTRY )?%(?P<name>\S+) \(.*\{$')
_ARRAY = re.compile(r'([a-z]+[0-9]*)\[([0-9,]*)\]')
_CALLEE = re.compile(r'\b(?:body|condition|calls|to_apply|true_computation|false_computation)=%([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_BODY = re.compile(r'\bbody=%([\w.\-]+)')
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_FRAME = re.compile(r'stack_frame_id=(\d+)')
_INDEX = re.compile(r'\bindex=(\d+)')


@dataclasses.dataclass(frozen=True)
class Instr:
    name: str
    shape: str  # e.g. 'f32[20,30]{1,0}' or a tuple '(f32[30]{0}, f32[])'
    op: str
    args: tuple[str, ...]  # operand names
    rest: str  # attributes after the operand list
    computation: str

    @property
    def op_name(self) -> str:
        m = _OP_NAME.search(self.rest)
        return m.group(1) if m else ''

    @property
    def frame(self) -> int | None:
        m = _FRAME.search(self.rest)
        return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class Operand:
    shape: str  # 'f32[20,30]'
    bytes: int
    role: str  # 'gradient' (made by the backward pass), 'forward' (a forward value, e.g. the loss), 'other'
    written: bool  # True: a collective written in the code (psum, pmean...); False: inserted by XLA
    op_name: str  # the JAX op name XLA kept for this operand's collective
    made_by: str  # the JAX op name of the instruction that produced the operand
    source: str  # 'path/file.py:LINE  code', the innermost frame in this repository, or ''


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of KINDS
    name: str  # the HLO instruction
    operands: tuple[Operand, ...]
    group_size: int | None  # devices in each replica group
    per_call: int | None  # executions per compiled call (None: inside a loop of unknown trip count)
    loop_trips: tuple[int, ...]  # trip counts of the loops around it, outermost first

    @property
    def bytes(self) -> int:
        return sum(o.bytes for o in self.operands)


def array_shapes(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """``'(f32[30]{0}, s32[])'`` -> ``[('f32', (30,)), ('s32', ())]``; tokens are skipped."""
    out = []
    for dtype, dims in _ARRAY.findall(shape):
        if dtype in DTYPE_BYTES:
            out.append((dtype, tuple(int(d) for d in dims.split(',') if d)))
    return out


def nbytes(dtype: str, dims: tuple[int, ...]) -> int:
    n = DTYPE_BYTES[dtype]
    for d in dims:
        n *= d
    return n


def dims(shape: str) -> tuple[int, ...]:
    """``'f32[20,30]'`` -> ``(20, 30)``."""
    inside = shape[shape.index('[') + 1 : shape.index(']')]
    return tuple(int(d) for d in inside.split(',') if d)


def short(dtype: str, dims: tuple[int, ...]) -> str:
    return f'{dtype}[{",".join(map(str, dims))}]'


@dataclasses.dataclass
class Module:
    """One HLO module: its instructions, computations, call graph and stack frames."""

    text: str
    instrs: dict[str, Instr]
    comps: dict[str, list[Instr]]
    entry: str

    @classmethod
    def parse(cls, text: str) -> 'Module':
        instrs, comps, entry, current = {}, {}, '', ''
        for line in text.splitlines():
            if m := _COMP.match(line):
                current = m.group('name')
                comps[current] = []
                entry = current if m.group('entry') else entry
            elif current and (m := _INSTR.match(line)):
                names = tuple(re.findall(r'%([\w.\-]+)', m.group('args')))
                ins = Instr(m.group('name'), m.group('shape'), m.group('op'), names, m.group('rest'), current)
                instrs[ins.name] = ins
                comps[current].append(ins)
        return cls(text, instrs, comps, entry)

    @functools.cached_property
    def users(self) -> dict[str, list[Instr]]:
        """Instruction name -> the instructions that take it as an operand."""
        out: dict[str, list[Instr]] = {}
        for ins in self.instrs.values():
            for arg in ins.args:
                out.setdefault(arg, []).append(ins)
        return out

    def leaves_the_backward_pass(self, name: str) -> bool:
        """Whether the value ``name`` reaches an op outside the backward pass (the optimizer's, under no
        ``transpose(jvp(...))``), through the ops that only move it (tuples, copies, reshapes): a finished
        gradient does; a cotangent summed on its way back (a batch statistic's) stays in the backward pass."""
        seen, todo = set(), [name]
        while todo:
            for user in self.users.get(todo.pop(), []):
                if user.name in seen:
                    continue
                seen.add(user.name)
                if user.op in MOVES:
                    todo.append(user.name)
                elif 'transpose(jvp' not in user.op_name:
                    return True
        return False

    def header(self) -> str:
        """``HloModule NAME, num_partitions=N`` (the attributes that say what was compiled)."""
        first = self.text.splitlines()[0] if self.text else ''
        name = first.split(',')[0]
        parts = re.search(r'num_partitions=(\d+)', first)
        return name + (f', num_partitions={parts.group(1)}' if parts else '')

    def loops(self) -> dict[str, tuple[tuple[int | None, ...]]]:
        """Each computation reachable from ENTRY -> trip counts of the loops around it.

        A computation reached along several paths keeps the first; for the programs here
        (one scan, one call site per computation) that is the only one.
        """
        seen: dict[str, tuple[int | None, ...]] = {}
        stack = [(self.entry, ())]
        while stack:
            comp, trips = stack.pop()
            if comp in seen or comp not in self.comps:
                continue
            seen[comp] = trips
            for ins in self.comps[comp]:
                body = _BODY.search(ins.rest)
                trip = _TRIP.search(ins.rest)
                for callee in _callees(ins.rest):
                    inner = (int(trip.group(1)) if trip else None,) if body and body.group(1) == callee else ()
                    stack.append((callee, trips + inner))
        return seen

    def source(self, frame: int | None) -> str:
        """``file:line  code`` of the innermost frame of ``frame``'s stack inside this repository."""
        frames = self._table('StackFrames', r'file_location_id=(\d+) parent_frame_id=(\d+)')
        locations = self._table('FileLocations', r'file_name_id=(\d+) function_name_id=\d+ line=(\d+)')
        files = self._names('FileNames')
        stack, seen = [], set()
        while frame in frames and frame not in seen:
            seen.add(frame)
            loc, frame = frames[frame]
            file_id, line = locations.get(loc, (0, 0))
            stack.append((files.get(file_id, ''), line))
        ours = [(p, n) for p, n in stack if p.startswith(ROOT + os.sep) and '/equivalence/' not in p]
        path, line = (ours or stack or [('', 0)])[0]
        return f'{_shorten(path)}:{line}  {linecache.getline(path, line).strip()}' if path else ''

    def _section(self, title: str) -> list[str]:
        lines = self.text.splitlines()
        if title not in lines:
            return []
        start = lines.index(title) + 1
        end = next((i for i in range(start, len(lines)) if not lines[i].strip()), len(lines))
        return lines[start:end]

    def _table(self, title: str, pattern: str) -> dict[int, tuple[int, int]]:
        out = {}
        for line in self._section(title):
            m = re.match(r'(\d+) \{' + pattern, line)
            if m:
                out[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
        return out

    def _names(self, title: str) -> dict[int, str]:
        return {int(i): n for i, n in (re.match(r'(\d+) "(.*)"', s).groups() for s in self._section(title))}


def _shorten(path: str) -> str:
    """Repository files relative to its root, installed packages from their package."""
    if path.startswith(ROOT + os.sep):
        return os.path.relpath(path, ROOT)
    return path.split('site-packages' + os.sep, 1)[-1]


def _callees(rest: str) -> list[str]:
    names = _CALLEE.findall(rest)
    for group in _BRANCHES.findall(rest):
        names += re.findall(r'%([\w.\-]+)', group)
    return names


def kind_of(op: str) -> str | None:
    base = op.removesuffix('-start')
    return base if base in KINDS and not op.endswith('-done') else None


def group_size(rest: str) -> int | None:
    """Devices per replica group, from any of the three spellings XLA prints."""
    if m := re.search(r'replica_groups=\{\{([\d,]*)\}', rest):
        return len(m.group(1).split(','))
    if m := re.search(r'replica_groups=\[\d+,(\d+)\]<=', rest):
        return int(m.group(1))
    if m := re.search(r'replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}', rest):
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
        n = 1
        for axis in re.findall(r"'(\w+)'", m.group(2)):
            n *= int(sizes.get(axis, 1))
        return n
    return None


def collectives(text: str) -> tuple[str, list[Collective]]:
    """``(module header, every collective of the program)``."""
    module = Module.parse(text)
    return module.header(), module_collectives(module)


def module_collectives(module: Module) -> list[Collective]:
    """Every collective of a parsed program, counted through its loops."""
    loops = module.loops()
    found = []
    for comp, trips in loops.items():
        for ins in module.comps[comp]:
            kind = kind_of(ins.op)
            if kind:
                per_call = None if None in trips else _product(trips)
                ops = tuple(_operands(module, ins))
                found.append(Collective(kind, ins.name, ops, group_size(ins.rest), per_call, trips))
    return found


def _operands(module: Module, ins: Instr) -> list[Operand]:
    """One entry per operand, with the metadata of the result it becomes.

    XLA combines many small all-reduces into one tuple-shaped op; each
    ``get-tuple-element`` of it keeps the op name and stack of the collective it came from.
    """
    parts = {int(_INDEX.search(u.rest).group(1)): u for u in module.instrs.values() if _is_part_of(u, ins)}
    out = []
    for i, arg in enumerate(ins.args):
        producer = module.instrs.get(arg)
        shapes = array_shapes(producer.shape) if producer else []
        if not shapes:
            continue
        dtype, dims = shapes[0]
        meta = parts.get(i, ins)
        made_by = producer.op_name
        onward = meta.name if meta is not ins else ins.name
        out.append(
            Operand(
                shape=short(dtype, dims),
                bytes=nbytes(dtype, dims),
                role=_role(made_by, meta.op_name, module.leaves_the_backward_pass(onward)),
                written=_written(meta.op_name),
                op_name=meta.op_name,
                made_by=made_by,
                source=module.source(meta.frame),
            )
        )
    return out


MOVES = {'get-tuple-element', 'tuple', 'bitcast', 'copy', 'reshape', 'convert', 'all-reduce-done', 'copy-done'}


def _is_part_of(user: Instr, ins: Instr) -> bool:
    return user.op == 'get-tuple-element' and user.args == (ins.name,) and ins.shape.startswith('(')


def _role(made_by: str, op_name: str, to_optimizer: bool) -> str:
    """What a collective's operand is: a gradient where the backward pass made it and it goes on to the
    optimizer; not where the collective is a forward one transposed (a linen BatchNorm's ``pmean`` of its
    statistics sums their cotangent in the backward pass) or its result only goes back into the backward
    pass (the partitioner's sum of an NNX BatchNorm's statistics' cotangent): those are the statistics'."""
    backward_of_forward = 'transpose(jvp' in op_name and _written(op_name)
    if 'transpose(jvp' in made_by and not backward_of_forward and to_optimizer:
        return 'gradient'
    return 'forward' if 'jvp(' in made_by else 'other'


def _written(op_name: str) -> bool:
    last = op_name.rsplit('/', 1)[-1]
    return any(last == p or last.startswith(p + '[') for p in WRITTEN)


def _product(xs: tuple[int, ...]) -> int:
    n = 1
    for x in xs:
        n *= x
    return n
