"""All-token logits for research and checks (Engine.logits, Engine.logits_reusing), run on the
engine thread between windows: one on a scratch copy of the KV cache, so the slots' KV is untouched;
one on a free slot through the prefix cache, as a request would read its prompt."""

from __future__ import annotations

import numpy as np

from .execute.layouts import GroupInput
from .execute.sampler import SamplingRows
from .schedule.scheduler import bucket


def logits_on_scratch(core, ids: list[int]) -> np.ndarray:
    """float32 [T, vocab] for `ids`, read in the scheduler's chunks on a blank KV cache."""
    chunk, out = core.scheduler.max_chunk, []
    with core.runner.scratch_kv():
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            length = min(max(16, 1 << (len(part) - 1).bit_length()), chunk)
            out.append(_read(core.runner, ids, start, len(part), length, slot=0))
    return np.concatenate(out, axis=0)


def logits_reusing(core, ids: list[int]) -> tuple[int, np.ndarray]:
    """(tokens reused, float32 [T - reused, vocab]) for the tokens a request with prompt `ids` would
    read, on the slot the prefix cache picks, cut at the scheduler's chunk boundaries. The slot
    keeps the KV."""
    free = [s for s in core.slots if s.free]
    if not free:
        raise RuntimeError("logits_reusing needs a free slot; every slot is busy")
    placed = core.admission.place(ids, free)
    if placed is None:
        raise RuntimeError("the prefix cache failed to place the tokens (see the log)")
    slot, n = placed
    slot.load(ids, n)
    chunk, out = core.scheduler.max_chunk, []
    try:
        while slot.n_past < len(ids):
            start = slot.n_past
            part = min(chunk - start % chunk, len(ids) - start)     # the scheduler's boundaries
            out.append(_read(core.runner, ids, start, part, min(bucket(part, 16), chunk),
                             slot=slot.index))
            slot.advance(part)
    except Exception:
        slot.forget()
        if core.runner.cache_lost():
            core.lose_cache(RuntimeError("logits_reusing failed"))
        raise
    # free, keeping the KV it read (the prefix cache's, as a request's)
    slot.release()
    return n, np.concatenate(out, axis=0)


def _read(runner, ids: list[int], start: int, part: int, length: int, slot: int) -> np.ndarray:
    """One all-logits window over ids[start:start + part], padded to `length` -> [part, vocab]."""
    tokens = np.zeros((1, length), np.int32)
    pos = np.full((1, length), -1, np.int32)
    tokens[0, :part] = ids[start:start + part]
    pos[0, :part] = np.arange(start, start + part)
    g = GroupInput(tokens, pos, np.array([slot], np.int32), SamplingRows.greedy(1), all_logits=True)
    return runner.run([g], start + part)[0][0, :part]
