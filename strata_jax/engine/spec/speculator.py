"""Speculative decoding's glue: which slots draft how many tokens, and the counters.

Before each window the engine asks the Speculator for drafts of its decoding slots; the scheduler
puts them in a verify group (scheduler.verify_group), the runner applies the accept rule (accept.py)
and the engine emits the accepted tokens one by one (so a stop string, EOS or max_tokens inside an
accepted run ends the request right there). A drafter (ngram.py, draft_model.py, mtp.py) only
proposes:

    drafter.propose(slots, counts, min_p) -> [(tokens, probs)] a slot   # at most counts[i] tokens
        each
    drafter.reset(slot)                                                 # a new request took the
        slot
    drafter.after_window(window, hiddens)     # optional: every window's hidden states (the mtp drafter)

Drafts are cut at the first one whose drafter probability is below --spec-min-p.
"""  # noqa: E501

from __future__ import annotations

from dataclasses import dataclass

from ...config import ConfigError, EngineConfig


@dataclass
class SpecCounters:
    drafted: int = 0           # draft tokens verified
    accepted: int = 0          # of them, accepted
    verify_windows: int = 0    # windows that held a verify group
    drafts: int = 0            # rows' drafts verified (llama.cpp's spec_decode_num_drafts)

    def as_dict(self) -> dict:
        rate = self.accepted / self.drafted if self.drafted else 0.0
        return {"draft_n": self.drafted, "draft_n_accepted": self.accepted,
                "acceptance": round(rate, 4),
                "verify_windows": self.verify_windows, "drafts": self.drafts}


class Speculator:
    def __init__(self, config: EngineConfig, drafter, cache_len: int):
        self.n = config.spec
        self.min_p = config.spec_min_p
        self.drafter = drafter
        self.cache_len = cache_len
        self.counters = SpecCounters()

    @property
    def verify_len(self) -> int:
        return 1 + self.n

    def reset(self, slot) -> None:
        self.drafter.reset(slot)

    def budget(self, slot) -> int:
        """Drafts a slot may take: --spec, fewer near max_tokens (the verify adds one token of its
        own) or the end of the slot's cache (drafts are written at the positions after n_past)."""
        n_gen = len(slot.tokens) - len(slot.request.prompt)
        return max(0, min(self.n, slot.request.params.max_tokens - n_gen - 1,
                          self.cache_len - 1 - slot.n_past))

    def propose(self, slots) -> dict[int, list[int]]:
        """slot index -> drafts, for the decoding slots that have any."""
        active = [(s, self.budget(s)) for s in slots]
        active = [(s, n) for s, n in active if n > 0]
        if not active:
            return {}
        proposals = self.drafter.propose([s for s, _ in active], [n for _, n in active], self.min_p)
        out = {}
        for (s, n), (toks, probs) in zip(active, proposals):
            k = 0
            while k < min(n, len(toks)) and probs[k] >= self.min_p:
                k += 1
            if k:
                out[s.index] = [int(t) for t in toks[:k]]
        return out

    def after_window(self, window, hiddens) -> None:
        """A window ran and its tokens were emitted: a drafter that follows the model's hidden
        states (mtp) catches up here; the others need nothing."""
        hook = getattr(self.drafter, "after_window", None)
        if hook is not None:
            hook(window, hiddens)

    def count_verify_window(self) -> None:
        self.counters.verify_windows += 1

    def record(self, request, drafted: int, accepted: int) -> None:
        self.counters.drafted += drafted
        self.counters.accepted += accepted
        self.counters.drafts += drafted > 0
        request.draft_n += drafted
        request.draft_n_accepted += accepted

    def stats(self) -> dict:
        return {**self.counters.as_dict(), "spec": self.n, "drafter": self.drafter.name,
                **self.drafter.stats()}

    def close(self) -> None:
        self.drafter.close()


def make_speculator(config: EngineConfig, model, runner) -> Speculator | None:
    """The Speculator for config.drafter, or None without speculation (--spec 0 or --drafter none).
    The runner is only read here, for the parts the drafter takes (the mtp drafter's); no drafter
    holds it."""
    if config.spec == 0 or config.drafter == "none":
        return None
    if config.drafter == "ngram":
        from .ngram import NgramDrafter

        drafter = NgramDrafter()
    elif config.drafter == "mtp":
        from .mtp import MtpDrafter

        if not runner.with_hidden:
            raise ConfigError("drafter = 'mtp': the runner was built without hidden states (needs "
                              "--spec > 0)")
        drafter = MtpDrafter(model.spec, runner.params.get("mtp"), runner.programs, runner.kv,
                             runner.opts, runner.layouts.kv_bucket)
    elif config.drafter.startswith("draft:"):
        from .draft_model import ModelDrafter

        drafter = ModelDrafter(config.drafter[len("draft:"):], config, model)
    else:
        raise ConfigError(f"drafter = {config.drafter!r}: must be ngram, mtp, none or "
                          "draft:PATH.gguf")
    return Speculator(config, drafter, runner.cache_len)
