"""The draft-model drafter (`--drafter draft:PATH.gguf`): a small model with the target's
vocabulary.

It keeps its own ModelRunner: its weights, a KV cache row per slot, and its programs in a
ProgramCache of its own (bounded by --max-programs, at most DRAFT_PROGRAMS). Before drafting for a
slot it brings its cache up to the slot's sequence: it remembers the tokens its cache holds (`fed`),
keeps the longest prefix that still matches the slot's tokens (so rejected drafts fall away by
themselves), and reads the rest: long stretches (a new prompt) in prompt chunks of one row, the last
few tokens of every slot in one batched group whose last logits give the first draft. Then one
[rows, 1] window a further draft. A draft is the model's argmax, its probability the softmax at
temperature 1 (what --spec-min-p reads); drafting is deterministic, so the accept rule's q is
one-hot at the draft.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ...config import ConfigError, EngineConfig
from ...gguf import GGUFModel
from ..execute.layouts import GroupInput
from ..execute.sampler import SamplingRows
from ..runner import ModelRunner
from ..schedule.scheduler import bucket

DRAFT_PROGRAMS = 32       # the drafter's own program bound
# tokens a slot may still need read in the batched group (after a verify: 1 or 2)
CATCH_UP = 4


def top1(logits: jax.Array):
    """logits [R, V] -> (argmax [R] int32, its softmax probability [R] float32)."""
    tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return tok, jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1)


def check_vocabulary(draft: GGUFModel, target: GGUFModel, path: str) -> None:
    """The drafter's token ids must mean the target's tokens: same size, same token strings."""
    dv, tv = draft.spec.vocab_size, target.spec.vocab_size
    if dv != tv:
        raise ConfigError(f"drafter = 'draft:{path}': its vocabulary has {dv} tokens, the model's "
                          f"has {tv}; a draft model must share the model's vocabulary")
    dt, tt = (draft.metadata.get("tokenizer.ggml.tokens"),
              target.metadata.get("tokenizer.ggml.tokens"))
    if dt is not None and tt is not None and list(dt) != list(tt):
        first = next(i for i, (a, b) in enumerate(zip(dt, tt)) if a != b)
        raise ConfigError(f"drafter = 'draft:{path}': token {first} is {dt[first]!r} in the draft "
                          f"model but {tt[first]!r} in the model; a draft model must share the "
                          "model's vocabulary")


class ModelDrafter:
    name = "draft"

    def __init__(self, path: str, config: EngineConfig, target: GGUFModel):
        if not Path(path).is_file():
            raise ConfigError(f"drafter = 'draft:{path}': no such file")
        model = GGUFModel.open(path)
        # its state cannot drop rejected drafts as its KV would
        if model.spec.deltanet is not None:
            raise ConfigError(f"drafter = 'draft:{path}': a {model.spec.architecture} draft model "
                              "is not supported (a Gated DeltaNet state cannot be cut back to the "
                              "slot's tokens): draft with an attention model, or --drafter ngram")
        check_vocabulary(model, target, path)
        bound = min(config.max_programs or DRAFT_PROGRAMS, DRAFT_PROGRAMS)
        cfg = replace(config, spec=0, drafter="none", warmup=False, max_programs=bound)
        self.runner = ModelRunner(model, cfg)
        self.max_chunk = int(self.runner.choices["prefill"])
        self._top1 = jax.jit(top1)
        # slot index -> the tokens its draft KV holds, from position 0
        self.fed: dict[int, list[int]] = {}

    def reset(self, slot) -> None:
        """Nothing to forget: the next propose keeps only the fed tokens that match the slot's new
        sequence (so a request that reuses a slot's prefix reuses the draft KV of that prefix
        too)."""

    def propose(self, slots, counts: list[int],
                min_p: float) -> list[tuple[list[int], list[float]]]:
        # tokens each slot's draft KV still lacks
        pending = [self._sync(s) for s in slots]
        # long stretches: prompt chunks of one row
        for s, todo in zip(slots, pending):
            while len(todo) > CATCH_UP:
                start = len(self.fed[s.index])
                n = min(len(todo) - CATCH_UP, self.max_chunk - start % self.max_chunk)
                self._forward([s], [todo[:n]], bucket(n, 16))
                del todo[:n]
        width = bucket(max(len(t) for t in pending), 1)
        tok, prob = self._forward(slots, pending, width)        # every slot's first draft
        drafts = [[int(t)] for t in tok[:len(slots)]]
        probs = [[float(p)] for p in prob[:len(slots)]]
        for step in range(1, max(counts)):
            live = [i for i in range(len(slots)) if counts[i] > step and probs[i][-1] >= min_p]
            if not live:
                break
            tok, prob = self._forward([slots[i] for i in live], [[drafts[i][-1]] for i in live], 1)
            for j, i in enumerate(live):
                drafts[i].append(int(tok[j]))
                probs[i].append(float(prob[j]))
        return list(zip(drafts, probs))

    def _sync(self, slot) -> list[int]:
        """Keep the fed tokens that still match the slot's sequence; -> the tokens to read."""
        fed, seq = self.fed.setdefault(slot.index, []), slot.tokens
        n = 0
        limit = min(len(fed), len(seq))
        while n < limit and fed[n] == seq[n]:
            n += 1
        del fed[n:]
        return list(seq[n:])

    def _forward(self, slots, tokens: list[list[int]], width: int):
        """Read tokens[i] after what slot i's draft KV holds, in one group [rows, width] -> the
        draft after each row's last token: (tokens [rows], probabilities [rows]) as numpy."""
        rows = bucket(len(slots), 2)
        tok = np.zeros((rows, width), np.int32)
        pos = np.full((rows, width), -1, np.int32)
        idx = np.zeros(rows, np.int32)
        needed = 0
        for i, (s, t) in enumerate(zip(slots, tokens)):
            start = len(self.fed[s.index])
            tok[i, :len(t)], pos[i, :len(t)], idx[i] = t, np.arange(start, start + len(t)), s.index
            self.fed[s.index].extend(t)
            needed = max(needed, start + len(t))
        g = GroupInput(tok, pos, idx, SamplingRows.greedy(rows))
        # [rows, V]: each row's last real token
        logits = self.runner.forward_logits([g], needed)[0]
        return tuple(np.asarray(a) for a in self._top1(logits))

    def stats(self) -> dict:
        p = self.runner.programs.snapshot()
        return {"draft_programs": p["live"], "draft_programs_built": p["built"]}

    def close(self) -> None:
        self.runner.close()
