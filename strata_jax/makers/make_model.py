"""Synthetic GGUF models with random weights, for tests and benchmarks (`strata-jax make-model`).

    paths = make_model(tmp / "tiny.gguf", arch="qwen3moe", experts=8, quant="Q4_K", split=3)

Tensor names, shapes and metadata keys are llama.cpp's (gguf-py's MODEL_TENSORS / TENSOR_NAMES /
Keys), so llama.cpp and Hugging Face transformers read the files too. Weights are random quant
blocks with sane scales (`pallas_kernels.random_blocks`), std 1/sqrt(fan_in) so activations and
logits stay O(1); norms are F32 ones plus a little noise, and routers F32 as llama.cpp's quantizer
leaves them. Tensors are written one at a time, so a model larger than RAM can be made. `split=N`
writes N parts in llama.cpp's gguf-split layout (OUT-00001-of-0000N.gguf ..., metadata in part 1,
split.no/count/tensors.count in each). `shape=` starts from a real model's sizes (makers/shapes.py);
tensors of 32 MiB or more take the fast generator (random_blocks_fast), a progress callback hears
each tensor written, and the free disk is checked before the first byte.
"""

from __future__ import annotations

import logging
import math
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType, LlamaFileType

from pallas_kernels.random_blocks import random_blocks, random_blocks_fast
from quant_types import QType, as_qtype, block_size, type_size
from strata_jax.gguf.header import ValueType
from strata_jax.gguf.spec import READ_ONLY_ARCHITECTURES, SUPPORTED_ARCHITECTURES
from strata_jax.gguf.writer import AlignedWriter

from .deepseek2 import (
    DEEPSEEK_DEFAULTS,
    deepseek2_keys,
    deepseek2_layer_tensors,
    deepseek2_resolved,
)
from .family_chat import family_chat_metadata
from .gpt_oss import (
    DEFAULT_EXPERT_QUANT,
    DEFAULT_SLIDING_WINDOW,
    GPT_OSS,
    gpt_oss_keys,
    gpt_oss_layer_tensors,
)
from .hybrid import HYBRID_ARCHS, hybrid_keys, hybrid_layer_tensors
from .shapes import with_shape
from .tiny_tokenizer import tiny_tokenizer

log = logging.getLogger(__name__)

MOE_ARCHS = ("qwen2moe", "qwen3moe", "glm4moe", *HYBRID_ARCHS, "deepseek2", GPT_OSS)
ARCHS = (*SUPPORTED_ARCHITECTURES, *READ_ONLY_ARCHITECTURES)
GLM_ONLY = ("leading_dense", "nextn", "nextn_head", "qk_norm", "rope_dims", "expert_weights_scale")
# of GLM_ONLY, the flags the hybrid families take as well
HYBRID_TOO = ("rope_dims", "nextn", "nextn_head")
DENSE_ONLY_ARCHS = ("qwen2", "qwen3")
# a weight this large is made by random_blocks_fast (only realistic shapes have such tensors: the
# tests' tiny models keep random_blocks' stream)
FAST_BYTES = 32 << 20
_PRE_TOKENIZER = {"llama": "llama-bpe"}  # the qwen families: "qwen2"
# the family's own chat template and special tokens on the built-in tokenizer (family_chat.py).
# deepseek2: V3.1's template, that of the newest deepseek2 model (V3, R1 and V3.1 share the
# architecture and the NextN block; V3.1 is one model that thinks or not by its template's
# `thinking` switch, and calls tools as NAME<｜tool▁sep｜>{...}). R1's: --chat-template deepseek-r1.
# gpt-oss: harmony's marks and its template, as a real gpt-oss file carries them.
_FAMILY_CHAT = {"deepseek2": "deepseek-v3.1", "gpt-oss": "gpt-oss"}


@dataclass(frozen=True)
class ModelOptions:
    """make_model's options; the CLI flags are these names with dashes."""

    arch: str = "qwen3moe"
    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    head_dim: int | None = None  # default hidden // heads
    ffn: int = 128  # dense FFN width (qwen3moe and qwen2moe write it too, as their files do)
    # default 8 for qwen2moe/qwen3moe, 0 for llama (>0: Mixtral-style MoE)
    experts: int | None = None
    experts_used: int = 2
    expert_ffn: int = 32
    # qwen2moe's shared expert; glm4moe's: a multiple of expert_ffn (expert_shared_count)
    shared_ffn: int = 64
    vocab: int | None = None  # default 512, or the size of --tokenizer-from's vocabulary
    context: int = 2048
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    quant: str = "Q8_0"  # every weight matrix, unless one of the three below says otherwise
    expert_quant: str | None = None
    attn_quant: str | None = None
    embed_quant: str | None = None  # token_embd and output
    # As llama.cpp's Q4_K_M mix: the ffn_down (dense, shared and experts) and attn_v tensors of the
    # layers it gives more bits (llama.cpp's use_more_bits(i, n): i < n/8, i >= 7n/8, or (i - n/8) %
    # 3 == 2, over the file's blocks) use this type instead (e.g. quant Q4_K, more_bits_quant Q6_K);
    # None: no such layers.
    more_bits_quant: str | None = None
    tied: bool = False  # no output.weight: the output projection is token_embd
    seed: int = 0
    # 0: every router row the same scale (uniform popularity). > 0: expert i's router row (in a
    # random order a layer) scaled by (rank+1)^-skew, so those experts' logits spread wider and win
    # the top-k more often, token by token (0.5: the hottest tenth of the experts get ~40% of the
    # routings). Neither is a real model's routing.
    router_skew: float = 0.0
    split: int = 1
    tokenizer_from: str | Path | None = None
    name: str | None = None
    # GLM-4.5 (glm4moe) only:
    leading_dense: int | None = None  # dense-FFN layers before the MoE ones (default 1)
    nextn: int = 0  # NextN (MTP) layers after the main ones: blk.{layers}.* with blk.N.nextn.*
    # the NextN layer's own embed_tokens and shared_head_head (else it shares the main ones)
    nextn_head: bool = False
    qk_norm: bool = False  # per-head q/k norms (GLM-4.5 355B has them)
    # rotated dims a head (default half the head, as GLM-4.5's partial_rotary_factor)
    rope_dims: int | None = None
    expert_weights_scale: float | None = None  # routed_scaling_factor (default 2.5, as GLM-4.5)
    # qwen3next / qwen35moe only (makers/hybrid.py): the Gated DeltaNet layers' sizes and the layer
    # pattern
    ssm_conv: int = 4  # ssm.conv_kernel: the causal conv's taps
    ssm_k_heads: int = 2  # ssm.group_count: q/k heads
    ssm_v_heads: int = 4  # ssm.time_step_rank: v heads (a multiple of the k heads)
    ssm_head_dim: int = 16  # ssm.state_size: the q/k and v head size
    full_attention_interval: int = 4  # every this-many-th layer is full attention
    # deepseek2 only (makers/deepseek2.py; None: its tiny defaults, DEEPSEEK_DEFAULTS): MLA's
    # sizes (q_lora 0: a Lite-style attn_q), the router's expert groups, and the legacy attn_kv_b in
    # place of attn_k_b / attn_v_b (yarn_factor, below, is read by deepseek2 too)
    q_lora: int | None = None
    kv_lora: int | None = None
    nope_dim: int | None = None
    v_head_dim: int | None = None
    expert_groups: int | None = None
    expert_groups_used: int | None = None
    legacy_kv_b: bool = False
    # gpt-oss only (makers/gpt_oss.py): attention.sliding_window (default 8), and YaRN rope keys
    # when yarn_factor is given (0 or None: plain rope; deepseek2 reads it too)
    sliding_window: int | None = None
    yarn_factor: float | None = None
    yarn_original_context: int = 4096

    def resolved(self) -> ModelOptions:
        """Defaults filled in and every value checked (ValueError saying which and why)."""
        if self.arch not in ARCHS:
            raise ValueError(f"--arch {self.arch!r} is not one of {', '.join(ARCHS)}")
        experts = self.experts if self.experts is not None else (8 if self.arch in MOE_ARCHS else 0)
        if self.arch in DENSE_ONLY_ARCHS and experts:
            raise ValueError(f"{self.arch} is a dense family; for experts use --arch "
                             f"{self.arch}moe")
        if self.arch in MOE_ARCHS and experts < 2:
            raise ValueError(f"{self.arch} needs --experts of at least 2 (got {experts})")
        if experts and not 1 <= self.experts_used <= experts:
            raise ValueError(f"--experts-used must be 1..{experts} (got {self.experts_used})")
        if not 0.0 <= self.router_skew <= 4.0:
            raise ValueError(f"--router-skew must be 0 (uniform) to 4 (got {self.router_skew})")
        for flag in ("layers", "hidden", "heads", "kv_heads", "ffn", "expert_ffn", "shared_ffn",
                     "context", "split"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be at least 1 (got "
                                 f"{getattr(self, flag)})")
        if self.heads % self.kv_heads:
            raise ValueError(f"--heads {self.heads} must be a multiple of --kv-heads "
                             f"{self.kv_heads}")
        head_dim = self.head_dim
        if head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(f"--hidden {self.hidden} is not a multiple of --heads "
                                 f"{self.heads}: give --head-dim")
            head_dim = self.hidden // self.heads
        if head_dim % 2:
            raise ValueError(f"the head size must be even for rotary embeddings (got {head_dim})")
        for q in (self.quant, self.expert_quant, self.attn_quant, self.embed_quant,
                  self.more_bits_quant):
            if q is not None:
                as_qtype(q)  # raises UnsupportedQuantType listing the supported ones
        if self.arch == "deepseek2":
            return deepseek2_resolved(self, experts)
        # yarn_factor: gpt-oss writes YaRN keys too
        for flag in (*(f for f in DEEPSEEK_DEFAULTS if f != "yarn_factor"), "legacy_kv_b"):
            if getattr(self, flag) not in (None, False):
                raise ValueError(f"--{flag.replace('_', '-')} is for --arch deepseek2 (got --arch "
                                 f"{self.arch})")
        if self.arch in HYBRID_ARCHS:
            return self._hybrid(experts, head_dim)
        if self.arch != GPT_OSS and (self.sliding_window is not None or self.yarn_factor):
            raise ValueError(f"--sliding-window is for --arch gpt-oss, --yarn-factor for gpt-oss "
                             f"and deepseek2 (got --arch {self.arch})")
        if self.arch == GPT_OSS:
            window = DEFAULT_SLIDING_WINDOW if self.sliding_window is None else self.sliding_window
            if window < 1 or (self.yarn_factor or 0) < 0:
                raise ValueError(f"--sliding-window must be at least 1 (got {window}) and "
                                 f"--yarn-factor 0 or more (got {self.yarn_factor})")
            for flag in GLM_ONLY:
                if getattr(self, flag) not in (None, 0, False):
                    raise ValueError(f"--{flag.replace('_', '-')} is for --arch glm4moe (got "
                                     f"--arch {self.arch})")
            return replace(self, experts=experts, head_dim=head_dim, leading_dense=0,
                           rope_dims=head_dim, expert_weights_scale=1.0, sliding_window=window,
                           expert_quant=self.expert_quant or DEFAULT_EXPERT_QUANT)
        if self.arch != "glm4moe":
            for flag in GLM_ONLY:
                if getattr(self, flag) not in (None, 0, False):
                    raise ValueError(f"--{flag.replace('_', '-')} is for --arch glm4moe (got "
                                     f"--arch {self.arch})")
            return replace(self, experts=experts, head_dim=head_dim, leading_dense=0,
                           rope_dims=head_dim, expert_weights_scale=1.0)
        leading = 1 if self.leading_dense is None else self.leading_dense
        if not 0 <= leading < self.layers:
            raise ValueError(f"--leading-dense must be 0..{self.layers - 1} (--layers "
                             f"{self.layers}; got {leading})")
        if self.nextn < 0:
            raise ValueError(f"--nextn must be 0 or more (got {self.nextn})")
        if self.nextn_head and not self.nextn:
            raise ValueError("--nextn-head needs --nextn 1 or more")
        if self.shared_ffn % self.expert_ffn:
            raise ValueError("glm4moe's shared expert is expert_shared_count experts wide: "
                             f"--shared-ffn {self.shared_ffn} must be a multiple of --expert-ffn "
                             f"{self.expert_ffn}")
        rope_dims = head_dim // 2 if self.rope_dims is None else self.rope_dims
        if not 0 < rope_dims <= head_dim or rope_dims % 2:
            raise ValueError(f"--rope-dims must be even and 2..{head_dim} (the head size; got "
                             f"{rope_dims})")
        scale = 2.5 if self.expert_weights_scale is None else self.expert_weights_scale
        return replace(self, experts=experts, head_dim=head_dim, leading_dense=leading,
                       rope_dims=rope_dims, expert_weights_scale=scale)


    def _hybrid(self, experts: int, head_dim: int) -> ModelOptions:
        for flag in GLM_ONLY:
            if flag not in HYBRID_TOO and getattr(self, flag) not in (None, 0, False):
                raise ValueError(f"--{flag.replace('_', '-')} is for --arch glm4moe (got --arch "
                                 f"{self.arch})")
        # llama.cpp's qwen3next / qwen35moe graphs run one MTP block
        if self.nextn not in (0, 1):
            raise ValueError(f"--nextn must be 0 or 1 for {self.arch} (got {self.nextn})")
        if self.nextn_head and not self.nextn:
            raise ValueError("--nextn-head needs --nextn 1")
        for flag in ("ssm_conv", "ssm_k_heads", "ssm_v_heads", "ssm_head_dim",
                     "full_attention_interval"):
            if getattr(self, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be at least 1 (got "
                                 f"{getattr(self, flag)})")
        if self.ssm_v_heads % self.ssm_k_heads:
            raise ValueError(f"--ssm-v-heads {self.ssm_v_heads} must be a multiple of "
                             f"--ssm-k-heads {self.ssm_k_heads}")
        # partial_rotary_factor 0.25
        rope_dims = max(2, head_dim // 4) if self.rope_dims is None else self.rope_dims
        if not 0 < rope_dims <= head_dim or rope_dims % 2:
            raise ValueError(f"--rope-dims must be even and 2..{head_dim} (the head size; got "
                             f"{rope_dims})")
        return replace(self, experts=experts, head_dim=head_dim, leading_dense=0,
                       rope_dims=rope_dims, expert_weights_scale=1.0)


Progress = Callable[[int, int], None]     # (bytes of tensor data written, of all of it)


def make_model(out_path: str | Path, shape: str | None = None, progress: Progress | None = None,
               **options: Any) -> list[Path]:
    """Write a random-weight GGUF model; return the files written (one, or `split` parts in order).
    Options are `ModelOptions`' fields, over a real model's (`shape`: makers/shapes.py)."""
    o = ModelOptions(**with_shape(shape, options)).resolved()
    tokenizer_keys = _tokenizer_keys(o)
    vocab = len(tokenizer_keys["tokenizer.ggml.tokens"][0])
    plan = _plan_tensors(o, vocab)
    if not 1 <= o.split <= len(plan):
        raise ValueError(f"--split {o.split}: the model has {len(plan)} tensors, so 1..{len(plan)} "
                         "parts")
    _report_fallbacks(plan)

    out_path = Path(out_path)
    total = sum(t.n_bytes for t in plan)
    _check_free_disk(out_path, total)
    writer = AlignedWriter(out_path, o.arch)
    for key, (value, (vtype, sub)) in (_model_keys(o, vocab) | tokenizer_keys).items():
        writer.add_key_value(key, value, vtype, sub)
    # first tensor of parts 2..N
    starts = {round(i * len(plan) / o.split) for i in range(1, o.split)}
    for i, t in enumerate(plan):
        # GGUFWriter starts a new part when the current one holds split_max_tensors tensors.
        writer.split_max_tensors = 1 if i in starts else (len(plan) if o.split > 1 else 0)
        writer.add_tensor_info(t.name, t.byte_shape, np.dtype(np.uint8), t.n_bytes,
                               raw_dtype=t.qtype)
    paths = writer.format_shard_names(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file(out_path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    done = 0
    for t in plan:
        # independent of the other tensors
        rng = np.random.default_rng([o.seed, zlib.crc32(t.name.encode())])
        writer.write_tensor_data(t.make(rng))
        done += t.n_bytes
        if progress is not None:
            progress(done, total)
    writer.close()
    return paths


def model_bytes(shape: str | None = None, **options: Any) -> int:
    """The tensor data make_model would write for these options (the header adds a few MB at
    most: the vocabulary)."""
    o = ModelOptions(**with_shape(shape, options)).resolved()
    vocab = len(_tokenizer_keys(o)["tokenizer.ggml.tokens"][0])
    return sum(t.n_bytes for t in _plan_tensors(o, vocab))


def _check_free_disk(out_path: Path, needed: int) -> None:
    """ValueError with both figures when the folder cannot hold the model (with 1% and 64 MiB to
    spare: the header, and the file system's own)."""
    folder = out_path.absolute().parent
    while not folder.exists():                  # it is made later: its nearest existing ancestor
        folder = folder.parent
    free = shutil.disk_usage(folder).free
    if needed * 1.01 + (64 << 20) > free:
        raise ValueError(f"the model needs {needed / 2**30:.2f} GiB of disk and {folder} has "
                         f"{free / 2**30:.2f} GiB free: free some, pick a smaller shape or "
                         "quant, or write it elsewhere")


@dataclass(frozen=True)
class _Planned:
    name: str
    shape: tuple[int, ...]  # numpy order
    qtype: QType
    make: Callable[[np.random.Generator], np.ndarray]  # -> uint8 [..., row_bytes]
    wanted: QType  # the type asked for, before any fallback

    @property
    def byte_shape(self) -> tuple[int, ...]:
        return (*self.shape[:-1], self.shape[-1] // block_size(self.qtype) * type_size(self.qtype))

    @property
    def n_bytes(self) -> int:
        return math.prod(self.byte_shape)


def _plan_tensors(o: ModelOptions, vocab: int) -> list[_Planned]:
    h, hd = o.hidden, o.head_dim
    q, kv = o.heads * hd, o.kv_heads * hd
    quant = as_qtype(o.quant)
    embed_q = as_qtype(o.embed_quant or quant)
    attn_q = as_qtype(o.attn_quant or quant)
    expert_q = as_qtype(o.expert_quant or quant)
    # keeps the residual stream O(1) however deep the model
    residual = 1.0 / math.sqrt(2 * o.layers)
    n_blocks = o.layers + o.nextn

    def weight(name: str, shape: tuple[int, ...], qtype: QType, std: float) -> _Planned:
        fitted = qtype if shape[-1] % block_size(qtype) == 0 else _fallback(qtype)
        n_bytes = math.prod(shape) // block_size(fitted) * type_size(fitted)
        blocks = random_blocks_fast if n_bytes >= FAST_BYTES else random_blocks
        return _Planned(name, shape, fitted,
                        lambda rng: blocks(fitted, shape, rng, std=std), qtype)

    def f32(name: str, shape: tuple[int, ...], mean: float, std: float) -> _Planned:
        def make(rng: np.random.Generator) -> np.ndarray:
            w = (mean + std * rng.standard_normal(shape)).astype(np.float32)
            if o.router_skew and name.endswith("ffn_gate_inp.weight"):   # a MoE layer's router
                w *= router_row_scales(shape[0], o.router_skew, rng)[:, None]
            return w.view(np.uint8)
        return _Planned(name, shape, QType.F32, make, QType.F32)

    def norm(name: str, shape: tuple[int, ...]) -> _Planned:
        return f32(name, shape, 1.0, 0.05)

    glm = o.arch == "glm4moe"
    plan = [weight("token_embd.weight", (vocab, h), embed_q, 1 / math.sqrt(h))]
    for i in range(o.layers + o.nextn):  # GLM-4.5's NextN (MTP) blocks come after the main ones
        b = f"blk.{i}."
        if o.arch in HYBRID_ARCHS:
            plan += hybrid_layer_tensors(b, i, o, weight, f32, norm, quant, attn_q, expert_q)
            if i >= o.layers:   # the MTP block: a gated-attention MoE block and the NextN tensors
                plan += _nextn_tensors(b, o, vocab, quant, embed_q, weight, norm)
            continue
        if o.arch == "deepseek2":
            plan += deepseek2_layer_tensors(b, i, o, weight, f32, norm, quant, attn_q, expert_q)
            if i >= o.layers:   # the MTP block: an MLA MoE block and the NextN tensors
                plan += _nextn_tensors(b, o, vocab, quant, embed_q, weight, norm)
            continue
        if o.arch == GPT_OSS:
            plan += gpt_oss_layer_tensors(b, o, weight, f32, norm, attn_q, expert_q)
            continue
        more = (as_qtype(o.more_bits_quant) if o.more_bits_quant and use_more_bits(i, n_blocks)
                else None)
        plan += [norm(b + "attn_norm.weight", (h,)),
                 weight(b + "attn_q.weight", (q, h), attn_q, 1 / math.sqrt(h)),
                 weight(b + "attn_k.weight", (kv, h), attn_q, 1 / math.sqrt(h)),
                 weight(b + "attn_v.weight", (kv, h), more or attn_q, 1 / math.sqrt(h))]
        if o.arch in ("qwen2", "qwen2moe", "glm4moe"):
            plan += [f32(b + "attn_q.bias", (q,), 0.0, 0.1),
                     f32(b + "attn_k.bias", (kv,), 0.0, 0.1),
                     f32(b + "attn_v.bias", (kv,), 0.0, 0.1)]
        if o.arch in ("qwen3", "qwen3moe") or o.qk_norm:
            plan += [norm(b + "attn_q_norm.weight", (hd,)), norm(b + "attn_k_norm.weight", (hd,))]
        plan += [weight(b + "attn_output.weight", (h, q), attn_q, residual / math.sqrt(q)),
                 norm(b + ("post_attention_norm.weight" if glm else "ffn_norm.weight"), (h,))]
        if i >= o.layers:
            plan += _nextn_tensors(b, o, vocab, quant, embed_q, weight, norm)
        if o.experts and i >= o.leading_dense:
            e, f = o.experts, o.expert_ffn
            plan += [f32(b + "ffn_gate_inp.weight", (e, h), 0.0, 1 / math.sqrt(h)),
                     weight(b + "ffn_gate_exps.weight", (e, f, h), expert_q, 1 / math.sqrt(h)),
                     weight(b + "ffn_up_exps.weight", (e, f, h), expert_q, 1 / math.sqrt(h)),
                     weight(b + "ffn_down_exps.weight", (e, h, f), more or expert_q,
                            residual / math.sqrt(f))]
            # the choosing bias: large enough against the sigmoid scores' gaps to change some
            # choices
            if glm:
                plan.append(f32(b + "exp_probs_b.bias", (e,), 0.0, 0.05))
            if o.arch in ("qwen2moe", "glm4moe"):
                s = o.shared_ffn
                if not glm:  # qwen2moe gates its shared expert, GLM-4.5 does not
                    plan.append(f32(b + "ffn_gate_inp_shexp.weight", (h,), 0.0, 1 / math.sqrt(h)))
                plan += [weight(b + "ffn_gate_shexp.weight", (s, h), quant, 1 / math.sqrt(h)),
                         weight(b + "ffn_up_shexp.weight", (s, h), quant, 1 / math.sqrt(h)),
                         weight(b + "ffn_down_shexp.weight", (h, s), more or quant,
                                residual / math.sqrt(s))]
        else:
            plan += [weight(b + "ffn_gate.weight", (o.ffn, h), quant, 1 / math.sqrt(h)),
                     weight(b + "ffn_up.weight", (o.ffn, h), quant, 1 / math.sqrt(h)),
                     weight(b + "ffn_down.weight", (h, o.ffn), more or quant,
                            residual / math.sqrt(o.ffn))]
    plan.append(norm("output_norm.weight", (h,)))
    if not o.tied:
        plan.append(weight("output.weight", (vocab, h), embed_q, 1 / math.sqrt(h)))
    return plan


def router_row_scales(n_experts: int, skew: float, rng: np.random.Generator) -> np.ndarray:
    """float32 [n_experts]: (rank+1)^-skew in a random order, scaled to a mean square of 1 (so
    the logits' overall spread stays what a uniform router's is)."""
    s = (np.arange(n_experts) + 1.0) ** -skew
    s /= np.sqrt(np.mean(s * s))
    return rng.permutation(s).astype(np.float32)


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's rule (src/llama-quant.cpp) for the layers whose attn_v and ffn_down Q4_K_M makes
    Q6_K: the first and last eighth of the layers, and every third one between."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def _nextn_tensors(b: str, o: ModelOptions, vocab: int, quant: QType, embed_q: QType, weight,
                   norm) -> list[_Planned]:
    """A NextN (MTP) block's own tensors, llama.cpp's names and shapes (eh_proj: GGUF {2h, h})."""
    h = o.hidden
    plan = [weight(b + "nextn.eh_proj.weight", (h, 2 * h), quant, 1 / math.sqrt(2 * h)),
            norm(b + "nextn.enorm.weight", (h,)), norm(b + "nextn.hnorm.weight", (h,)),
            norm(b + "nextn.shared_head_norm.weight", (h,))]
    if o.nextn_head:
        plan += [weight(b + "nextn.embed_tokens.weight", (vocab, h), embed_q, 1 / math.sqrt(h)),
                 weight(b + "nextn.shared_head_head.weight", (vocab, h), embed_q, 1 / math.sqrt(h))]
    return plan


def _fallback(qtype: QType) -> QType:
    return QType.F32 if qtype == QType.F32 else QType.F16


def _report_fallbacks(plan: list[_Planned]) -> None:
    groups: dict[tuple[QType, QType, int], list[str]] = {}
    for t in plan:
        if t.qtype != t.wanted:
            groups.setdefault((t.wanted, t.qtype, t.shape[-1]), []).append(t.name)
    for (wanted, used, row), names in groups.items():
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        log.warning("%d tensor(s) stored as %s instead of %s: their rows of %d values are not a "
                    "whole number of %s blocks of %d (%s)", len(names), used.name, wanted.name, row,
                    wanted.name, block_size(wanted), shown)


def _model_keys(o: ModelOptions, vocab: int) -> dict[str, tuple[Any, ValueType]]:
    u32, f32, s = ((GGUFValueType.UINT32, None), (GGUFValueType.FLOAT32, None),
                   (GGUFValueType.STRING, None))
    a = o.arch
    mixtral = a == "llama" and o.experts > 0
    keys: dict[str, tuple[Any, ValueType]] = {
        "general.type": ("model", s),
        "general.name": (o.name or f"strata-jax random {a}", s),
        "general.quantization_version": (2, u32),
        f"{a}.vocab_size": (vocab, u32),
        f"{a}.context_length": (o.context, u32),
        f"{a}.embedding_length": (o.hidden, u32),
        f"{a}.block_count": (o.layers + o.nextn, u32),
        # Mixtral's files give the expert width here and have no expert_feed_forward_length.
        f"{a}.feed_forward_length": (o.expert_ffn if mixtral else o.ffn, u32),
        f"{a}.attention.head_count": (o.heads, u32),
        f"{a}.attention.head_count_kv": (o.kv_heads, u32),
        f"{a}.attention.key_length": (o.head_dim, u32),
        f"{a}.attention.value_length": (o.head_dim, u32),
        f"{a}.attention.layer_norm_rms_epsilon": (o.rms_eps, f32),
        f"{a}.rope.freq_base": (o.rope_theta, f32),
        f"{a}.rope.dimension_count": (o.rope_dims, u32),
    }
    file_type = {QType.F32: "ALL_F32",
                 QType.F16: "MOSTLY_F16"}.get(as_qtype(o.quant), f"MOSTLY_{as_qtype(o.quant).name}")
    if file_type in LlamaFileType.__members__:
        keys["general.file_type"] = (int(LlamaFileType[file_type]), u32)
    if o.experts:
        keys[f"{a}.expert_count"] = (o.experts, u32)
        keys[f"{a}.expert_used_count"] = (o.experts_used, u32)
        if not mixtral:
            keys[f"{a}.expert_feed_forward_length"] = (o.expert_ffn, u32)
        if a == "qwen2moe":
            keys[f"{a}.expert_shared_feed_forward_length"] = (o.shared_ffn, u32)
    if a == GPT_OSS:
        keys |= gpt_oss_keys(o)
    if a in HYBRID_ARCHS:
        keys |= hybrid_keys(o)
        if o.nextn:
            keys[f"{a}.nextn_predict_layers"] = (o.nextn, u32)
    if a == "deepseek2":
        keys |= deepseek2_keys(o)
    if a == "glm4moe":  # as convert_hf_to_gguf.py's Glm4MoeModel writes them
        keys |= {f"{a}.expert_shared_count": (o.shared_ffn // o.expert_ffn, u32),
                 f"{a}.leading_dense_block_count": (o.leading_dense, u32),
                 f"{a}.expert_gating_func": (2, u32),  # sigmoid
                 f"{a}.expert_weights_scale": (o.expert_weights_scale, f32),
                 f"{a}.expert_weights_norm": (True, (GGUFValueType.BOOL, None))}
        if o.nextn:
            keys[f"{a}.nextn_predict_layers"] = (o.nextn, u32)
    return keys


def _tokenizer_keys(o: ModelOptions) -> dict[str, tuple[Any, ValueType]]:
    if o.tokenizer_from is None:
        keys = tiny_tokenizer(o.vocab or 512).metadata(_PRE_TOKENIZER.get(o.arch, "qwen2"))
        if o.arch in _FAMILY_CHAT:
            plain = {k: v for k, (v, _) in keys.items()}
            chat = family_chat_metadata(plain, _FAMILY_CHAT[o.arch])
            keys |= {k: (v, keys[k][1]) for k, v in chat.items()}
        return keys
    from strata_jax.gguf import GGUFModel

    src = GGUFModel.open(o.tokenizer_from, strict=False)
    keys = {k: (v, src.metadata_types[k]) for k, v in src.metadata.items()
               if k.startswith("tokenizer.")}
    if "tokenizer.ggml.tokens" not in keys:
        raise ValueError(f"--tokenizer-from {o.tokenizer_from}: that GGUF has no "
                         "tokenizer.ggml.tokens")
    n = len(keys["tokenizer.ggml.tokens"][0])
    if o.vocab is not None and o.vocab != n:
        raise ValueError(f"--vocab {o.vocab} disagrees with --tokenizer-from {o.tokenizer_from}, "
                         f"whose vocabulary has {n} tokens: leave --vocab out")
    return keys

