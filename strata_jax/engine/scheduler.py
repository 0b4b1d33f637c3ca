"""Turning the slots that have work into a window.

A window holds every decoding slot as one decode row (so generating slots get a token every window)
and one chunk of one reading slot's prompt (`--prefill` tokens at most, slots taking turns), so a long
prompt never stalls the others. Row counts and chunk lengths are rounded up to buckets, so few layouts
(and few programs) cover every mix: decode rows to 2, 4, 8, ... (never 1: on XLA:CPU a [1, k] matmul
takes another path than [m, k] with 2 <= m <= 32, and a request must give the same bits alone or
together), chunks to 16, 32, ... tokens.

With --spec N, a window where some decoding slot has drafts runs every decoding slot in one verify group
of [rows, 1 + N] tokens (its last token, then its drafts; rows with fewer drafts are padded, pos -1), so
speculation adds one layout a row bucket (not one per mix of drafted and undrafted rows); a window where
no slot has drafts runs the plain decode group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .runner import GroupInput
from .sampler import SamplingRows
from .slots import Slot


def bucket(n: int, minimum: int) -> int:
    b = minimum
    while b < n:
        b *= 2
    return b


@dataclass
class Window:
    decode: list[Slot]
    prefill: Slot | None
    chunk: int                        # prompt tokens the prefill slot reads in this window
    groups: list[GroupInput]
    kv_needed: int
    drafts: list[list[int]] | None = None     # a verify window: each decode slot's drafts, in order


def sampling_rows(slots: list[Slot | None], rows: int) -> SamplingRows:
    s = SamplingRows.greedy(rows)
    for i, slot in enumerate(slots):
        if slot is None:
            continue
        p = slot.request.params
        s.temperature[i], s.top_k[i], s.top_p[i], s.min_p[i] = p.sampled_temperature, p.top_k, p.top_p, p.min_p
        s.seed[i] = p.seed if p.seed is not None else (slot.request.id * 2654435761) & 0xFFFFFFFF
        s.step[i] = len(slot.tokens) - len(slot.request.prompt)
    return s


def decode_group(slots: list[Slot], min_rows: int = 2) -> GroupInput:
    rows = bucket(len(slots), min_rows)
    tokens = np.zeros((rows, 1), np.int32)
    pos = np.full((rows, 1), -1, np.int32)
    idx = np.zeros(rows, np.int32)
    for i, s in enumerate(slots):
        tokens[i, 0], pos[i, 0], idx[i] = s.tokens[s.n_past], s.n_past, s.index
    return GroupInput(tokens, pos, idx, sampling_rows(list(slots), rows))


def verify_group(slots: list[Slot], drafts: list[list[int]], length: int, min_rows: int = 2) -> GroupInput:
    """Each slot's last token then its drafts, at its next positions; padded to `length` tokens a row."""
    rows = bucket(len(slots), min_rows)
    tokens = np.zeros((rows, length), np.int32)
    pos = np.full((rows, length), -1, np.int32)
    idx = np.zeros(rows, np.int32)
    dr = np.zeros((rows, length - 1), np.int32)
    n = np.zeros(rows, np.int32)
    for i, (s, d) in enumerate(zip(slots, drafts)):
        k = len(d)
        tokens[i, 0], tokens[i, 1:1 + k] = s.tokens[s.n_past], d
        pos[i, :1 + k] = np.arange(s.n_past, s.n_past + 1 + k)
        idx[i], dr[i, :k], n[i] = s.index, d, k
    return GroupInput(tokens, pos, idx, sampling_rows(list(slots), rows), all_logits=True, drafts=dr, n_draft=n)


def prefill_group(slot: Slot, chunk: int, max_chunk: int) -> GroupInput:
    length = min(bucket(chunk, 16), max_chunk)
    tokens = np.zeros((1, length), np.int32)
    pos = np.full((1, length), -1, np.int32)
    tokens[0, :chunk] = slot.tokens[slot.n_past:slot.n_past + chunk]
    pos[0, :chunk] = np.arange(slot.n_past, slot.n_past + chunk)
    return GroupInput(tokens, pos, np.array([slot.index], np.int32), sampling_rows([slot], 1))


class Scheduler:
    def __init__(self, max_chunk: int, min_rows: int = 2):
        self.max_chunk = max_chunk
        self.min_rows = min_rows        # the smallest row bucket (ModelRunner.min_rows says why)
        self._turn = 0

    def plan(self, slots: list[Slot], drafts: dict[int, list[int]] | None = None, verify_len: int = 0) -> Window | None:
        """drafts: slot index -> its drafts (speculative decoding); verify_len: 1 + --spec."""
        decode = [s for s in slots if s.decoding]
        reading = [s for s in slots if s.reading]
        prefill, chunk = None, 0
        if reading:
            self._turn = (self._turn + 1) % len(reading)
            prefill = reading[self._turn]
            # chunk boundaries at multiples of max_chunk: a prompt is cut the same way whatever else runs
            chunk = min(self.max_chunk - prefill.n_past % self.max_chunk, len(prefill.tokens) - prefill.n_past)
        if not decode and prefill is None:
            return None
        groups, needed, window_drafts = [], 0, None
        if decode and drafts and any(drafts.get(s.index) for s in decode):
            window_drafts = [drafts.get(s.index) or [] for s in decode]
            groups.append(verify_group(decode, window_drafts, verify_len, self.min_rows))
            needed = max(s.n_past + 1 + len(d) for s, d in zip(decode, window_drafts))
        elif decode:
            groups.append(decode_group(decode, self.min_rows))
            needed = max(s.n_past + 1 for s in decode)
        if prefill is not None:
            groups.append(prefill_group(prefill, chunk, self.max_chunk))
            needed = max(needed, prefill.n_past + chunk)
        return Window(decode, prefill, chunk, groups, needed, window_drafts)
