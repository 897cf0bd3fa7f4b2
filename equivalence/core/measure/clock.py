"""A check measures itself: each stage's wall seconds, the seconds XLA spent compiling in it and the
programs it compiled (JAX's own backend-compile events, ``jax.monitoring``), and says each stage as it
begins and ends (``Lines``), so that a person sees where a check is while it works; each line said is
also a typed record (``said``), which is what reads a command's stderr back, never the lines' wording.

One clock runs at a time (``measuring``); code anywhere below opens a stage with ``stage(name)``, which
does nothing when no clock runs (a library call that did not ask). Stages nest, in the thread that opens
them: a compile counts in every stage its thread has open when it happens. Work handed to a thread of
its own (``on_thread``: a program compiled while the other side runs) counts in the stages open where it
was handed over, even once they have ended: such a stage's compile seconds may pass its wall, and the
check's compile seconds may pass its wall too.
"""

import collections
import contextlib
import dataclasses
import re
import sys
import threading
import time
from collections.abc import Iterator
from typing import Protocol, TextIO

from equivalence.core.measure import peaks
from equivalence.core.measure.said import Said, told

COMPILE_EVENT = '/jax/core/compile/backend_compile_duration'  # jax._src.dispatch.BACKEND_COMPILE_EVENT
CACHE_HIT_EVENT = '/jax/compilation_cache/cache_hits'  # a program read from the persistent cache


@dataclasses.dataclass
class Stage:
    """One stage of a check, as measured."""

    name: str
    depth: int  # 0: a stage of the check; 1: a part of one
    wall_s: float = 0.0
    compile_s: float = 0.0  # seconds XLA compiled during it
    programs: int = 0  # programs compiled during it
    cached: int = 0  # programs read from the persistent compilation cache instead
    thread: int = dataclasses.field(default=0, repr=False, compare=False)  # the thread that opened it

    def to_json(self) -> dict:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k != 'thread'}
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in fields.items()}


class Say(Protocol):
    """Told each stage as it begins and as it ends (``Lines``)."""

    def begin(self, stage: Stage) -> None: ...
    def end(self, stage: Stage, failed: bool = False) -> None: ...


class Clock:
    """The stages of one check, in the order they began; ``say`` is told each as it begins and ends."""

    def __init__(self, say: Say | None = None, parent: 'Clock | None' = None):
        self.stages: list[Stage] = []
        self.say, self.parent = say, parent
        self._base = parent._base + len(parent._open) if parent is not None else 0  # its stages' depth, said
        self._open: list[Stage] = []
        self._lent: dict[int, list[Stage]] = {}  # a thread of handed-over work -> the stages it counts in
        self._began = time.perf_counter()
        self._lock = threading.Lock()
        self.compile_s, self.programs, self.cached = 0.0, 0, 0  # every compile while it ran
        self.names: collections.Counter = collections.Counter()  # program name -> times compiled

    def _counting(self) -> list[Stage]:
        """The stages a compile in this thread counts in: those it has open, and those lent to it."""
        me = threading.get_ident()
        return [*self._lent.get(me, ()), *(st for st in self._open if st.thread == me)]

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[Stage]:
        with self._lock:
            st = Stage(name, self._base + len(self._counting()), thread=threading.get_ident())
            self.stages.append(st)
            self._open.append(st)
        if self.say is not None and not self._lent.get(st.thread):  # a handed-over thread's stages are not said
            self.say.begin(st)
        began, failed = time.perf_counter(), True
        try:
            yield st
            failed = False
        finally:
            st.wall_s = time.perf_counter() - began
            with self._lock:
                self._open.remove(st)
            if self.say is not None and not self._lent.get(st.thread):
                self.say.end(st, failed)

    def compiled(self, seconds: float, name: str = '?') -> None:
        with self._lock:
            for st in self._counting():
                st.compile_s += seconds
                st.programs += 1
            self.compile_s, self.programs = self.compile_s + seconds, self.programs + 1
            self.names[name] += 1
        if self.parent is not None:
            self.parent.compiled(seconds, name)

    def hit(self) -> None:
        with self._lock:
            for st in self._counting():
                st.cached += 1
            self.cached += 1
        if self.parent is not None:
            self.parent.hit()

    def lend(self, stages: list[Stage]) -> None:
        """This thread's compiles count in ``stages`` (and in those it opens) until ``lend([])``."""
        with self._lock:
            if stages:
                self._lent[threading.get_ident()] = list(stages)
            else:
                self._lent.pop(threading.get_ident(), None)

    def summary(self) -> dict:
        """The check's wall, compile seconds and programs (every compile while it ran), and every stage."""
        return {
            'wall_s': round(time.perf_counter() - self._began, 3),
            'compile_s': round(self.compile_s, 3),
            'programs': self.programs,
            'cached': self.cached,
            'compiled_again': {name: n for name, n in self.names.most_common() if n > 1},  # by program name
            'stages': [st.to_json() for st in self.stages],
            'memory': peaks.measured(),  # the host's and each device's peak bytes (``peaks``)
        }


def costs(st: Stage | dict) -> str:
    """``compiling 12.0 s, 3 programs, 2 from the compilation cache``, or '' when it compiled nothing."""
    get = st.get if isinstance(st, dict) else lambda k: getattr(st, k)
    n, cached = get('programs'), get('cached')
    parts = [f'compiling {get("compile_s"):.1f} s, {n} program{"s" * (n != 1)}'] if n else []
    return ', '.join(parts + ([f'{cached} from the compilation cache'] if cached else []))


def line(timing: dict) -> str:
    """The report's one line: ``time: 6.5 s (compiling 4.1 s, 23 programs); pre-flight 0.3 s, ...``."""
    spent = costs(timing)
    depth = min((s['depth'] for s in timing['stages']), default=0)
    top = [s for s in timing['stages'] if s['depth'] == depth]
    return (
        f'time: {timing["wall_s"]:.1f} s'
        + (f' ({spent})' if spent else '')
        + ('; ' + ', '.join(f'{short(s["name"])} {s["wall_s"]:.1f} s' for s in top) if top else '')
    )


def short(name: str) -> str:
    """A stage's name up to its first colon or parenthesis: 'legacy side', 'pre-flight'."""
    return re.split(r'[:(]', name, maxsplit=1)[0].strip()


class Lines:
    """Each stage on ``stream`` (stderr) as it happens: ``name ...`` once it has run ``delay`` seconds
    (a quick stage is one line when it ends), its seconds appended when it ends (``legacy side: pmap(scan),
    2 calls ... 14.1 s (compiling 12.0 s, 1 program)``); a stage with parts says its name before them and
    ends on a line of its own. A stage that raises says ``failed`` only if its name was said (the error's
    one line follows, from the command). Stages deeper than ``depth`` are not said. On a terminal with a
    bar (``bar``, tqdm), lines are written whole as stages end and the bar names the stage that runs."""

    def __init__(self, stream: TextIO | None = None, depth: int = 1, bar=None, prefix: str = '', delay: float = 1.0):
        self.stream, self.depth, self.bar, self.prefix, self.delay = stream or sys.stderr, depth, bar, prefix, delay
        self._open: list[Stage] = []  # stages begun and not ended, outermost first
        self._said: set[int] = set()  # the open stages whose name is written (id)
        self._tail: Stage | None = None  # the stage whose line the stream's last write left open
        self._partial = ''  # that line's text so far
        self._timer: threading.Timer | None = None
        self._lock = threading.RLock()

    def begin(self, st: Stage) -> None:
        if st.depth > self.depth:
            return
        if self.bar is not None:
            self.bar.set_description_str(st.name, refresh=True)
            return
        with self._lock:
            self._cancel()
            for parent in self._open:  # a stage with parts: its name said before them
                self._say_name(parent)
            self._open.append(st)
            self._timer = threading.Timer(self.delay, self._say_name, (st,))
            self._timer.daemon = True
            self._timer.start()

    def end(self, st: Stage, failed: bool = False) -> None:
        if st.depth > self.depth:
            return
        spent = costs(st)
        tail = f' {st.wall_s:.1f} s' + (f' ({spent})' if spent else '')
        if self.bar is not None:
            if not failed:
                self.bar.write(f'{self._name(st)} ...{tail}', file=self.stream)
                told(Said(st.name, st.depth, 'done', f'{self._name(st)} ...{tail}'))
            return
        with self._lock:
            self._cancel()
            said = id(st) in self._said
            self._open.remove(st)
            self._said.discard(id(st))
            state = 'failed' if failed else 'done'
            if self._tail is st:
                self._write(f' failed after {st.wall_s:.1f} s\n' if failed else tail + '\n', st, state, True)
            elif failed:
                self._write(f'{self._name(st)}: failed after {st.wall_s:.1f} s\n' if said else '', st, state)
            else:
                done = f'{self._name(st)}: done in{tail}\n' if said else f'{self._name(st)} ...{tail}\n'
                self._write(done, st, state)
            self._tail = None

    def _say_name(self, st: Stage) -> None:
        with self._lock:
            if id(st) in self._said or st not in self._open:
                return
            self._write(f'{self._name(st)} ...', st, 'begun')  # after another stage's open line: below it
            self._said.add(id(st))
            self._tail = st

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _name(self, st: Stage) -> str:
        return f'{self.prefix}{"  " * st.depth}{st.name}'

    def _write(self, text: str, st: Stage, state: str, continues: bool = False) -> None:
        """``text`` on a line of its own, or (``continues``) ending the open one; each line ended, told."""
        if self._tail is not None and not continues and text:
            self.stream.write('\n')
            told(Said(self._tail.name, self._tail.depth, 'begun', self._partial))
            self._tail, self._partial = None, ''
        self.stream.write(text)
        self.stream.flush()
        self._partial += text
        if self._partial.endswith('\n'):
            told(Said(st.name, st.depth, state, self._partial[:-1]))
            self._partial = ''


_CURRENT: Clock | None = None
_LISTENING = False


def on_stderr(total: int, unit: str, desc: str, depth: int = 1) -> tuple:
    """``(bar, say)``: each stage said on stderr as it happens (``Lines``), terminal or not; on a terminal a
    tqdm bar over ``total`` ``unit``s too, naming the stage that runs (None elsewhere). A command's one way
    of saying its progress (``run``, ``pitfalls``)."""
    if not sys.stderr.isatty():
        return None, Lines(sys.stderr, depth=depth)
    from tqdm import tqdm

    bar = tqdm(total=total, unit=unit, desc=desc, file=sys.stderr, leave=False)
    return bar, Lines(sys.stderr, depth=depth, bar=bar)


@contextlib.contextmanager
def measuring(say: Say | None = None) -> Iterator[Clock]:
    """A clock for the block, the one ``stage`` opens stages on. Where one runs already (a check inside a
    command's own clock, the masked-loss hint's run inside a check), the new one is its child: its stages
    are said where the parent's are (unless ``say`` is given) and nested under the parent's stage, and its
    compiles count in the parent's stages too."""
    global _CURRENT
    _listen()
    parent = _CURRENT
    _CURRENT = Clock(say if say is not None or parent is None else parent.say, parent)
    try:
        yield _CURRENT
    finally:
        _CURRENT = parent


def _listen() -> None:
    """JAX's compile events routed to the clock that runs (registered once: JAX keeps its listeners)."""
    global _LISTENING
    if _LISTENING:
        return
    import jax

    def on_duration(event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT and _CURRENT is not None:
            _CURRENT.compiled(duration, str(kwargs.get('fun_name', '?')))

    def on_event(event: str, **kwargs) -> None:
        if event == CACHE_HIT_EVENT and _CURRENT is not None:
            _CURRENT.hit()

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    _LISTENING = True


class OnThread:
    """Work handed to a thread of its own (``on_thread``); ``result()`` waits for it: its value, or None
    where it raised (the error is kept in ``error``: work handed over is never the only try)."""

    def __init__(self, fn):
        self.value, self.error = None, None
        chain, clock = [], _CURRENT
        while clock is not None:  # a child clock's compiles count in its parent's stages too
            with clock._lock:
                chain.append((clock, clock._counting()))
            clock = clock.parent

        def work():
            for c, lent in chain:
                c.lend(lent)
            try:
                self.value = fn()
            except BaseException as e:  # noqa: BLE001 -- kept; the caller does the work again, as it would have
                self.error = e
            finally:
                for c, _ in chain:
                    c.lend([])

        self._thread = threading.Thread(target=work, name='equivalence-on-thread', daemon=True)
        self._thread.start()

    def result(self):
        self._thread.join()
        return self.value


def on_thread(fn) -> OnThread:
    """``fn()`` on a thread of its own, now; its compiles count in the stages open here (``Clock.lend``)."""
    return OnThread(fn)


@contextlib.contextmanager
def stage(name: str) -> Iterator[Stage | None]:
    """A stage of the clock that runs, or nothing where none does."""
    if _CURRENT is None:
        yield None
        return
    with _CURRENT.stage(name) as st:
        yield st
