"""Turning the slots that have work into a window.

A window holds every decoding slot as one decode row (so generating slots get a token every window)
and prompt chunks of as many reading slots as fit the token budget (`--batch-tokens`, llama.cpp's
n_batch, vLLM's max_num_batched_tokens), the reading slots taking turns at being first, so 32 arriving
prompts are read a few at a time instead of one a window, and a long prompt never stalls the others.
A chunk ends at the next multiple of `--prefill` tokens in its prompt, so a prompt is cut at the same
boundaries whatever else runs: its arithmetic is the same alone or together.

Row counts and chunk lengths are rounded up to buckets, so few layouts (and few programs) cover every
mix: decode rows to min_rows, 2 min_rows, 4 min_rows, ... (ModelRunner.min_rows: 1 on the cpu backend,
where rows are independent; else 2: on XLA:CPU a [1, k] matmul takes another path than [m, k] with
2 <= m <= 32, and a request must give the same bits alone or together), prompt rows to 1, 2, 4, ...,
chunks to 16, 32, ... tokens (the longest chunk of the window; shorter ones are padded). The budget
counts padded tokens (the work the program does): decode rows x tokens a row + prompt rows x chunk; a
window always holds at least one chunk, and --batch-tokens is at least --prefill, so one whole chunk
always fits.

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
    prefills: list[Slot]              # reading slots, one prompt row each
    chunks: list[int]                 # prompt tokens each reads in this window
    groups: list[GroupInput]
    kv_needed: int
    drafts: list[list[int]] | None = None     # a verify window: each decode slot's drafts, in order

    @property
    def rows(self) -> list[Slot]:
        return self.decode + self.prefills


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


def chunk_of(slot: Slot, max_chunk: int) -> int:
    """The prompt tokens `slot` reads next: up to the next multiple of max_chunk in its prompt, so a prompt
    is cut the same way whatever else runs."""
    return min(max_chunk - slot.n_past % max_chunk, len(slot.tokens) - slot.n_past)


def prefill_group(slots: list[Slot], chunks: list[int], max_chunk: int) -> GroupInput:
    """One row a reading slot: its next chunk at its next positions, padded to the longest chunk's bucket
    (padding rows and tokens: pos -1)."""
    rows = bucket(len(slots), 1)
    length = min(bucket(max(chunks), 16), max_chunk)
    tokens = np.zeros((rows, length), np.int32)
    pos = np.full((rows, length), -1, np.int32)
    idx = np.zeros(rows, np.int32)
    for i, (s, c) in enumerate(zip(slots, chunks)):
        tokens[i, :c] = s.tokens[s.n_past:s.n_past + c]
        pos[i, :c] = np.arange(s.n_past, s.n_past + c)
        idx[i] = s.index
    return GroupInput(tokens, pos, idx, sampling_rows(list(slots), rows))


def prompt_cost(n_rows: int, longest: int, max_chunk: int) -> int:
    """Padded tokens of a prompt group of n_rows rows whose longest chunk is `longest`."""
    return bucket(n_rows, 1) * min(bucket(longest, 16), max_chunk)


class Scheduler:
    def __init__(self, max_chunk: int, min_rows: int = 2, batch_tokens: int | None = None):
        self.max_chunk = max_chunk
        self.min_rows = min_rows        # the smallest row bucket (ModelRunner.min_rows says why)
        self.batch_tokens = max(batch_tokens or max_chunk, max_chunk)
        self._turn = 0

    def plan(self, slots: list[Slot], drafts: dict[int, list[int]] | None = None, verify_len: int = 0,
             max_prompts: int | None = None) -> Window | None:
        """drafts: slot index -> its drafts (speculative decoding); verify_len: 1 + --spec; max_prompts: at
        most this many prompt rows (None: as many as the budget holds; 0: none)."""
        decode = [s for s in slots if s.decoding]
        reading = [s for s in slots if s.reading]
        groups, needed, window_drafts, used = [], 0, None, 0
        if decode and drafts and any(drafts.get(s.index) for s in decode):
            window_drafts = [drafts.get(s.index) or [] for s in decode]
            groups.append(verify_group(decode, window_drafts, verify_len, self.min_rows))
            needed = max(s.n_past + 1 + len(d) for s, d in zip(decode, window_drafts))
        elif decode:
            groups.append(decode_group(decode, self.min_rows))
            needed = max(s.n_past + 1 for s in decode)
        if groups:
            used = groups[0].tokens.size
        prefills, chunks = self._prompts(reading, used, max_prompts)
        if not groups and not prefills:
            return None
        if prefills:
            groups.append(prefill_group(prefills, chunks, self.max_chunk))
            needed = max([needed] + [s.n_past + c for s, c in zip(prefills, chunks)])
        return Window(decode, prefills, chunks, groups, needed, window_drafts)

    def _prompts(self, reading: list[Slot], used: int, max_prompts: int | None) -> tuple[list[Slot], list[int]]:
        """The reading slots this window takes, starting after the last one the previous window took (slots
        take turns), while the padded tokens fit the budget (the first always fits: see the module docstring)."""
        if not reading or max_prompts == 0:
            return [], []
        start = self._turn % len(reading)
        order = reading[start:] + reading[:start]
        taken, chunks = [], []
        for s in order:
            c = chunk_of(s, self.max_chunk)
            if taken and (used + prompt_cost(len(taken) + 1, max(chunks + [c]), self.max_chunk) > self.batch_tokens
                          or (max_prompts is not None and len(taken) >= max_prompts)):
                break
            taken.append(s)
            chunks.append(c)
        self._turn = start + len(taken)          # the next window starts with the first slot left out
        return taken, chunks

    def narrow(self, w: Window, prompts: int, pad: bool = False, drafts: bool = True) -> Window | None:
        """A smaller window of w (while w's programs are built off the engine thread): its decode rows (as a
        plain decode group if not `drafts`) and its first `prompts` prompt chunks, padded to a whole chunk if
        `pad`. The chunks are the same (the prompt's boundaries do not move); None if nothing is left."""
        groups, needed, window_drafts = [], 0, None
        if w.decode:
            if drafts and w.drafts is not None:
                window_drafts = w.drafts
                groups.append(w.groups[0])
                needed = max(s.n_past + 1 + len(d) for s, d in zip(w.decode, w.drafts))
            else:
                groups.append(decode_group(w.decode, self.min_rows))
                needed = max(s.n_past + 1 for s in w.decode)
        slots, chunks = w.prefills[:prompts], w.chunks[:prompts]
        if slots:
            g = prefill_group(slots, chunks, self.max_chunk)
            if pad and g.tokens.shape[1] < self.max_chunk:
                g = _padded(g, self.max_chunk)
            groups.append(g)
            needed = max([needed] + [s.n_past + c for s, c in zip(slots, chunks)])
        if not groups:
            return None
        return Window(w.decode, slots, chunks, groups, needed, window_drafts)

    def took(self, planned: Window, ran: Window) -> None:
        """The window run instead of `planned` left some of its prompts out: they get the next turns."""
        self._turn -= len(planned.prefills) - len(ran.prefills)


def _padded(g: GroupInput, length: int) -> GroupInput:
    """A prompt group padded to `length` tokens a row (pos -1 after the real tokens)."""
    R, L = g.tokens.shape
    tokens = np.zeros((R, length), np.int32)
    pos = np.full((R, length), -1, np.int32)
    tokens[:, :L], pos[:, :L] = g.tokens, g.pos
    return GroupInput(tokens, pos, g.slots, g.sampling)

