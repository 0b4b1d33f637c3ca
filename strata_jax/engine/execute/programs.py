"""The program cache: compiled windows in a bounded LRU that cannot fill the device (Strata #997).

A window's layout is its static shape: its groups' (rows, tokens a row) and the KV-length bucket.
Slot ids and positions are inputs, so they never multiply programs (Strata keyed graphs on slot ids:
255 layouts for 8 slots, ~13 MiB each, never freed, until an instantiate ran out of memory and the
engine exited). Here:

- programs are built ahead of time (`lower().compile()`) and held in our own LRU, not jit's hidden
  cache;
- the LRU is bounded by `--max-programs` / STRATA_BATCH_GRAPHS (default 64, 0 = no bound);
- each program's bytes (`memory_analysis()`) are reserved in the device-memory ledger;
- when building or first running a program raises RESOURCE_EXHAUSTED, the cache waits for the
  device, frees the least recently used half (never the program being built), logs one line, and
  tries once more. If that fails too the error goes up, and the engine runs the window's rows in
  smaller windows;
- a layout met while serving can be compiled off the engine thread (`build_later`:
  program_builder.py), while the engine runs smaller windows whose programs exist; the compiled
  program joins the cache (its bytes reserved, the bound applied) on the engine thread, at its next
  `collect`, so one thread alone owns the LRU and the ledger.

Each part that runs programs registers the builder of its stages (`register`): the runner the whole
window ("window"), the layer stepper its stages, the MTP drafter "mtp". They hold the cache itself
(its run, get, ready and build_later), never the runner.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..faults import resource_exhausted
from .memory import MemoryLedger, MiB, is_resource_exhausted
from .program_builder import BuilderThread

log = logging.getLogger("strata_jax.engine")

# XLA:CPU reports 0 bytes of generated code; every executable still holds memory. Counting at least
# this much a program keeps the ledger honest there.
MIN_PROGRAM_BYTES = 256 << 10


@dataclass(frozen=True)
class Layout:
    """The static shape of a window."""
    # per group (rows, tokens a row, all logits, picks): picks > 0: logits of that many picked
    # tokens only
    groups: tuple[tuple[int, int, bool, int], ...]
    kv_len: int
    # a whole window; or a piece of a layer-stepped one (embed, attn, experts, head)
    stage: str = "window"

    def __str__(self) -> str:
        gs = " + ".join(f"{r}x{t}{'*' if a else ''}{f'>{e}' if e else ''}"
                        for r, t, a, e in self.groups)
        return (f"[{gs} | kv {self.kv_len}]" if self.stage == "window"
                else f"[{self.stage} {gs} | kv {self.kv_len}]")

    @property
    def rows(self) -> int:
        """Sequences' rows: a packed group's are its picks (its rows are tokens)."""
        return sum(e or r for r, _, _, e in self.groups)


@dataclass
class Program:
    layout: Layout
    compiled: Any
    nbytes: int
    ran: bool = False
    last_used: float = field(default_factory=time.monotonic)


@dataclass
class ProgramStats:
    built: int = 0
    # XLA compiles: a program refused by the ledger is not compiled twice
    compiles: int = 0
    evicted: int = 0
    oom_recoveries: int = 0
    build_seconds: float = 0.0


class ProgramCache:
    def __init__(self, build: Callable[[Layout], Any] | None, ledger: MemoryLedger,
                 max_programs: int, wait_for_device: Callable[[], None], faults=None):
        """build: the builder of whole windows (stage "window"), or None; other stages' are
        registered."""
        self._builders: dict[str, Callable[[Layout], Any]] = ({} if build is None
                                                              else {"window": build})
        self.ledger = ledger
        self.max_programs = max_programs
        self._wait = wait_for_device
        self.faults = faults
        self.programs: OrderedDict[Layout, Program] = OrderedDict()
        self.stats = ProgramStats()
        # layouts whose program can never fit -> its bytes
        self.too_big: dict[Layout, int] = {}
        # compiled, refused by the ledger, to try again
        self._pending: tuple[Layout, Any, int] | None = None
        # layouts given to the builder thread, not yet collected
        self._queued: set[Layout] = set()
        self._builder = BuilderThread(self._compile)
        # the builder thread's errors, met when a window needs the layout
        self._failed: dict[Layout, Exception] = {}

    def use_faults(self, faults) -> None:
        """Swap the fault injector (tests: runner.set_faults)."""
        self.faults = faults

    def register(self, stage: str, build: Callable[[Layout], Any]) -> None:
        """Layouts of `stage`, and of its kinds (`stage.1`, ...: stepped.py), are compiled by
        `build(layout)`."""
        self._builders[stage] = build

    def __len__(self) -> int:
        return len(self.programs)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.programs.values())

    def get(self, layout: Layout) -> Program:
        if layout in self._queued:
            self.collect()
        if layout in self._queued:
            # still queued: built here now, not after the builds ahead of it
            if self._builder.take(layout):
                self._queued.discard(layout)
            else:
                # being compiled: compiling it here too would waste the cores
                self._wait_built(layout)
        prog = self.programs.get(layout)
        if prog is not None:
            self.programs.move_to_end(layout)
            prog.last_used = time.monotonic()
            return prog
        if self.max_programs and len(self.programs) >= self.max_programs:
            self._evict(next(iter(self.programs)))
        self._refuse_if_too_big(layout)
        try:
            failed = self._failed.pop(layout, None)
            # as if it had been built here: the same recovery below
            if failed is not None:
                raise failed
            prog = self._build_one(layout)
        except Exception as e:
            # a layout too big for all the room programs have: freeing the others would not help
            if (not is_resource_exhausted(e) or layout in self.too_big
                    or not self._free_older_half(keep=layout)):
                self._pending = None
                raise
            prog = self._build_one(layout)          # once more; a second failure goes up
        self.programs[layout] = prog
        return prog

    def ready(self, layout: Layout) -> bool:
        return layout in self.programs

    def queued(self, layout: Layout) -> bool:
        """Given to the builder thread and not yet taken in (collect) or taken over (get)."""
        return layout in self._queued

    def hurry(self, layout: Layout) -> None:
        """Move a queued layout to the front of the builder thread's queue (a window waits for
        it)."""
        self._builder.hurry(layout)

    def refused(self, layout: Layout) -> bool:
        """`layout`'s program is bigger than all the room programs have: get() refuses it at
        once."""
        nbytes = self.too_big.get(layout)
        return nbytes is not None and nbytes > self._room()

    @property
    def pending(self) -> int:
        """Layouts given to the builder thread and not yet taken into the cache by `collect`."""
        return len(self._queued)

    def build_later(self, layout: Layout) -> None:
        """Compile `layout` on the builder thread (once; `collect` adds it to the cache). A layout
        that can never fit (`refused`) is not compiled again."""
        if (layout in self.programs or layout in self._queued or layout in self._failed
                or self.refused(layout)):
            return
        self._queued.add(layout)
        self._builder.put(layout)

    def collect(self) -> int:
        """On the engine thread: add the programs the builder thread finished to the cache -> how
        many. A program the ledger refuses is handled as in get(): the older half freed for it, or,
        bigger than all the room, marked `refused`. A failed compile is kept and met on the engine
        thread when a window needs the layout."""
        n = 0
        while (built := self._builder.finished()) is not None:
            layout, compiled, seconds, err = built
            self._queued.discard(layout)
            if err is not None:
                log.warning("building the program %s off the engine thread failed (%s: %s); the "
                            "error is met when a window needs it", layout, type(err).__name__,
                            _first_line(err))
                self._failed[layout] = err
                continue
            if layout in self.programs:
                continue
            if self.max_programs and len(self.programs) >= self.max_programs:
                self._evict(next(iter(self.programs)))
            n += self._take_built(layout, compiled, seconds)
        return n

    def close(self) -> None:
        """Stop the builder thread after the compile it is in."""
        self._builder.close()

    def _wait_built(self, layout: Layout) -> None:
        """Take in the builder thread's programs, blocking, until `layout` is no longer queued."""
        while layout in self._queued:
            self._builder.wait()
            self.collect()

    def _compile(self, layout: Layout):
        """Compile `layout`'s program (on either thread)."""
        if self.faults is not None:
            self.faults.on_build(layout.rows)
        return self._build(layout)

    def _build(self, layout: Layout):
        """`layout`'s program, from its stage's builder (tests wrap this to slow builds down)."""
        build = (self._builders.get(layout.stage)
                 or self._builders.get(layout.stage.partition(".")[0]))
        if build is None:
            raise ValueError(f"no builder for the stage {layout.stage!r} (registered: "
                             f"{sorted(self._builders)})")
        return build(layout)

    def run(self, layout: Layout, *args):
        """Run the program for `layout`, building it if needed. A first run that runs out of device
        memory frees the older half and is tried once more."""
        prog = self.get(layout)
        try:
            out = prog.compiled(*args)
        except Exception as e:
            if prog.ran or not is_resource_exhausted(e) or not self._free_older_half(keep=layout):
                raise
            out = prog.compiled(*args)
        prog.ran = True
        return out

    def clear(self) -> None:
        """Free every program (they are built again when needed)."""
        for lay in list(self.programs):
            self._evict(lay)

    def _build_one(self, layout: Layout) -> Program:
        t0 = time.perf_counter()
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == layout:
            # compiled already; only its memory was missing
            compiled, nbytes = pending[1], pending[2]
        else:
            compiled = self._compile(layout)
            nbytes = _program_bytes(compiled)
            self.stats.compiles += 1
        return self._reserve(layout, compiled, nbytes, t0)

    def _take_built(self, layout: Layout, compiled, seconds: float) -> bool:
        """A program compiled on the builder thread into the cache, its bytes reserved as for one
        built here -> whether it went in. A ledger refusal gets get()'s rule: the older half freed
        and the same executable tried once more. (Dropping it instead left its windows narrowed for
        good: each one queued it again, to be compiled and dropped again: the load ladder with the
        warm-up on and --device-memory-mib 1480, 7.9 against 14.3 tok/s.)"""
        self.stats.compiles += 1
        t0 = time.perf_counter() - seconds
        for attempt in (1, 2):
            try:
                self.programs[layout] = self._reserve(layout, compiled,
                                                      _program_bytes(compiled), t0)
                return True
            except Exception as e:  # noqa: BLE001 - no room: built on demand, with get()'s handling
                self._pending = None
                if attempt == 2 or not is_resource_exhausted(e) or layout in self.too_big \
                        or not self._free_older_half(keep=layout):
                    log.warning("no room for the program %s built off the engine thread (%s)",
                                layout, _first_line(e))
                    return False
        return False

    def _reserve(self, layout: Layout, compiled, nbytes: int, t0: float) -> Program:
        try:
            self.ledger.reserve_bytes("programs", nbytes, f"the window program {layout}")
        except Exception as e:
            if is_resource_exhausted(e):
                if nbytes > self._room():
                    # not to be compiled again: see _refuse_if_too_big
                    self.too_big[layout] = nbytes
                else:
                    self.too_big.pop(layout, None)
                    # freeing older programs may make room
                    self._pending = (layout, compiled, nbytes)
            raise
        self.too_big.pop(layout, None)
        self.stats.built += 1
        self.stats.build_seconds += time.perf_counter() - t0
        return Program(layout, compiled, nbytes)

    def _room(self) -> int:
        """The device memory programs could have with every program freed (inf without a budget)."""
        free = self.ledger.free
        return free + self.nbytes if free is not None else 1 << 62

    def _refuse_if_too_big(self, layout: Layout) -> None:
        """A layout whose program was once compiled and found bigger than all the memory programs
        can have is refused at once (RESOURCE_EXHAUSTED, so the engine runs its rows in smaller
        windows), without compiling it again: on a loaded CPU a compile takes a minute, and freeing
        every other program would not make it fit."""
        if self.refused(layout):
            nbytes = self.too_big[layout]
            raise resource_exhausted(f"the window program {layout} needs {nbytes / MiB:.1f} MiB of "
                                     "device memory, more than programs can have "
                                     f"({max(0, self._room()) / MiB:.1f} MiB with every program "
                                     "freed); not compiled again")

    def _evict(self, layout: Layout) -> None:
        prog = self.programs.pop(layout)
        self.ledger.release("programs", prog.nbytes)
        self.stats.evicted += 1

    def _free_older_half(self, keep: Layout) -> bool:
        """Free the least recently used half of the programs (never `keep`); False if there was
        none."""
        self._wait()
        # OrderedDict: least recent first
        older = [lay for lay in self.programs if lay != keep]
        n = (len(older) + 1) // 2
        if n == 0:
            log.warning("no device memory for a window program %s, and no other program to "
                        "free", keep)
            return False
        for lay in older[:n]:
            self._evict(lay)
        self.stats.oom_recoveries += 1
        log.warning("no device memory for a window program: freed %d older layouts, %d kept", n,
                    len(self.programs))
        return True

    def snapshot(self) -> dict[str, Any]:
        """Counters and live programs; safe to call from any thread (list() of a dict is atomic)."""
        progs = list(self.programs.items())
        return {"live": len(progs), "built": self.stats.built, "compiles": self.stats.compiles,
                "building": max(0, len(self._queued) - self._builder.waiting),   # not yet compiled
                "too_big": len(self.too_big), "evicted": self.stats.evicted,
                "oom_recoveries": self.stats.oom_recoveries,
                "bytes": sum(p.nbytes for _, p in progs),
                "max": self.max_programs, "build_seconds": round(self.stats.build_seconds, 3),
                "layouts": [str(lay) for lay, _ in progs],
                "program_bytes": [p.nbytes for _, p in progs]}


def _program_bytes(compiled) -> int:
    try:
        m = compiled.memory_analysis()
        n = (m.temp_size_in_bytes + m.generated_code_size_in_bytes
             + max(0, m.output_size_in_bytes - m.alias_size_in_bytes))
    except Exception:  # noqa: BLE001 - a backend without memory analysis
        n = 0
    return max(int(n), MIN_PROGRAM_BYTES)


def _first_line(e: BaseException) -> str:
    text = str(e)
    return text.splitlines()[0] if text else type(e).__name__
