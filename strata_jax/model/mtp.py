"""The NextN layer (multi-token prediction, MTP) of GLM-4.5 and of the hybrid families (qwen3next,
qwen35moe, whose block is gated attention): the model's own drafter for speculative decoding.

The layer predicts the token after next. For a hidden state h_p (the main model's last hidden state
at position p, AFTER its final norm: `forward(..., with_hidden=True)`) and the token t_{p+1} that
follows it:

    x      = eh_proj([enorm(embed(t_{p+1})), hnorm(h_p)])        # concat order: embedding first, [R, L, 2h] -> [R, L, h]
    y      = one decoder block (attention at position p, with its own KV at cache layer
           spec.n_layers; MoE FFN)
    h'     = shared_head_norm(y)                                  # hidden_out
    logits = shared_head_head(h')                                 # the distribution of t_{p+2}

Sources (read, not copied): llama.cpp's tensor names and shapes (blk.{n_layers}.nextn.eh_proj [h,
2h], enorm, hnorm, optional embed_tokens / shared_head_head / shared_head_norm, falling back to the
main model's embedding, output and output_norm); the concat order and the block are vLLM's, SGLang's
and transformers' (`MtpLayer`: cat([enorm(embeds), hnorm(hidden)]) -> eh_proj -> decoder layer). The
main model's hidden state is taken after its final norm, as all three take it.

Drafting N tokens applies the layer again on its own hidden_out (position p+1, the token just
drafted), as transformers' MtpModel and SGLang chain it: with the shared-head norm applied. vLLM
differs in two details that change drafts only, never verified output: it chains the block's output
before that norm, and it zeroes the embedding at position 0. We follow transformers/SGLang, and
transformers' MtpLayer is the oracle in tests/test_glm4moe.py.

The layer's KV entry at position p depends on (h_p, t_{p+1}), so a caller keeps it right by running
mtp_forward over every position whose main-model hidden state it has (the prompt after prefill, the
accepted tokens after a verify window); entries written from drafted hidden states are overwritten
then. Files with more than one NextN layer: the first is used for every step (GLM-4.5 ships one).

Interface (the speculative-decoding drafter codes against it):

    mtp_forward(params, spec, opts, hidden, tokens, pos, slots, cache, kv_len)
        hidden [R, L, h]  main-model (or previous MTP step's) hidden states at positions pos
        tokens [R, L]     int32: tokens[r, j] is the token at position pos[r, j] + 1
        pos    [R, L]     int32: the hidden states' positions; -1: padding (real tokens first)
        slots  [R]        int32: the rows' KV slots
        -> (logits [R, L, V] float32, hidden_out [R, L, h] in opts.dtype, cache)
    with last_only=True: logits [R, V] and hidden_out [R, h] of each
        row's last real position only (the
    drafter's case: the head over a whole prompt chunk would cost chunk x vocab for one draft).
"""  # noqa: E501

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..gguf import ModelSpec
from .layers import rms_norm
from .transformer import Group, RunOptions, decoder_layer
from .weights import embed_rows, linear


def has_mtp(params: dict) -> bool:
    """Whether the loaded model has a NextN (MTP) layer (ModelSpec.n_nextn > 0)."""
    return "mtp" in params


def mtp_forward(params: dict, spec: ModelSpec, opts: RunOptions, hidden: jax.Array,
                tokens: jax.Array,
                pos: jax.Array, slots: jax.Array, cache: dict[str, jax.Array], kv_len: int,
                host=None, last_only: bool = False):
    """The NextN layer over R rows of L positions -> (logits [R, L, V] float32, hidden_out [R, L,
    h], cache). Writes the layer's keys and values at cache layer spec.kv_layer(spec.n_layers) (see
    the module docstring). host: the runner's kv_host (--kv-resident), as for forward()."""
    if "mtp" not in params:
        raise ValueError(f"this {spec.architecture} model has no NextN (MTP) layer "
                         f"(nextn_predict_layers is {spec.n_nextn}): use another drafter")
    p = params["mtp"]
    dtype = jnp.dtype(opts.dtype)
    # [R, L, h]
    e = rms_norm(embed_rows(p["embed"], tokens, dtype), p["enorm"], spec.rms_eps)
    # [R, L, h]
    h = rms_norm(hidden.astype(dtype), p["hnorm"], spec.rms_eps)
    # [R, L, h]
    x = linear(jnp.concatenate([e, h], axis=-1), p["eh_proj"], opts.backend)
    group = Group(tokens, pos, slots, all_logits=True)
    # the block's KV layer: spec.n_layers, or after the attention layers' in a hybrid model
    # (spec.kv_layer)
    (y,), cache = decoder_layer(p["layer"], spec.kv_layer(spec.n_layers), spec, opts, (group,), [x],
                                cache, kv_len, host)
    # [R, L, h]
    out = rms_norm(y, p["head_norm"], spec.rms_eps)
    if last_only:
        last = jnp.maximum(jnp.sum(pos >= 0, axis=1) - 1, 0)
        # [R, h]
        out = out[jnp.arange(out.shape[0]), last]
    # [R, L, V]
    logits = linear(out, p["head"], opts.backend).astype(jnp.float32)
    return logits, out, cache
