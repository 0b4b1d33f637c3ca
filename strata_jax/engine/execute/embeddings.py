"""Embeddings: a text's hidden states, pooled into one vector (OpenAI's /v1/embeddings, llama.cpp's
/embeddings), run on the engine thread between windows (EngineCore's `embeds`).

The hidden state is the model's last one after the final norm (what the output head reads), as
llama.cpp takes its embeddings from a generative model. A text is read in the scheduler's prompt
chunks on a scratch copy of the KV cache (KVCache.scratch), so no slot's KV is touched, a piece a
step between the generation windows (Embeddings: a long request never stops the engine loop); each
chunk runs the "hidden" program of its chunk length: forward() with its hidden states returned and
its logits left out (XLA drops the output head), through the program cache like every other program,
so it is bounded and budgeted the same.

Pooling (`--pooling`, llama.cpp's): last (the last token's; the default for a generative model, as
vLLM's), mean, cls (the first token's), or none (every token's: llama.cpp's /embeddings only).
Normalizing is the request's (llama.cpp's `embd_normalize`: -1 none, 0 max-abs scaled to int16, 1
taxicab, 2 Euclidean (the default, as OpenAI's), p > 2 the p-norm).
"""

from __future__ import annotations

from collections import deque

import jax
import jax.numpy as jnp
import numpy as np

from ...model import Group, forward
from .kv_cache import KVCache
from .programs import Layout, ProgramCache
from .window_program import shapes

POOLINGS = ("last", "mean", "cls", "none")
_GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last"}      # llama.cpp's {arch}.pooling_type


def model_pooling(metadata: dict, architecture: str) -> str:
    """The pooling the file asks for (an embedding model's `{arch}.pooling_type`), else last: a
    generative model's last token has read the whole text (vLLM's default for them)."""
    return _GGUF_POOLING.get(metadata.get(f"{architecture}.pooling_type"), "last")


class Embedder:
    """Hidden states of token ids, with the weights, the program cache and the KVCache it is
    given."""

    def __init__(self, params: dict, spec, opts, programs: ProgramCache, kv: KVCache, kv_bucket,
                 chunk: int):
        self.params, self.spec, self.opts = params, spec, opts
        self.programs, self.kv, self.kv_bucket, self.chunk = programs, kv, kv_bucket, chunk
        programs.register("hidden", self._build)

    def piece(self, ids: list[int], start: int, kept: dict) -> np.ndarray:
        """float32 [T, hidden] for ids[start:start + chunk], on the scratch KV cache `kept` carries
        from piece to piece (KVCache.scratch): the earlier pieces' KV is there for this one to read.
        A text that starts over at 0 writes each position before it reads it, so one scratch cache
        serves text after text."""
        part = ids[start:start + self.chunk]
        length = min(max(16, 1 << (len(part) - 1).bit_length()), self.chunk)
        tokens = np.zeros((1, length), np.int32)
        pos = np.full((1, length), -1, np.int32)
        tokens[0, :len(part)] = part
        pos[0, :len(part)] = np.arange(start, start + len(part))
        layout = Layout(((1, length, False, 0),), self.kv_bucket(start + len(part)), stage="hidden")
        with self.kv.scratch(kept):
            h = self.kv.through(lambda c: self.programs.run(layout, self.params, c, tokens, pos,
                                                            np.zeros((1,), np.int32)))
        return np.asarray(h, np.float32)[0, :len(part)]

    def _build(self, layout: Layout):
        (rows, length, _, _), = layout.groups
        spec, opts, host = self.spec, self.opts, self.kv.host

        def program(params, cache, tokens, pos, slots):
            res = forward(params, spec, opts, (Group(tokens, pos, slots, False, None),), cache,
                          layout.kv_len, with_hidden=True, host=host)
            return res.hiddens[0], res.cache

        S, i32 = jax.ShapeDtypeStruct, jnp.int32
        return jax.jit(program, donate_argnums=(1,)).lower(
            shapes(self.params), shapes(self.kv.arrays), S((rows, length), i32),
            S((rows, length), i32), S((rows,), i32)).compile()


def pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """[T, h] -> [h] (last, mean, cls) or [T, h] (none)."""
    if pooling == "last":
        return hidden[-1]
    if pooling == "mean":
        return hidden.mean(axis=0)
    if pooling == "cls":
        return hidden[0]
    return hidden


def normalize(v: np.ndarray, how: int) -> np.ndarray:
    """llama.cpp's common_embd_normalize over the last axis."""
    v = v.astype(np.float64)
    if how < 0:
        return v.astype(np.float32)
    if how == 0:
        norm = np.abs(v).max(axis=-1, keepdims=True) / 32760.0
    elif how == 2:
        norm = np.sqrt((v * v).sum(axis=-1, keepdims=True))
    else:
        norm = (np.abs(v) ** how).sum(axis=-1, keepdims=True) ** (1.0 / how)
    return (v / np.where(norm > 0, norm, 1.0)).astype(np.float32)


class EmbedJob:
    """One embed request on the engine thread: where its reading is, and what it has read."""

    def __init__(self, inputs: list[list[int]], pooling: str, how: int, cancel, done):
        self.inputs, self.pooling, self.done, self.cancel = inputs, pooling, done, cancel
        # every token's vector as it is (llama.cpp's)
        self.how = -1 if pooling == "none" else how
        self.i, self.start = 0, 0                       # the input being read, and its next token
        self.parts: list[np.ndarray] = []               # its hidden states so far
        self.out: list[np.ndarray] = []                 # the finished inputs' vectors

    def next_len(self, chunk: int) -> int:
        return min(chunk, len(self.inputs[self.i]) - self.start)


class Embeddings:
    """The embed jobs waiting on the engine thread, first come first served (one scratch KV cache at
    a time). Each step() reads one piece, at most a prompt chunk of tokens (a chunk of a long text,
    or several short texts whole), between the generation windows: a request of 2,048 long texts
    delays each window by a chunk's time, never stops the loop, its heartbeat or the streams beside
    it (issue 32, item 3)."""

    def __init__(self, runner, max_context: int):
        self.runner, self.max_context = runner, max_context
        self.jobs: deque[EmbedJob] = deque()
        # pieces read since the start: windows of one row (llama.cpp: decodes)
        self.pieces = 0
        self.kept: dict = {}            # the scratch KV cache, from piece to piece while jobs wait

    def add(self, inputs: list[list[int]], pooling: str, how: int, cancel, done) -> None:
        if self.runner.embedder is None:
            done.put(RuntimeError("embeddings need the whole model on one device: this engine runs "
                                  "expert tiers or several devices (--devices N)"))
            return
        n, n_ctx = sum(len(ids) for ids in inputs), self.max_context
        # every token's vector is answered: as many as a slot holds
        if pooling == "none" and n > n_ctx:
            done.put(ValueError(f"input: {n} tokens in all; with pooling none (every token's "
                                f"vector) a request embeds at most a slot's context, {n_ctx} "
                                "tokens (--max-context)"))
            return
        self.jobs.append(EmbedJob(inputs, pooling, how, cancel, done))

    def step(self) -> bool:
        """Read the first job's next piece -> whether there was one. A job's failure (or its cancel)
        is its caller's answer; no slot, no request in flight is touched."""
        if not self.jobs:
            return False
        job = self.jobs[0]
        if job.cancel is not None and job.cancel.is_set():
            self._end(RuntimeError("the embeddings were cancelled"))
            return True
        try:
            self._read(job, self.runner.embedder)
        except Exception as e:  # noqa: BLE001 - handed to the caller
            self._end(e)
            return True
        if job.i == len(job.inputs):
            self._end(job.out)
        return True

    def _end(self, answer) -> None:
        """The first job is done: the scratch cache goes (its memory back) when no job is left or
        this one failed (a failed run may have consumed it), then its caller hears."""
        job = self.jobs.popleft()
        if not self.jobs or isinstance(answer, BaseException):
            self.kept.clear()
        job.done.put(answer)

    def _read(self, job: EmbedJob, embedder: Embedder) -> None:
        budget = embedder.chunk
        while (job.i < len(job.inputs)
               and (budget == embedder.chunk or job.next_len(embedder.chunk) <= budget)):
            ids = job.inputs[job.i]
            n = job.next_len(embedder.chunk)
            job.parts.append(embedder.piece(ids, job.start, self.kept))
            job.start += n
            budget -= n
            # as /metrics counts windows (llamacpp:n_decode)
            self.pieces += 1
            if job.start == len(ids):
                job.out.append(normalize(pool(np.concatenate(job.parts, axis=0), job.pooling),
                                         job.how))
                job.i, job.start, job.parts = job.i + 1, 0, []

    def fail_all(self, why: str) -> None:
        while self.jobs:
            self.jobs.popleft().done.put(RuntimeError(why))
        self.kept.clear()
