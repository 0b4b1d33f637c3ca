"""Recurrent-state checkpoints: prefix reuse for the hybrid families (qwen3next, qwen35moe).

A slot's KV can be cut at any token (the prefix cache reuses the longest match), but a Gated
DeltaNet layer's state is one fixed-size summary of every token read so far: it exists only at the
tokens where it was taken. So, as llama.cpp's server does with its context checkpoints, copies of a
slot's state are kept in host RAM:
- at the end of a chat's turn, before its generation prompt (Request.checkpoint_at,
  EngineCore.turn_end: the next turn starts with the same tokens, whereas the answer's may be
  rendered otherwise, its reasoning dropped), where a prompt chunk ends for it (scheduler.chunk_of);
- else (a plain prompt) a token before its end, where the same prompt again resumes (the prefix
  cache reads a prompt's last token again, for its logits);
- at the end of each prompt (a prompt that goes on from it), and
- every --checkpoint-every tokens of a long prompt (at the first chunk end past each multiple),
at most --ctx-checkpoints a slot, the least recently used dropped first. Besides them, a slot's live
state (on the device) is valid at its kept tokens' end: `Slot.kept` are exactly the tokens it has
read.

A new request may resume in a slot at n tokens when the slot's KV holds its prompt's first n tokens
(the prefix cache's match) AND a state exists at n: the live one (n = all the kept tokens), or a
checkpoint whose tokens are the prompt's first n. The checkpoint is then written into the slot's
state (KVCache.write_state). Each checkpoint keeps the tokens it summarizes, so it is checked
against the prompt itself, whatever the slot did since.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..execute.kv_cache import KVCache


@dataclass
class Checkpoint:
    tokens: tuple[int, ...]          # the tokens read into the state
    state: dict[str, np.ndarray]     # KVCache.read_state
    # when last taken or restored (a counter): the least recent goes first
    used: int = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state.values())


class StateCheckpoints:
    def __init__(self, kv: KVCache, n_slots: int, per_slot: int, every: int):
        self.kv = kv
        self.per_slot = per_slot
        self.every = every
        self._slots: list[list[Checkpoint]] = [[] for _ in range(n_slots)]
        self._clock = 0
        self.counters = {"taken": 0, "restored": 0, "live_reused": 0}

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def take(self, slot: int, tokens: list[int]) -> None:
        """Keep slot's state now, which has read exactly `tokens`."""
        if not self.per_slot or not tokens:
            return
        kept = [c for c in self._slots[slot] if c.tokens != tuple(tokens)]
        kept.append(Checkpoint(tuple(tokens), self.kv.read_state(slot), self._tick()))
        kept.sort(key=lambda c: c.used)
        self._slots[slot] = kept[-self.per_slot:]
        self.counters["taken"] += 1

    def due(self, before: int, after: int, prompt_len: int, turn_end: int | None = None) -> bool:
        """Whether a prompt chunk that read positions before..after takes a checkpoint: it ends the
        prompt or the request's turn (Request.checkpoint_at: a chat without its generation prompt,
        where the next turn resumes), or it passed a multiple of `every`."""
        return after in (prompt_len, turn_end) or after // self.every > before // self.every

    def usable(self, slot, prompt: list[int], match: int) -> int:
        """The most of `prompt` slot can resume at, given the prefix cache's match of its KV (match
        <= the prompt's length - 1): its kept tokens' end when it matched them all (the live state),
        else the longest checkpoint of the prompt's first tokens within the match; 0 if none."""
        if match and match == len(slot.kept):
            return match
        best = 0
        for c in self._slots[slot.index]:
            n = len(c.tokens)
            if best < n <= match and list(c.tokens) == prompt[:n]:
                best = n
        return best

    def resume(self, slot, prompt: list[int], n: int) -> None:
        """Make slot's state the one at prompt[:n] (usable's n): the live one is there already, else
        its checkpoint is written in."""
        if n == 0:
            return
        if n == len(slot.kept):
            self.counters["live_reused"] += 1
            return
        c = next(c for c in self._slots[slot.index]
                 if len(c.tokens) == n and list(c.tokens) == prompt[:n])
        self.kv.write_state(slot.index, c.state)
        c.used = self._tick()
        self.counters["restored"] += 1

    def stats(self) -> dict:
        return self.counters | {"kept": sum(len(s) for s in self._slots),
                                "bytes": sum(c.nbytes for s in self._slots for c in s)}
