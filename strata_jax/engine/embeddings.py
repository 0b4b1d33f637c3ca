"""Embeddings: a text's hidden states, pooled into one vector (OpenAI's /v1/embeddings, llama.cpp's
/embeddings), run on the engine thread between windows (EngineCore's "embed" job).

The hidden state is the model's last one after the final norm (what the output head reads), as llama.cpp
takes its embeddings from a generative model. A text is read in the scheduler's prompt chunks on a scratch
copy of the KV cache (KVCache.scratch), so no slot's KV is touched; each chunk runs the "hidden" program
of its chunk length: forward() with its hidden states returned and its logits left out (XLA drops the
output head), through the program cache like every other program, so it is bounded and budgeted the same.

Pooling (`--pooling`, llama.cpp's): last (the last token's; the default for a generative model, as vLLM's),
mean, cls (the first token's), or none (every token's: llama.cpp's /embeddings only). Normalizing is the
request's (llama.cpp's `embd_normalize`: -1 none, 0 max-abs scaled to int16, 1 taxicab, 2 Euclidean (the
default, as OpenAI's), p > 2 the p-norm).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..model import Group, forward
from .kv_cache import KVCache
from .programs import Layout, ProgramCache
from .window_program import shapes

POOLINGS = ("last", "mean", "cls", "none")
_GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last"}      # llama.cpp's {arch}.pooling_type


def model_pooling(metadata: dict, architecture: str) -> str:
    """The pooling the file asks for (an embedding model's `{arch}.pooling_type`), else last: a generative
    model's last token has read the whole text (vLLM's default for them)."""
    return _GGUF_POOLING.get(metadata.get(f"{architecture}.pooling_type"), "last")


class Embedder:
    """Hidden states of token ids, with the weights, the program cache and the KVCache it is given."""

    def __init__(self, params: dict, spec, opts, programs: ProgramCache, kv: KVCache, kv_bucket, chunk: int):
        self.params, self.spec, self.opts = params, spec, opts
        self.programs, self.kv, self.kv_bucket, self.chunk = programs, kv, kv_bucket, chunk
        programs.register("hidden", self._build)

    def hidden_states(self, ids: list[int]) -> np.ndarray:
        """float32 [T, hidden] for `ids`, on a scratch KV cache, a prompt chunk at a time."""
        out = []
        with self.kv.scratch():
            for start in range(0, len(ids), self.chunk):
                part = ids[start:start + self.chunk]
                length = min(max(16, 1 << (len(part) - 1).bit_length()), self.chunk)
                tokens = np.zeros((1, length), np.int32)
                pos = np.full((1, length), -1, np.int32)
                tokens[0, :len(part)] = part
                pos[0, :len(part)] = np.arange(start, start + len(part))
                layout = Layout(((1, length, False, 0),), self.kv_bucket(start + len(part)), stage="hidden")
                h = self.kv.through(lambda c, layout=layout, tokens=tokens, pos=pos: self.programs.run(
                    layout, self.params, c, tokens, pos, np.zeros((1,), np.int32)))
                out.append(np.asarray(h, np.float32)[0, :len(part)])
        return np.concatenate(out, axis=0)

    def _build(self, layout: Layout):
        (rows, length, _, _), = layout.groups
        spec, opts, host = self.spec, self.opts, self.kv.host

        def program(params, cache, tokens, pos, slots):
            res = forward(params, spec, opts, (Group(tokens, pos, slots, False, None),), cache, layout.kv_len,
                          with_hidden=True, host=host)
            return res.hiddens[0], res.cache

        S, i32 = jax.ShapeDtypeStruct, jnp.int32
        return jax.jit(program, donate_argnums=(1,)).lower(
            shapes(self.params), shapes(self.kv.arrays), S((rows, length), i32), S((rows, length), i32),
            S((rows,), i32)).compile()


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


def embed(core, inputs: list[list[int]], pooling: str, how: int) -> list[np.ndarray]:
    """The engine thread's job: each input's pooled, normalized embedding."""
    embedder = core.runner.embedder
    if embedder is None:
        raise RuntimeError("embeddings need the whole model on one device: this engine runs expert tiers or "
                           "several devices (--devices N)")
    how = -1 if pooling == "none" else how              # every token's vector as it is (llama.cpp's)
    out = []
    for ids in inputs:
        out.append(normalize(pool(embedder.hidden_states(ids), pooling), how))
        chunks = -(-len(ids) // embedder.chunk)         # each chunk a window of one row (llama.cpp: a decode)
        core.runner.windows += chunks                   # the windows /metrics counts (llamacpp:n_decode)
        core.counters["window_rows"] += chunks
    return out
