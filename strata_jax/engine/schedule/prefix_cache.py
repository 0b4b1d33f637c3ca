"""The prefix cache: a slot keeps its KV after its request ends, and a new request goes to the free
slot whose kept tokens share the longest prefix with its prompt, reading only the rest.

Choice of slot: the longest match among free slots (ties, and no match at all: the least recently
used), the match capped at the prompt's length - 1 so that the first token always comes from a real
window. With --conversation-cache-mib, a slot's kept KV that the new request would overwrite goes to
host RAM first (conversation_cache.py), and a prompt that matches more there than in any slot gets
those blocks copied back into its slot (one small donated program a block: the cache is updated in
place).

It takes the KVCache (kv_cache.py), through which every copy into or out of a slot goes, and owns
the conversation cache's blocks (kv_cache.py says why they are not the KVCache's).

cache_salt (vLLM's): a request with a salt shares KV only with requests of the same salt, and one
without only with those without: a slot remembers the salt of the request whose KV it keeps
(Slot.salt), and each conversation-cache block the salt it was stored under. So `cached_tokens`
cannot tell one client which prompts another sent, when each client (or tenant) sends its own salt.

Batch invariance: reading resumes at the match and goes on at the scheduler's fixed chunk boundaries
(multiples of --prefill), so later chunks are cut as they would be from scratch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from ...config import EngineConfig
from ..execute.kv_cache import KVCache
from .conversation_cache import Block, ConversationCache
from .slots import Slot
from .state_checkpoints import StateCheckpoints

log = logging.getLogger("strata_jax.engine")


def block_tokens(max_context: int) -> int:
    """Conversation-cache block size: about 64 blocks a slot, 16 to 256 tokens (SmolLM2 f32: 2.9 MiB
    at 64)."""
    b = 16
    while b < 256 and b * 64 < max_context:
        b *= 2
    return b


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(np.asarray(a[:n], np.int64) != np.asarray(b[:n], np.int64))
    return int(diff[0]) if diff.size else n


class PrefixCache:
    def __init__(self, kv: KVCache, cfg: EngineConfig, key_fn: Callable | None = None,
                 states: StateCheckpoints | None = None):
        """states: a hybrid family's recurrent-state checkpoints (state_checkpoints.py): a request
        then resumes only where a state exists, and KV is neither forked nor kept in the
        conversation cache."""
        self.kv = kv
        self.states = states
        self.enabled = cfg.prefix_cache
        self.block = block_tokens(cfg.max_context)
        self.host: ConversationCache | None = None
        if self.enabled and cfg.conversation_cache_mib > 0:
            kw = {"key_fn": key_fn} if key_fn is not None else {}
            self.host = ConversationCache(self.block, int(cfg.conversation_cache_mib * 2**20),
                                          cfg.conversation_cache_slots, **kw)
        # The mtp drafter's layer keeps, at each position, an entry made from the NEXT token too:
        # the last reused position's was made with the old conversation's next token, so it is read
        # again.
        self.reread = 1 if cfg.spec > 0 and cfg.drafter == "mtp" else 0
        self.counters = {"requests": 0, "slot_hits": 0, "slot_reused_tokens": 0, "forks": 0,
                         "forked_tokens": 0}
        # tests: (prompt, restored tokens)
        self.on_restore: Callable[[list[int], np.ndarray], None] | None = None

    def place(self, prompt: list[int], free: list[Slot], busy: list[Slot] = (),
              salt: str | None = None) -> tuple[Slot, int]:
        """Pick the slot for a new request and bring its prompt's known prefix into it -> (slot,
        tokens already in its KV). May store the slot's old KV to host RAM and restore blocks from
        there, or copy a busy slot's KV of a longer match (whole blocks of positions already read)
        into the slot. Only KV kept under the request's cache_salt (`salt`) matches."""
        self.counters["requests"] += 1
        if not self.enabled:
            return min(free, key=lambda s: s.last_used), 0
        limit = len(prompt) - 1                        # the last prompt token is always read

        def match(s: Slot) -> int:
            return common_prefix(s.kept, prompt) if s.salt == salt else 0

        if self.states is not None:
            slot, n = min(((s, self.states.usable(s, prompt, min(match(s), limit))) for s in free),
                          key=lambda sn: (-sn[1], sn[0].last_used))
            self.states.resume(slot, prompt, n)
            self._count_hit(n)
            return slot, n
        slot, n = min(((s, min(match(s), limit)) for s in free),
                      key=lambda sn: (-sn[1], sn[0].last_used))
        src, m = max(((s, min(match(s), limit, self.kv.device_len)) for s in busy),
                     key=lambda sm: sm[1], default=(None, 0))
        if src is not None and m >= n + self.block:
            return slot, self._fork(src, slot, m)
        blocks: list[Block] = []
        if self.host is not None:
            blocks = self.host.lookup(prompt, limit, salt)
            if len(blocks) * self.block <= n:
                blocks = []
        B = self.block
        # kept blocks past the match would be lost
        if self.host is not None and len(slot.kept) // B > n // B:
            self._store(slot)
        if blocks:
            n = self._restore(slot, prompt, blocks, n) - self.reread
        else:
            n = max(n - self.reread, 0)
            self._count_hit(n)
        return slot, n

    def _count_hit(self, n: int) -> None:
        if n:
            self.counters["slot_hits"] += 1
            self.counters["slot_reused_tokens"] += n

    def _fork(self, src: Slot, slot: Slot, m: int) -> int:
        """Copy src's first m positions into slot (its old KV to host RAM first, if kept there) ->
        tokens reused. Copies whole blocks: positions past m are the new request's to overwrite."""
        if self.host is not None and len(slot.kept) // self.block > 0:
            self._store(slot)
        blocks = -(-m // self.block)
        self.kv.copy(src.index, slot.index, blocks, self.block)
        n = max(m - self.reread, 0)
        self.counters["forks"] += 1
        self.counters["forked_tokens"] += n
        return n

    # ---- host RAM --------------------------------------------------------------------------------

    def _store(self, slot: Slot) -> None:
        t0 = time.monotonic()
        tokens = list(slot.kept)
        B = self.block

        def read(i: int) -> dict[str, np.ndarray]:
            return self.kv.read(slot.index, i * B, B)

        before = self.host.bytes
        new, evicted = self.host.store(tokens, read, slot.salt)
        if new or evicted:
            st = self.host.stats()
            log.info("conversation cache: stored %d blocks (%.1f MiB) of slot %d's %d tokens in "
                     "%.0f ms, evicted %d; %d blocks, %.1f of %.0f MiB, %d conversations", new,
                     max(self.host.bytes - before, 0) / 2**20,
                     slot.index, len(tokens), (time.monotonic() - t0) * 1000, evicted, st["blocks"],
                     st["bytes"] / 2**20, st["max_bytes"] / 2**20, st["conversations"])

    def _restore(self, slot: Slot, prompt: list[int], blocks: list[Block], n_slot: int) -> int:
        """Copy `blocks` (prompt's exact prefix) into the slot; blocks the slot already holds are
        skipped."""
        B = self.block
        restored = np.concatenate([b.tokens for b in blocks])
        if not np.array_equal(restored, np.asarray(prompt[:len(restored)], np.int32)):
            # never
            raise RuntimeError("conversation cache: the blocks to restore are not the prompt's "
                               "prefix")
        if self.on_restore is not None:
            self.on_restore(list(prompt), restored)
        t0 = time.monotonic()
        done = n_slot
        for i in range(n_slot // B, len(blocks)):
            self.kv.write(slot.index, i * B, blocks[i].kv)
            done = (i + 1) * B
        self.kv.wait()
        self.host.touch(blocks)
        c = self.host.counters
        c["hits"] += 1
        c["restored_tokens"] += done - n_slot
        c["restored_bytes"] += sum(b.nbytes for b in blocks[n_slot // B:])
        log.info("conversation cache: restored %d tokens (%d blocks of %d) into slot %d in %.0f "
                 "ms; since start %d hits of %d lookups, %d tokens restored, %d blocks stored, %d "
                 "evicted", done - n_slot,
                 len(blocks) - n_slot // B, B, slot.index, (time.monotonic() - t0) * 1000,
                 c["hits"], c["lookups"],
                 c["restored_tokens"], c["stored_blocks"], c["evicted_blocks"])
        return done

    def stats(self) -> dict:
        out = {"enabled": int(self.enabled), "block_tokens": self.block, **self.counters}
        if self.host is not None:
            out["conversation_cache"] = self.host.stats()
        if self.states is not None:
            out["state_checkpoints"] = self.states.stats()
        return out

    def after_window(self, w) -> None:
        """A hybrid family's checkpoints of the window's prompt chunks that are due
        (state_checkpoints.py)."""
        if self.states is None or not self.enabled:
            return
        for s, c in zip(w.prefills, w.chunks):
            if (not s.free and self.states.due(s.n_past - c, s.n_past, len(s.request.prompt),
                                               s.request.checkpoint_at)):
                self.states.take(s.index, s.kept)
