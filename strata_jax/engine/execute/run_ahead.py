"""Run-ahead decode: the next decode window dispatched before this one's tokens reach the host.

Windows run one after another leave the cores idle twice a step: while the engine thread hands the
window program its arrays (~0.7 ms on a CPU) and while it applies the tokens and plans the next
window (~1 ms). At a small model's decode (8-12 ms a token on two cores) that is 15-20% of the
step. vLLM's async scheduling's remedy, here: once window k is dispatched, the engine dispatches
window k+1 too, its tokens being window k's answer still on the device (the sampler's program,
answers.py), and only then waits for window k's tokens; window k+1 runs while they are applied and
the next window is planned. If that window is window k+1 as dispatched (the same rows, positions
and tokens) and nothing else ran on the KV cache meanwhile, its logits are taken as they are; if
not (a row ended, a request came in, a token was forced, a prefix-cache copy), they are dropped.

Why a dropped window is harmless: it wrote each row's KV at the row's next position only. A row that
goes on writes the same values there in its next window (the same token at the same position over
the same earlier KV); a row that ended never reads it (a slot's KV holds tokens[:n_past]: slots.py).
That holds only where a window's writes are exactly that: attention KV, nothing recurrent (a hybrid
family's DeltaNet state and gpt-oss's rings advance for good), one program a window on one process
(the executor's `runs_ahead`: the whole-window program, and the expert tiers' one-program window
where every window is one, whose router ids are counted only when the window is taken; not the
tiers' layer steps, which move experts between layers, nor a process group's followers). The runner
makes a RunAhead only there; EngineCore says which windows may run ahead (decode rows alone, no
drafts, no sampling controls, no row ending by length in this window).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import jax
import numpy as np

from .layouts import GroupInput
from .programs import Layout


@dataclass
class _Pending:
    layout: Layout
    group: GroupInput          # its tokens a device array
    logits: list[jax.Array]
    kv_version: int            # the KV cache's version its run left
    settle: Callable[[], None] | None    # called once if a planned window takes it


class RunAhead:
    def __init__(self, forward, layout_of, ready, kv):
        """forward(groups, layout) -> (logits a group, settle or None) (the executor's
        forward_ahead: settle() is called once if the window is taken, by self.settle());
        layout_of(groups, kv_needed) -> a window's layout; ready(layout) -> whether that window's
        program is built (a window never waits for a build here); kv: the KVCache (its version
        says whether anything else ran on it since)."""
        self._forward, self._layout_of, self._ready, self._kv = forward, layout_of, ready, kv
        self._pending: _Pending | None = None
        # the taken window's settle, called once the window after it is dispatched (settle)
        self._settle: Callable[[], None] | None = None
        self.ran = 0            # windows dispatched ahead
        self.taken = 0          # ... whose logits a planned window took

    def take(self, groups: list[GroupInput], layout: Layout) -> list[jax.Array] | None:
        """The logits of the window dispatched ahead if it is this window (the same layout, rows,
        positions and tokens) and nothing else ran on the KV cache since (a prefix-cache copy, a
        restored slot, a scratch cache: positions it read may hold other tokens now), else None;
        the pending window is gone either way."""
        p, self._pending = self._pending, None
        if (p is None or len(groups) != 1 or p.layout != layout
                or p.kv_version != self._kv.version):
            return None
        g, a = groups[0], p.group
        if not (np.array_equal(g.pos, a.pos) and np.array_equal(g.slots, a.slots)
                and np.array_equal(g.picks, a.picks)
                and np.array_equal(g.tokens, np.asarray(a.tokens))):
            return None
        self.taken += 1
        self._settle = p.settle
        return p.logits

    def start(self, g: GroupInput, kv_needed: int, tokens: jax.Array | None) -> None:
        """Dispatch the decode window after this window of one packed decode group `g` (reading
        up to kv_needed positions): the same rows at their next positions, fed `tokens` (g's
        sampled tokens as next_window_tokens gives them [R, 1], on the device; None where g is
        not one token a row: answers.tokens_on_device decides, as it shapes them). Nothing when its
        program is not built."""
        if tokens is None:
            return
        valid = g.pos >= 0
        pos = np.where(valid, g.pos + 1, -1).astype(np.int32)
        nxt = GroupInput(g.tokens, pos, g.slots, g.sampling, picks=g.picks)
        layout = self._layout_of([nxt], kv_needed + 1)
        if not self._ready(layout):
            return
        nxt = replace(nxt, tokens=tokens)
        logits, settle = self._forward([nxt], layout)
        self._pending = _Pending(layout, nxt, logits, self._kv.version, settle)
        self.ran += 1

    def settle(self) -> None:
        """Settle the window taken last (its executor's settle: the expert tiers count its
        routing, which waits for its program), once: the runner calls it after dispatching the
        next window, so the device runs that one meanwhile."""
        settle, self._settle = self._settle, None
        if settle is not None:
            settle()

    def drop(self) -> None:
        """Forget the window dispatched ahead (the KV cache it ran on was replaced)."""
        self._pending = None
