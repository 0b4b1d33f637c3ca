"""llama.cpp's figures on the same GGUF, through llama-cpp-python's low-level API (the `llama_cpp`
module's C functions), measured the way `ours` measures ours:

- prefill: one llama_decode of the whole prompt (one sequence), logits of the last token only;
- decode with N sequences: a context with n_seq_max=N and N * (prompt + generated) tokens (rounded
  up to a multiple of 256 a sequence); the N prompts go in through one llama_decode, then every step
  is one llama_batch holding one token for each sequence (seq_id 0..N-1), greedy, as llama.cpp's own
  server and `llama-batched-bench` decode.

Each measurement runs once short (or whole, for the prefill) before it is timed: llama.cpp allocates
its compute buffers and touches the memory-mapped weights on first use.

It runs in a child process of its own (`measure_llamacpp`): llama.cpp is native code loaded beside
JAX's, and a crash there (a build for another CPU dies with an illegal instruction; one CI run died
with a segmentation fault in the bench's llama.cpp test) must end the bench with an error that says
so, not the process that asked for it. Our engine's threads are gone from the measurement too.
"""

from __future__ import annotations

import ctypes
import json
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict

import numpy as np

from strata_jax.bench.options import BenchOptions
from strata_jax.bench.ours import prompt_ids


def _lib():
    import llama_cpp
    from llama_cpp._logger import set_verbose

    set_verbose(False)          # its log callback otherwise prints every graph build's debug lines
    llama_cpp.llama_backend_init()
    return llama_cpp


class LlamaCpp:
    """A loaded model and one context at a time; `batch` holds up to `capacity` tokens."""

    def __init__(self, path: str, threads: int):
        self.L = L = _lib()
        params = L.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        self.threads = threads

    @contextmanager
    def context(self, n_ctx: int, n_seq: int, n_batch: int):
        L = self.L
        cp = L.llama_context_default_params()
        cp.n_ctx, cp.n_seq_max = n_ctx, n_seq
        cp.n_batch = n_batch
        cp.n_ubatch = min(n_batch, 512)
        cp.n_threads = cp.n_threads_batch = self.threads
        ctx = L.llama_init_from_model(self.model, cp)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} tokens for {n_seq} "
                               "sequences")
        batch = L.llama_batch_init(n_batch, 0, n_seq)
        try:
            yield ctx, batch
        finally:
            L.llama_batch_free(batch)
            L.llama_free(ctx)

    def close(self) -> None:
        if self.model:
            self.L.llama_model_free(self.model)
            self.model = None

    # ---- primitives ------------------------------------------------------------------------------

    def decode(self, ctx, batch, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits)."""
        batch.n_tokens = len(items)
        for i, (tok, pos, seq, logits) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = tok, pos, 1, logits
            batch.seq_id[i][0] = seq
        rc = self.L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc} for a batch of {len(items)} tokens")

    def argmax(self, ctx, i: int) -> int:
        ptr = self.L.llama_get_logits_ith(ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                         (self.n_vocab,)).argmax())

    def clear(self, ctx) -> None:
        self.L.llama_memory_clear(self.L.llama_get_memory(ctx), True)

    # ---- measurements ----------------------------------------------------------------------------

    def prefill(self, ids: list[int], repeat: int) -> dict:
        runs = []
        with self.context(len(ids) + 16, 1, len(ids)) as (ctx, batch):
            items = [(t, p, 0, p == len(ids) - 1) for p, t in enumerate(ids)]
            for i in range(repeat + 1):
                self.clear(ctx)
                t = time.perf_counter()
                self.decode(ctx, batch, items)
                self.argmax(ctx, len(ids) - 1)
                if i:
                    runs.append(len(ids) / (time.perf_counter() - t))
        return {"prompt_tokens": len(ids), "tokens_per_second": max(runs), "runs": runs}

    def batched_decode(self, prompts: list[list[int]], tokens: int, repeat: int) -> dict:
        n, plen = len(prompts), len(prompts[0])
        warm = min(tokens, 8)
        best = None
        # N * (prompt + generated) tokens, each sequence's share rounded up to llama.cpp's 256-token
        # padding (it pads n_ctx to 256 and then splits it evenly: a multiple of 256 a sequence
        # divides exactly).
        per_seq = -(-(plen + tokens) // 256) * 256
        with self.context(n * per_seq, n, max(n * plen, n)) as (ctx, batch):
            for run in range(repeat + 1):
                self.clear(ctx)
                items = [(t, p, s, p == plen - 1) for s, ids in enumerate(prompts)
                         for p, t in enumerate(ids)]
                self.decode(ctx, batch, items)
                last = [self.argmax(ctx, s * plen + plen - 1) for s in range(n)]
                # the prompt's logits gave each sequence its first
                steps = (warm if run == 0 else tokens) - 1
                t = time.perf_counter()
                for k in range(steps):
                    self.decode(ctx, batch, [(last[s], plen + k, s, True) for s in range(n)])
                    last = [self.argmax(ctx, s) for s in range(n)]
                seconds = time.perf_counter() - t
                if run == 0:
                    continue
                fig = {"parallel": n, "aggregate": n * steps / seconds,
                       "per_sequence": steps / seconds, "per_sequence_min": steps / seconds,
                       "steady_seconds": seconds, "tokens": tokens}
                if best is None or fig["aggregate"] > best["aggregate"]:
                    best = fig
        return best


# The child's command line (a test replaces it with one that crashes).
CHILD = [sys.executable, "-m", "strata_jax.bench.llamacpp"]


def measure_llamacpp(opts: BenchOptions, vocab: int, progress=print) -> dict:
    """llama.cpp's figures, measured in a child process (`python -m strata_jax.bench.llamacpp`): its
    progress lines pass through, its figures come back as JSON; a child that dies raises
    RuntimeError."""
    job = {"options": {k: v for k, v in asdict(opts).items() if k != "engine"}, "vocab": vocab}
    child = subprocess.Popen(CHILD, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    out, _ = child.communicate(json.dumps(job))
    result = None
    for line in out.splitlines():
        kind, _, text = line.partition(" ")
        if kind == "progress":
            progress(text)
        elif kind == "result":
            result = json.loads(text)
    if child.returncode != 0 or result is None:
        rc = child.returncode
        how = f"signal {signal.Signals(-rc).name}" if rc < 0 else f"exit code {rc}"
        raise RuntimeError(f"llama.cpp's measurement of {opts.model} died ({how}) in its child "
                           "process: see the lines above; our figures are not affected")
    return result


def _measure_here(opts: BenchOptions, vocab: int, progress=print) -> dict:
    t = time.perf_counter()
    lc = LlamaCpp(opts.model, opts.threads)
    try:
        load_s = time.perf_counter() - t
        progress(f"llama.cpp: loaded in {load_s:.1f} s ({opts.threads} threads); prefill of "
                 f"{opts.prompt_tokens} tokens")
        prefill = lc.prefill(prompt_ids(vocab, opts.prompt_tokens, opts.seed), opts.repeat)
        decode = []
        for n in opts.parallel_list:
            progress(f"llama.cpp: decode, {n} sequence{'s' if n > 1 else ''}")
            prompts = [prompt_ids(vocab, opts.decode_prompt_tokens, opts.seed + 1 + i)
                       for i in range(n)]
            decode.append(lc.batched_decode(prompts, opts.decode_tokens, opts.repeat))
    finally:
        lc.close()
    return {"engine": {"weights": "blocks", "threads": opts.threads}, "load_seconds": load_s,
            "prefill": prefill, "decode": decode}


def _child() -> int:
    """The child's side: a job (options, vocab) as JSON on stdin; 'progress <text>' lines and one
    'result <json>' line on stdout."""
    job = json.loads(sys.stdin.read())
    o = job["options"]
    opts = BenchOptions(**{**o, "parallel_list": tuple(o["parallel_list"]),
                           "moe_twin": tuple(o["moe_twin"]) if o.get("moe_twin") else None})

    def say(text: str) -> None:
        print("progress", text, flush=True)

    print("result", json.dumps(_measure_here(opts, job["vocab"], say)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_child())
