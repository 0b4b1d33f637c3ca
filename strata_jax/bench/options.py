"""What a bench run measures: the sizes are small on purpose, so that a full run on a 2-core CPU
(both engines, three parallel settings) takes minutes, not hours."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from strata_jax.config import EngineConfig


@dataclass
class BenchOptions:
    model: str
    prompt_tokens: int = 512            # the prompt the prefill figure reads (one request)
    decode_tokens: int = 64             # tokens each sequence generates in a decode measurement
    # each decoding sequence's prompt (short: decode starts near position 0)
    decode_prompt_tokens: int = 32
    parallel_list: tuple[int, ...] = (1, 4, 8)
    vs: str | None = None               # "llama.cpp": the same measurements with llama-cpp-python
    threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    # measured runs a figure (the best is kept), after one warm-up run
    repeat: int = 1
    engine: EngineConfig | None = None  # our engine's settings (its parallel is max(parallel_list))
    # None: the smallest power of two (>= 256) the measurements fit
    max_context: int | None = None
    bandwidth_gib: float = 1.0          # size of the array the memory bandwidth is measured on
    seed: int = 0
    # (E, K): bench a MoE twin of the dense `model` (E experts, top-K; bench/twin.py) instead of it
    moe_twin: tuple[int, int] | None = None
    twin_cache: str | None = None       # where twins are kept (None: <cache folder>/twins)

    def validate(self) -> None:
        def need(cond: bool, flag: str, value, what: str) -> None:
            if not cond:
                raise ValueError(f"{flag} {value}: {what}")

        need(self.prompt_tokens >= 1, "--prompt-tokens", self.prompt_tokens, "must be at least 1")
        need(self.decode_tokens >= 2, "--decode-tokens", self.decode_tokens,
             "must be at least 2 (a decode rate needs two tokens)")
        need(self.decode_prompt_tokens >= 1, "--decode-prompt-tokens", self.decode_prompt_tokens,
             "must be at least 1")
        need(bool(self.parallel_list) and all(1 <= n <= 256 for n in self.parallel_list),
             "--parallel-list",
             ",".join(map(str, self.parallel_list)), "must be sequence counts from 1 to 256")
        need(self.vs in (None, "llama.cpp"), "--vs", self.vs,
             "the only engine to compare with is llama.cpp")
        need(1 <= self.threads <= (os.cpu_count() or 1), "--threads", self.threads,
             f"must be 1 to this machine's {os.cpu_count()} cores")
        need(self.repeat >= 1, "--repeat", self.repeat, "must be at least 1")
        need(self.bandwidth_gib > 0, "--bandwidth-gib", self.bandwidth_gib, "must be > 0")
        if self.moe_twin is not None:
            from strata_jax.bench.twin import check_moe_twin

            check_moe_twin(tuple(self.moe_twin))

    @property
    def max_parallel(self) -> int:
        return max(self.parallel_list)

    def context_needed(self) -> int:
        """Tokens one slot must hold: the prefill prompt plus its one token, or a decode
        sequence."""
        return max(self.prompt_tokens + 1, self.decode_prompt_tokens + self.decode_tokens)
