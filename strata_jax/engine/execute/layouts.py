"""The groups a window is made of (GroupInput: a program's inputs), the layouts windows take
(programs.Layout): a window's KV-length bucket, its layout from its groups, and the set the warm-up
builds. WindowLayouts is fixed at start from the runner's choices; nothing in it changes after."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import pallas_kernels as pk

from .programs import Layout
from .sampler import SamplingRows


@dataclass
class GroupInput:
    tokens: np.ndarray        # [R, L] int32
    pos: np.ndarray           # [R, L] int32 (-1: padding)
    slots: np.ndarray         # [R] int32
    sampling: SamplingRows
    all_logits: bool = False
    # [R, L-1] int32: a verify group's drafts (spec/accept.py), with [R] int32: the real drafts a
    # row (the group then returns tokens, n_accepted)
    drafts: np.ndarray | None = None
    n_draft: np.ndarray | None = None
    # [E] int32: logits of these tokens only (a packed window; model.Group)
    picks: np.ndarray | None = None

    def arrays(self) -> list[np.ndarray]:
        """The program's inputs for this group, in model.Group's order."""
        return ([self.tokens, self.pos, self.slots]
                + ([self.picks] if self.picks is not None else []))


@dataclass(frozen=True)
class WindowLayouts:
    backend: str            # the kernels' backend (cpu: the KV length is not part of a program)
    attn_chunk: int         # keys the attention reads at a time: the KV buckets are chunk * 2^i
    device_len: int         # positions a slot holds on the device (--kv-resident)
    cache_len: int          # positions a slot holds in all
    min_rows: int           # the smallest row bucket of decode and verify windows (ModelRunner)
    packed: bool            # windows are one packed group (the cpu backend: scheduler.py)
    parallel: int
    spec: int               # --spec: drafts a verify row holds
    prefill: int            # the prompt chunk
    batch_tokens: int

    def kv_bucket(self, needed: int) -> int:
        """The KV length a window attends over: chunk * 2^i covering `needed`, at most the cache
        length (and at most the device part when `needed` fits in it: such windows never touch host
        KV)."""
        if pk.is_cpu(self.backend) and needed <= self.device_len:
            # the cpu attention kernel reads only the keys each query sees, in place: the KV length
            # is not part of its arithmetic, so one program serves every length (fewer layouts to
            # build)
            return self.device_len
        n = self.attn_chunk
        while n < needed:
            n *= 2
        return min(n, self.device_len if needed <= self.device_len else self.cache_len)

    def layout_of(self, groups, kv_needed: int) -> Layout:
        """The layout of a window of GroupInputs reading up to `kv_needed` positions."""
        return Layout(tuple((g.tokens.shape[0], g.tokens.shape[1], g.all_logits,
                             0 if g.picks is None else len(g.picks)) for g in groups),
                      self.kv_bucket(kv_needed))

    def base(self) -> list[Layout]:
        """The layouts the warm-up builds, at the first KV bucket. Packed windows (the cpu backend):
        every (tokens, picks) pair of buckets a window can have, so nothing is compiled while
        serving (until a --kv-resident window reaches the host part). Otherwise: decode rows alone
        for each row bucket (min_rows, 2 min_rows, ... up to parallel), one whole prompt chunk
        alone, and each decode bucket with one whole chunk. Both: verify rows alone for each row
        bucket with --spec (never packed); whatever else a window needs (a verify group beside a
        prompt chunk, ...) is built off the engine thread while the engine runs these (EngineCore
        narrows a window: a chunk pads to a whole one, and decode rows can run without it)."""
        rows, buckets = self.min_rows, []
        while True:
            buckets.append(rows)
            if rows >= self.parallel:
                break
            rows *= 2
        kv, chunk = self.kv_bucket(1), self.prefill
        # verify windows are never packed (scheduler.py): their layouts are the same in both kinds
        # of window
        verify = [Layout(((r, 1 + self.spec, True, 0),), kv) for r in buckets] if self.spec else []
        if self.packed:           # every (tokens, picks) bucket pair a window can have: all of them
            n = max(self.batch_tokens, self.parallel + min(chunk, self.cache_len))
            most = 1 << (n - 1).bit_length()
            return verify + [Layout(((t, 1, False, e),), kv) for t in _powers(most)
                             for e in _powers(min(t, buckets[-1]))]
        prompt = (1, chunk, False, 0)
        lays = [Layout(((r, 1, False, 0),), kv) for r in buckets] + [Layout((prompt,), kv)] + verify
        if self.parallel > 1:
            lays += [Layout(((r, 1, False, 0), prompt), kv) for r in buckets]
        return lays


def verify_only(layout: Layout) -> bool:
    """One verify group alone (rows of 1 + --spec tokens, every logit): the warm-up builds these
    with the decode ones, or every window with drafts would be narrowed to plain decode until the
    builder thread reached them (issue 32, finding 6)."""
    return len(layout.groups) == 1 and layout.groups[0][2] and layout.groups[0][1] > 1


def decode_only(layout: Layout) -> bool:
    """One group of one token a row, a logit a row: decode rows alone (packed: tokens == picks)."""
    if len(layout.groups) != 1:
        return False
    r, n, a, e = layout.groups[0]
    return n == 1 and not a and e in (0, r)


def _powers(most: int) -> list[int]:
    """1, 2, 4, ... up to `most` (a power of two)."""
    out = [1]
    while out[-1] < most:
        out.append(out[-1] * 2)
    return out
