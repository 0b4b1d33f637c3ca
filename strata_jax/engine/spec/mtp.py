"""The MTP drafter (`--drafter mtp`): the model's own next-token-prediction (NextN) layer
(model/mtp.py).

The layer maps (h_p, t_{p+1}) -> a guess of t_{p+2}, where h_p is the main model's last hidden state
at position p; it has a KV cache of its own (cache layer n_layers), whose entry at p depends on
both. So:

- Sync, after every window (`after_window`): the window programs hand back every token's hidden
  state (ModelRunner.with_hidden; EngineCore hands them over after the window). For each row, the
  positions the window committed (p < the slot's n_past after the window: a prompt chunk, a decode
  token, a verify row's accepted run) whose next token is known are run through the layer, one small
  program a group of the window, which writes the layer's KV at those positions (overwriting what
  drafting wrote there) and returns, for each row's last committed position p = n_past - 1, the
  first draft (t_{p+2}: the token after the one the next window reads), its probability, and the
  layer's hidden_out.
- Propose, before a window: the first draft is there already; each further draft applies the layer
  to its own hidden_out and the draft just made, one position on ([rows, 1] programs), as
  transformers' MtpModel and SGLang chain it. Drafting stops at --spec-min-p (softmax at temperature
  1 of the layer's logits), so q is one-hot at the draft, as for the other drafters.

The prefix cache reuses one token fewer with this drafter (PrefixCache.reread): the layer's entry at
the last reused position was written with the old conversation's next token, which the new prompt
may not share; reading that token again rewrites it from this conversation's own tokens.
(Engine.logits and logits_reusing, the research path, do not sync the layer: a request reusing a
prefix that logits_reusing left in a slot drafts from partly stale layer KV. Drafts only: verified
output never depends on them.)

Dependencies, all explicit: the NextN layer's weights (params["mtp"]: the runner loads its experts
onto the device, one layer's worth, also with the expert tiers), the program cache (its programs are
stage "mtp" there: bounded, budgeted, freed on OOM like the windows'; it registers their builder),
the KVCache its programs write through, the run options and the window layouts' KV bucket.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ...config import ConfigError
from ...model import mtp_forward
from ..execute.kv_cache import KVCache
from ..execute.programs import Layout, ProgramCache
from ..schedule.scheduler import bucket
from .draft_model import top1

log = logging.getLogger("strata_jax.engine")


@dataclass
class Next:
    """A decoding slot's first draft, from the sync of its last window."""
    pos: int                 # p: the slot's last committed position (n_past - 1 then)
    hidden: jax.Array        # [R, h] the sync program's hidden_out; this slot's is row `row`
    row: int
    token: int               # the draft of t_{p+2}
    prob: float


class MtpDrafter:
    name = "mtp"

    def __init__(self, spec, params: dict | None, programs: ProgramCache, kv: KVCache, opts,
                 kv_bucket: Callable[[int], int]):
        """params: the weights' "mtp" subtree (None: the model has none); kv_bucket: the KV length a
        program over positions below n attends over (layouts.WindowLayouts.kv_bucket)."""
        if not spec.n_nextn or params is None:
            raise ConfigError(f"drafter = 'mtp': this {spec.architecture} model has no "
                              "next-token-prediction (nextn) layer; use --drafter ngram or "
                              "draft:PATH.gguf")
        self.spec, self.params, self.opts = spec, params, opts
        self.programs, self.kv, self.kv_bucket = programs, kv, kv_bucket
        programs.register("mtp", self._build)
        self.next: dict[int, Next] = {}           # slot index -> its first draft
        # tests: a list gets (slot tokens, drafts, probs) each propose
        self.record: list | None = None
        # positions run through the layer to keep its KV in sync
        self.synced = 0
        self.chained = 0                          # further drafts made by chaining the layer

    def reset(self, slot) -> None:
        self.next.pop(slot.index, None)

    # ---- after a window: keep the layer's KV in sync, and make the first drafts ------------------

    def after_window(self, window, hiddens: list[jax.Array]) -> None:
        # each group's slots, by row (scheduler.Scheduler.plan)
        rows_of = []
        if window.decode:
            rows_of.append(window.decode)
        if window.prefills:
            rows_of.append(window.prefills)
        for g, hidden, slots in zip(window.groups, hiddens, rows_of):
            tokens = np.zeros_like(g.tokens)
            pos = np.full_like(g.pos, -1)
            for i, s in enumerate(slots):
                for j, p in enumerate(g.pos[i]):
                    # not committed, or next unknown
                    if p < 0 or p >= s.n_past or p + 1 >= len(s.tokens):
                        break
                    tokens[i, j], pos[i, j] = s.tokens[p + 1], p
            if (pos < 0).all():
                continue
            self.synced += int((pos >= 0).sum())
            tok, prob, out = self._apply(hidden, tokens, pos, g.slots)
            for i, s in enumerate(slots):
                if s.decoding and pos[i, 0] >= 0 and int(pos[i].max()) == s.n_past - 1:
                    self.next[s.index] = Next(s.n_past - 1, out, i, int(tok[i]), float(prob[i]))
                else:
                    self.next.pop(s.index, None)

    def _apply(self, hidden, tokens: np.ndarray, pos: np.ndarray, slots: np.ndarray):
        """The layer over rows of positions -> (draft [R], probability [R]) as numpy, hidden_out [R,
        h]."""
        R, L = tokens.shape
        layout = Layout(((R, L, True, 0),), self.kv_bucket(int(pos.max()) + 1), stage="mtp")
        tok, prob, out = self.kv.through(lambda c: self.programs.run(layout, self.params, c, hidden,
                                                                     tokens, pos, slots))
        return np.asarray(tok), np.asarray(prob), out

    def _build(self, layout: Layout):
        (R, L, _, _), = layout.groups
        spec, opts, kv_len, host = self.spec, self.opts, layout.kv_len, self.kv.host

        def program(params, cache, hidden, tokens, pos, slots):
            logits, out, cache = mtp_forward({"mtp": params}, spec, opts, hidden, tokens, pos,
                                             slots, cache, kv_len, host, last_only=True)
            tok, prob = top1(logits)
            return tok, prob, out, cache

        S = jax.ShapeDtypeStruct
        i32 = jnp.int32
        return jax.jit(program, donate_argnums=(1,)).lower(
            self.params, self.kv.arrays, S((R, L, spec.hidden), jnp.dtype(opts.dtype)),
            S((R, L), i32), S((R, L), i32), S((R,), i32)).compile()

    # ---- before a window: drafts -----------------------------------------------------------------

    def propose(self, slots, counts: list[int],
                min_p: float) -> list[tuple[list[int], list[float]]]:
        drafts: list[list[int]] = [[] for _ in slots]
        probs: list[list[float]] = [[] for _ in slots]
        # i -> (position of the next step, hidden [h])
        state = {}
        for i, s in enumerate(slots):
            n = self.next.get(s.index)
            if n is None or n.pos != s.n_past - 1:        # e.g. the slot's last window failed
                continue
            drafts[i], probs[i] = [n.token], [n.prob]
            state[i] = (n.pos + 1, n.hidden[n.row])
        for step in range(1, max(counts, default=0)):
            live = [i for i in state if counts[i] > step and probs[i][-1] >= min_p]
            if not live:
                break
            rows = bucket(len(live), 2)
            tokens = np.zeros((rows, 1), np.int32)
            pos = np.full((rows, 1), -1, np.int32)
            idx = np.zeros(rows, np.int32)
            for j, i in enumerate(live):
                tokens[j, 0], pos[j, 0], idx[j] = drafts[i][-1], state[i][0], slots[i].index
            hidden = jnp.stack([state[i][1] for i in live]
                               + [jnp.zeros_like(state[live[0]][1])] * (rows - len(live)))
            tok, prob, out = self._apply(hidden[:, None], tokens, pos, idx)
            self.chained += len(live)
            for j, i in enumerate(live):
                drafts[i].append(int(tok[j]))
                probs[i].append(float(prob[j]))
                state[i] = (state[i][0] + 1, out[j])
        if self.record is not None:
            self.record += [(list(s.tokens), d, p) for s, d, p in zip(slots, drafts, probs) if d]
        return list(zip(drafts, probs))

    def stats(self) -> dict:
        return {"mtp_synced_positions": self.synced, "mtp_chained_drafts": self.chained}

    def close(self) -> None:
        pass
