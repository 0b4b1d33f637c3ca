"""Turning the slots that have work into a window.

A window holds every decoding slot as one decode row (so generating slots get a token every window)
and prompt chunks of as many reading slots as fit the token budget (`--batch-tokens`, llama.cpp's
n_batch, vLLM's max_num_batched_tokens), the reading slots taking turns at being first, so 32
arriving prompts are read a few at a time instead of one a window, and a long prompt never stalls
the others. A chunk ends at the next multiple of `--prefill` tokens in its prompt, so a prompt is
cut at the same boundaries whatever else runs: its arithmetic is the same alone or together.

Row counts and chunk lengths are rounded up to buckets, so few layouts (and few programs) cover
every mix: decode rows to min_rows, 2 min_rows, 4 min_rows, ... (ModelRunner.min_rows: 1 on the cpu
backend, where rows are independent; else 2: on XLA:CPU a [1, k] matmul takes another path than [m,
k] with 2 <= m <= 32, and a request must give the same bits alone or together), prompt rows to 1, 2,
4, ..., chunks to 16, 32, ... tokens (the longest chunk of the window; shorter ones are padded). The
budget counts padded tokens (the work the program does): decode rows x tokens a row + prompt rows x
chunk; a window always holds at least one chunk, and --batch-tokens is at least --prefill, so one
whole chunk always fits.

Packed windows (the cpu backend, where every operation computes each token alone): a window without
drafts is ONE group of tokens, one a row ([T, 1]): the decode rows, then each prompt chunk's tokens
at their positions (vLLM's flattened batch), with logits only for the decode rows and the prompts
that end in the window (`picks`). Its layout is just (T bucket, picks bucket), ~10-60 layouts for
every mix at any --parallel (ModelRunner.base_layouts: the warm-up builds the decode ones, the
builder thread the rest), and nothing pads a prompt to a row's length. The budget there counts T.

With --spec N, a window where some decoding slot has drafts runs every decoding slot in one verify
group of [rows, 1 + N] tokens (its last token, then its drafts; rows with fewer drafts are padded,
pos -1), so speculation adds one layout a row bucket (not one per mix of drafted and undrafted
rows); a window where no slot has drafts runs the plain decode group.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..execute.controls import wants_controls
from ..execute.layouts import GroupInput
from ..execute.sampler import SamplingRows
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
    # one packed group (packed_group): its tokens are the decode rows' then ... the finishing
    # prompts' (ends: whether each prompt ends here), in order
    packed: bool = False
    ends: list[bool] | None = None
    verify_len: int = 0

    @property
    def rows(self) -> list[Slot]:
        return self.decode + self.prefills


def sampling_rows(slots: list[Slot | None], rows: int) -> SamplingRows:
    s = SamplingRows.greedy(rows)
    for i, slot in enumerate(slots):
        if slot is None:
            continue
        p = slot.request.params
        s.temperature[i], s.top_k[i], s.top_p[i], s.min_p[i] = (p.sampled_temperature, p.top_k,
                                                                p.top_p, p.min_p)
        s.seed[i] = p.seed if p.seed is not None else (slot.request.id * 2654435761) & 0xFFFFFFFF
        s.step[i] = len(slot.tokens) - len(slot.request.prompt)
    if any(slot is not None and wants_controls(slot.request.params) for slot in slots):
        s.controlled = [None if slot is None
                        else (slot.request.params, slot.tokens, len(slot.request.prompt))
                        for slot in slots] + [None] * (rows - len(slots))
    if any(slot is not None and slot.request.constraint is not None for slot in slots):
        s.constraints = [None if slot is None else slot.request.constraint for slot in slots] \
            + [None] * (rows - len(slots))
    return s


def decode_group(slots: list[Slot], min_rows: int = 2) -> GroupInput:
    rows = bucket(len(slots), min_rows)
    tokens = np.zeros((rows, 1), np.int32)
    pos = np.full((rows, 1), -1, np.int32)
    idx = np.zeros(rows, np.int32)
    for i, s in enumerate(slots):
        tokens[i, 0], pos[i, 0], idx[i] = s.tokens[s.n_past], s.n_past, s.index
    return GroupInput(tokens, pos, idx, sampling_rows(list(slots), rows))


def verify_group(slots: list[Slot], drafts: list[list[int]], length: int,
                 min_rows: int = 2) -> GroupInput:
    """Each slot's last token then its drafts, at its next positions; padded to `length` tokens a
    row."""
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
    return GroupInput(tokens, pos, idx, sampling_rows(list(slots), rows), all_logits=True,
                      drafts=dr, n_draft=n)


def chunk_of(slot: Slot, max_chunk: int) -> int:
    """The prompt tokens `slot` reads next: up to the next multiple of max_chunk in its prompt, so a
    prompt is cut the same way whatever else runs; and a chunk ends at the request's checkpoint_at
    (a hybrid family's state is kept there: state_checkpoints.py)."""
    n = min(max_chunk - slot.n_past % max_chunk, len(slot.tokens) - slot.n_past)
    at = slot.request.checkpoint_at if slot.request is not None else None
    return at - slot.n_past if at is not None and slot.n_past < at < slot.n_past + n else n


def prefill_group(slots: list[Slot], chunks: list[int], max_chunk: int) -> GroupInput:
    """One row a reading slot: its next chunk at its next positions, padded to the longest chunk's
    bucket (padding rows and tokens: pos -1)."""
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


def packed_group(decode: list[Slot], prompts: list[Slot], chunks: list[int],
                 min_rows: int) -> GroupInput:
    """A packed window's one group: every token a row of its own ([T, 1]: decode rows first, then
    each prompt chunk's tokens at their positions), logits of the decode rows and of the last token
    of each prompt the window finishes (picks). Only where every operation is row-independent (the
    cpu backend: its kernels compute each row alone), so a token's bits do not depend on the window.
    Picks are rounded up to a bucket (1, 2, 4, ...)."""
    n = len(decode) + sum(chunks)
    rows = bucket(n, min_rows)
    tokens = np.zeros((rows, 1), np.int32)
    pos = np.full((rows, 1), -1, np.int32)
    idx = np.zeros(rows, np.int32)
    picks, picked = [], []
    for i, s in enumerate(decode):
        tokens[i, 0], pos[i, 0], idx[i] = s.tokens[s.n_past], s.n_past, s.index
        picks.append(i)
        picked.append(s)
    at = len(decode)
    for s, c in zip(prompts, chunks):
        tokens[at:at + c, 0] = s.tokens[s.n_past:s.n_past + c]
        pos[at:at + c, 0] = np.arange(s.n_past, s.n_past + c)
        idx[at:at + c] = s.index
        # the prompt ends here: its last token's logits
        if s.n_past + c == len(s.tokens):
            picks.append(at + c - 1)
            picked.append(s)
        at += c
    e = bucket(max(len(picks), 1), min_rows)
    return GroupInput(tokens, pos, idx, sampling_rows(list(picked), e),
                      picks=np.array(picks + [0] * (e - len(picks)), np.int32))


class Scheduler:
    def __init__(self, max_chunk: int, min_rows: int = 2, batch_tokens: int | None = None,
                 packed: bool = False):
        self.max_chunk = max_chunk
        self.min_rows = min_rows        # the smallest row bucket (ModelRunner.min_rows says why)
        self.batch_tokens = max(batch_tokens or max_chunk, max_chunk)
        self.packed = packed            # windows without drafts as one packed group (packed_group)
        self._turn = 0

    def plan(self, slots: list[Slot], drafts: dict[int, list[int]] | None = None,
             verify_len: int = 0) -> Window | None:
        """drafts: slot index -> its drafts (speculative decoding); verify_len: 1 + --spec."""
        decode = [s for s in slots if s.decoding]
        reading = [s for s in slots if s.reading]
        window_drafts = None
        if decode and drafts and any(drafts.get(s.index) for s in decode):
            window_drafts = [drafts.get(s.index) or [] for s in decode]
            used = bucket(len(decode), self.min_rows) * verify_len
        elif self.packed:
            used = len(decode)
        else:
            used = bucket(len(decode), self.min_rows) if decode else 0
        prefills, chunks = self._prompts(reading, used, window_drafts is None and self.packed)
        return self._window(decode, prefills, chunks, window_drafts, verify_len)

    def _window(self, decode: list[Slot], prefills: list[Slot], chunks: list[int],
                drafts: list[list[int]] | None,
                verify_len: int = 0, pad: bool = False) -> Window | None:
        if not decode and not prefills:
            return None
        ends = [s.n_past + c == len(s.tokens) for s, c in zip(prefills, chunks)]
        needed = max([s.n_past + 1 + (len(d) if drafts else 0)
                      for s, d in zip(decode, drafts or [[]] * len(decode))]
                     + [s.n_past + c for s, c in zip(prefills, chunks)])
        if self.packed and drafts is None:
            group = packed_group(decode, prefills, chunks, self.min_rows)
            return Window(decode, prefills, chunks, [group], needed,
                          packed=True, ends=ends)
        groups = []
        if drafts is not None:
            groups.append(verify_group(decode, drafts, verify_len, self.min_rows))
        elif decode:
            groups.append(decode_group(decode, self.min_rows))
        if prefills:
            g = prefill_group(prefills, chunks, self.max_chunk)
            groups.append(_padded(g, self.max_chunk) if pad and g.tokens.shape[1] < self.max_chunk
                          else g)
        return Window(decode, prefills, chunks, groups, needed, drafts, ends=ends,
                      verify_len=verify_len)

    def _prompts(self, reading: list[Slot], used: int,
                 packed: bool) -> tuple[list[Slot], list[int]]:
        """The reading slots this window takes, starting after the last one the previous window took
        (slots take turns), while the padded tokens fit the budget (the first always fits: see the
        module docstring)."""
        if not reading:
            return [], []
        start = self._turn % len(reading)
        order = reading[start:] + reading[:start]
        taken, chunks = [], []
        for s in order:
            c = chunk_of(s, self.max_chunk)
            if packed:
                cost = bucket(used + sum(chunks) + c, self.min_rows)
            else:
                cost = (used + bucket(len(taken) + 1, 1)
                        * min(bucket(max(chunks + [c]), 16), self.max_chunk))
            if taken and cost > self.batch_tokens:
                break
            taken.append(s)
            chunks.append(c)
        # the next window starts with the first slot left out
        self._turn = start + len(taken)
        return taken, chunks

    def window_of(self, decode: list[Slot], prompts: list[Slot], chunks: list[int]) -> Window:
        """A window of exactly these rows, without drafts (the engine's smaller windows after an
        out-of-memory)."""
        return self._window(decode, prompts, chunks, None)

    def narrow(self, w: Window, prompts: int, pad: bool = False,
               drafts: bool = True) -> Window | None:
        """A smaller window of w (while w's programs are built off the engine thread): its decode
        rows (as a plain decode group if not `drafts`) and its first `prompts` prompt chunks (in a
        grouped window padded to a whole chunk if `pad`). The chunks are the same (a prompt's
        boundaries do not move); None if nothing is left."""
        return self._window(w.decode, w.prefills[:prompts], w.chunks[:prompts],
                            w.drafts if drafts else None, w.verify_len, pad)

    def took(self, planned: Window, ran: Window) -> None:
        """The window run instead of `planned` left some of its prompts out: they get the next
        turns."""
        self._turn -= len(planned.prefills) - len(ran.prefills)

    def skipped(self, planned: Window) -> None:
        """The planned window did not run (its programs are being built): its prompts keep their
        turns."""
        self._turn -= len(planned.prefills)


def _padded(g: GroupInput, length: int) -> GroupInput:
    """A prompt group padded to `length` tokens a row (pos -1 after the real tokens)."""
    R, L = g.tokens.shape
    tokens = np.zeros((R, length), np.int32)
    pos = np.full((R, length), -1, np.int32)
    tokens[:, :L], pos[:, :L] = g.tokens, g.pos
    return GroupInput(tokens, pos, g.slots, g.sampling)
