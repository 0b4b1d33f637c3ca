"""ModelSpec: a model's hyper-parameters, read from GGUF metadata under llama.cpp's key names.

Defaults for keys a file may leave out are llama.cpp's, so a model means here what it means there.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .errors import (
    MetadataError,
    MissingTensorError,
    TensorSizeError,
    UnsupportedArchitectureError,
)
from .mla import MLA_ARCHITECTURES, MlaSpec, check_mla, mla_fields, mla_tensor_shapes

# The hybrid Gated DeltaNet + MoE families (model/hybrid.py; engine/families.py says what the engine
# does for them).
HYBRID_ARCHITECTURES: tuple[str, ...] = ("qwen3next", "qwen35moe")
SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "qwen3", "qwen2moe", "qwen3moe",
                                            "glm4moe", *HYBRID_ARCHITECTURES,
                                            *MLA_ARCHITECTURES, "gpt-oss")
# Read and checked (ModelSpec, `strata-jax inspect`), not yet run: none today (a family on its way
# in goes here).
READ_ONLY_ARCHITECTURES: tuple[str, ...] = ()

# The three stacked expert tensors of a MoE layer, as llama.cpp names them: [experts, rows, cols]
# each.
EXPERT_TENSOR_KINDS: tuple[str, ...] = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")

# llama.cpp rotates pairs of adjacent values for llama ("norm") and the two halves of a head for
# Qwen ("neox").
_NEOX = frozenset({"qwen2", "qwen3", "qwen2moe", "qwen3moe", "glm4moe", "qwen3next", "qwen35moe",
                   "gpt-oss"})
_ATTN_BIAS = frozenset({"qwen2", "qwen2moe", "glm4moe", "gpt-oss"})
_QK_NORM = frozenset({"qwen3", "qwen3moe", "qwen3next", "qwen35moe"})
_HYBRID = frozenset(HYBRID_ARCHITECTURES)
# Whether llama.cpp renormalizes the top-k router weights when the file has no expert_weights_norm
# key (its build_moe_ffn `norm_w` argument): Mixtral-style llama and Qwen3-MoE do, Qwen2-MoE does
# not.
_EXPERT_WEIGHTS_NORM = {"llama": True, "qwen2moe": False, "qwen3moe": True, "qwen3next": True,
                        "qwen35moe": True}
_GATING = {1: "softmax", 2: "sigmoid", 3: "softmax_weight"}  # llama_expert_gating_func_type
# llama.cpp's default gating when the file has no expert_gating_func key (GLM-4.5: sigmoid).
_DEFAULT_GATING = {"glm4moe": 2}
# The norm before the FFN: GLM-4.5's converter names it post_attention_norm (HF's
# post_attention_layernorm).
_FFN_NORM = {"glm4moe": "post_attention_norm", "qwen3next": "post_attention_norm",
             "qwen35moe": "post_attention_norm", "gpt-oss": "post_attention_norm"}
# gpt-oss (llama.cpp's openai-moe.cpp): attention sinks, an output bias, sliding-window layers, a
# biased router whose top-k logits are softmaxed (its graph passes SOFTMAX_WEIGHT whatever the file
# says), and biased experts with the clamped SwiGLU (model/gpt_oss.py).
_GPT_OSS = frozenset({"gpt-oss"})
# GLM-4.5's optional per-head q/k norms (the 355B model has them): taken from the tensors, not the
# family.
_OPTIONAL_QK_NORM = frozenset({"glm4moe"})

_MISSING = object()


@dataclass(frozen=True)
class RopeScaling:
    type: str  # "linear", "yarn", "longrope", ... as the file says
    factor: float
    original_context: int | None = None
    # the other rope.scaling.* keys (yarn_beta_fast, ...), as stored
    extra: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class DeltaNetSpec:
    """The Gated DeltaNet layers of the hybrid families (qwen3next, qwen35moe): `{arch}.ssm.*`."""

    conv_kernel: int  # ssm.conv_kernel: taps of the causal depthwise conv over q, k and v
    k_heads: int  # ssm.group_count: q/k heads
    # ssm.time_step_rank: v heads (each reads q/k head v % k_heads or v // (v_heads / k_heads))
    v_heads: int
    head_dim: int  # ssm.state_size: the q/k head size (d_k)
    v_head_dim: int  # ssm.inner_size / v_heads (d_v)
    # qwen3next: beta and alpha in one matrix (ssm_ba); qwen35moe: ssm_beta and ssm_alpha
    fused_ba: bool

    @property
    def qkv_dim(self) -> int:
        """The rows of attn_qkv (and the conv's channels): q and k of every k-head, v of every
        v-head."""
        return 2 * self.k_heads * self.head_dim + self.v_heads * self.v_head_dim

    @property
    def inner(self) -> int:
        return self.v_heads * self.v_head_dim


@dataclass(frozen=True)
class ModelSpec:
    architecture: str
    n_layers: int  # block_count less the NextN (MTP) layers: the layers a token runs through
    hidden: int  # embedding_length
    ffn: int  # feed_forward_length (dense FFN width; 0 if the file has none)
    n_heads: int
    n_kv_heads: int
    head_dim: int  # attention.key_length, else hidden / n_heads
    value_dim: int  # attention.value_length, else head_dim
    rope_theta: float  # rope.freq_base
    rope_dims: int  # rope.dimension_count, else head_dim
    rope_type: str  # "norm" (llama: rotate adjacent pairs) or "neox" (Qwen: rotate the two halves)
    rope_scaling: RopeScaling | None
    rms_eps: float
    vocab_size: int  # len(tokenizer.ggml.tokens), else token_embd rows
    context_length: int  # the training context
    tied_output: bool  # no output.weight: the output projection is token_embd
    attn_bias: bool  # q/k/v biases (qwen2, qwen2moe)
    qk_norm: bool  # per-head RMS norm on q and k (qwen3, qwen3moe)
    n_experts: int = 0  # expert_count (0: a dense model)
    n_experts_used: int = 0  # expert_used_count (top-k)
    expert_ffn: int = 0  # expert_feed_forward_length
    shared_ffn: int = 0  # expert_shared_feed_forward_length (0: no shared expert)
    # a sigmoid gate on the shared expert (qwen2moe's ffn_gate_inp_shexp)
    shared_expert_gate: bool = False
    expert_weights_norm: bool = False  # renormalize the top-k router weights to sum to 1
    expert_weights_scale: float = 1.0
    expert_gating: str = "softmax"  # router scores: "softmax" or "sigmoid"
    moe_layers: tuple[int, ...] = ()  # layers whose FFN is experts
    # a per-expert bias added to the router scores for choosing only (exp_probs_b)
    expert_bias: bool = False
    # nextn_predict_layers: MTP blocks stored after the main ones, blk.{n_layers}...
    n_nextn: int = 0
    name: str = ""  # general.name
    # The hybrid families: each main layer's kind ("attention" or "deltanet"; () = every layer
    # attention), the DeltaNet layers' sizes, attention with an output gate (q's rows per head: [q |
    # gate]), and the multimodal rope sections (qwen35moe: text positions rotate as neox over
    # rope_dims).
    layer_kinds: tuple[str, ...] = ()
    deltanet: DeltaNetSpec | None = None
    attn_output_gate: bool = False
    rope_sections: tuple[int, ...] = ()
    # deepseek2: Multi-head Latent Attention's sizes (gguf/mla.py; n_kv_heads 1, head_dim kv_lora +
    # rope and value_dim kv_lora are then the latent cache's), and the router's expert groups
    # (expert_group_count: top-k only among the expert_group_used_count best groups)
    mla: MlaSpec | None = None
    expert_groups: int = 1
    expert_groups_used: int = 1
    # gpt-oss: attention.sliding_window (0: none) and the layers that use it (llama.cpp's
    # sliding_window_pattern, default 2: the even layers); a learned sink logit a head
    # (attn_sinks), biases on attn_output, the router and the experts, and the experts' clamped
    # SwiGLU ("swiglu_oai"; every other family: "swiglu").
    sliding_window: int = 0
    swa_layers: tuple[int, ...] = ()
    attn_sinks: bool = False
    expert_act: str = "swiglu"

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if i not in self.moe_layers)

    def window(self, layer: int) -> int:
        """The sliding window of `layer` (keys with q_pos - k_pos >= window masked), 0: none."""
        return self.sliding_window if layer in self.swa_layers else 0

    def kind(self, layer: int) -> str:
        """"attention" or "deltanet" (a Gated DeltaNet layer of the hybrid families)."""
        return self.layer_kinds[layer] if layer < len(self.layer_kinds) else "attention"

    @property
    def deltanet_layers(self) -> tuple[int, ...]:
        """The main layers that are Gated DeltaNet (none outside the hybrid families)."""
        return tuple(i for i in range(self.n_layers) if self.kind(i) == "deltanet")

    @property
    def cached_value_dim(self) -> int:
        """Values a token and kv head the KV cache stores: value_dim, or none for MLA, whose values
        are a view of its keys (the latent)."""
        return 0 if self.mla is not None else self.value_dim

    @property
    def ring_layers(self) -> tuple[int, ...]:
        """gpt-oss's sliding-window layers, whose keys and values live in a ring of a few positions
        past the window a slot (model/transformer.new_kv_cache's "k_swa", "v_swa"), not in the
        full-length KV."""
        return self.swa_layers if self.sliding_window else ()

    @property
    def n_kv_layers(self) -> int:
        """Layers with keys and values in the full-length KV cache: the attention ones (less
        gpt-oss's ring layers), then the NextN (MTP) ones."""
        return (self.n_layers - len(self.deltanet_layers) - len(self.ring_layers)
                + self.n_nextn)

    def kv_layer(self, layer: int) -> int:
        """Layer `layer`'s index in the KV cache (an attention layer: the attention layers before
        it), in the DeltaNet state arrays (a DeltaNet layer: the DeltaNet layers before it), or in
        the rings (gpt-oss's sliding-window layers: the ring layers before it)."""
        ring = layer in self.ring_layers
        return sum(self.kind(i) == self.kind(layer) and (i in self.ring_layers) == ring
                   for i in range(layer))

    @property
    def runnable(self) -> bool:
        """Whether strata-jax runs this family (else it is read, checked and described only)."""
        return self.architecture in SUPPORTED_ARCHITECTURES

    def check_runnable(self, path: str | Path) -> None:
        """Raise UnsupportedArchitectureError, saying what the file holds, for a family that is read
        but not run."""
        if not self.runnable:
            kinds = (f"{self.layer_kinds.count('deltanet')} Gated DeltaNet and "
                     f"{self.layer_kinds.count('attention')} attention layers, MoE")
            raise UnsupportedArchitectureError(
                path, f"architecture {self.architecture!r} ({kinds}) is read and checked, but "
                      "strata-jax does not run it yet: its forward pass is to come (issue 34); "
                      f"runnable families: {', '.join(SUPPORTED_ARCHITECTURES)}",
                "`strata-jax inspect` describes it; serve a model of a runnable family")

    @property
    def ffn_norm_tensor(self) -> str:
        """The GGUF name (after "blk.N.") of the norm before the FFN."""
        return _FFN_NORM.get(self.architecture, "ffn_norm") + ".weight"

    def expert_tensors(self, layer: int | None = None) -> list[str]:
        """Names of the stacked expert tensors ([experts, rows, cols]) of `layer`, or of every MoE
        layer."""
        layers = self.moe_layers if layer is None else (layer,) if layer in self.moe_layers else ()
        return [f"blk.{i}.{kind}.weight" for i in layers for kind in EXPERT_TENSOR_KINDS]

    def tensor_shapes(self) -> dict[str, tuple[tuple[int, ...], bool]]:
        """name -> (numpy-order shape, required) for every tensor this family reads."""
        return dict(self._iter_tensor_shapes())

    def _iter_tensor_shapes(self) -> Iterator[tuple[str, tuple[tuple[int, ...], bool]]]:
        h, q, kv, v = (self.hidden, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim,
                       self.value_dim)
        moe = frozenset(self.moe_layers)
        yield from {"token_embd.weight": ((self.vocab_size, h), True),
                    "output_norm.weight": ((h,), True),
                    "output.weight": ((self.vocab_size, h), not self.tied_output)}.items()
        # one layer at a time: a corrupt block_count must not fill memory
        for i in range(self.n_layers + self.n_nextn):
            b = f"blk.{i}."
            nextn = i >= self.n_layers  # an MTP block: a MoE decoder layer and its own few tensors
            if self.kind(i) == "deltanet":
                yield from self._deltanet_tensors(b)
            out: dict[str, tuple[tuple[int, ...], bool]] = {} if (
                self.kind(i) == "deltanet" or self.mla) else {
                b + "attn_q.weight": ((q * (2 if self.attn_output_gate else 1), h), True),
                b + "attn_k.weight": ((kv, h), True),
                b + "attn_v.weight": ((self.n_kv_heads * v, h), True),
                b + "attn_output.weight": ((h, self.n_heads * v), True),
                b + "attn_q.bias": ((q,), self.attn_bias),
                b + "attn_k.bias": ((kv,), self.attn_bias),
                b + "attn_v.bias": ((self.n_kv_heads * v,), self.attn_bias),
            }
            if self.mla:
                out |= dict(mla_tensor_shapes(self, b))
            if self.architecture in _GPT_OSS:
                out |= {b + "attn_output.bias": ((h,), True),
                        b + "attn_sinks.weight": ((self.n_heads,), True)}
            out |= {b + "attn_norm.weight": ((h,), True), b + self.ffn_norm_tensor: ((h,), True)}
            if self.qk_norm and self.kind(i) == "attention":
                out |= {b + "attn_q_norm.weight": ((self.head_dim,), True),
                        b + "attn_k_norm.weight": ((self.head_dim,), True)}
            # a file may leave out its embedding and shared head: the main model's are used then
            if nextn:
                out |= {b + "nextn.eh_proj.weight": ((h, 2 * h), True),
                        b + "nextn.enorm.weight": ((h,), True),
                        b + "nextn.hnorm.weight": ((h,), True),
                        b + "nextn.embed_tokens.weight": ((self.vocab_size, h), False),
                        b + "nextn.shared_head_head.weight": ((self.vocab_size, h), False),
                        b + "nextn.shared_head_norm.weight": ((h,), False)}
            if i in moe or (nextn and self.is_moe):
                e, f = self.n_experts, self.expert_ffn
                out |= {
                    b + "exp_probs_b.bias": ((e,), self.expert_bias),
                    b + "ffn_gate_inp.weight": ((e, h), True),
                    b + "ffn_gate_exps.weight": ((e, f, h), True),
                    b + "ffn_up_exps.weight": ((e, f, h), True),
                    b + "ffn_down_exps.weight": ((e, h, f), True),
                }
                if self.architecture in _GPT_OSS:
                    out |= {b + "ffn_gate_inp.bias": ((e,), True),
                            b + "ffn_gate_exps.bias": ((e, f), True),
                            b + "ffn_up_exps.bias": ((e, f), True),
                            b + "ffn_down_exps.bias": ((e, h), True)}
                if self.shared_ffn:
                    s = self.shared_ffn
                    out |= {
                        b + "ffn_gate_shexp.weight": ((s, h), True),
                        b + "ffn_up_shexp.weight": ((s, h), True),
                        b + "ffn_down_shexp.weight": ((h, s), True),
                        b + "ffn_gate_inp_shexp.weight": ((h,), self.shared_expert_gate),
                    }
            else:
                out |= {
                    b + "ffn_gate.weight": ((self.ffn, h), True),
                    b + "ffn_up.weight": ((self.ffn, h), True),
                    b + "ffn_down.weight": ((h, self.ffn), True),
                }
            yield from out.items()

    def _deltanet_tensors(self, b: str) -> Iterator[tuple[str, tuple[tuple[int, ...], bool]]]:
        """A Gated DeltaNet layer's mixing tensors (llama.cpp's names; ssm_a has no .weight
        suffix)."""
        d, h = self.deltanet, self.hidden
        yield from {b + "attn_qkv.weight": ((d.qkv_dim, h), True),
                    b + "attn_gate.weight": ((d.inner, h), True),
                    b + "ssm_conv1d.weight": ((d.qkv_dim, d.conv_kernel), True),
                    b + "ssm_dt.bias": ((d.v_heads,), True),
                    b + "ssm_a": ((d.v_heads,), True),
                    b + "ssm_norm.weight": ((d.v_head_dim,), True),
                    b + "ssm_out.weight": ((h, d.inner), True)}.items()
        if d.fused_ba:
            yield b + "ssm_ba.weight", ((2 * d.v_heads, h), True)
        else:
            yield from {b + "ssm_beta.weight": ((d.v_heads, h), True),
                        b + "ssm_alpha.weight": ((d.v_heads, h), True)}.items()

    def check_tensors(self, tensors: Mapping[str, tuple[tuple[int, ...], Path]],
                      path: str | Path) -> None:
        """Raise MissingTensorError / TensorSizeError unless every tensor this family needs is in
        `tensors` (name -> (shape, the file it is in)) with the shape the metadata implies."""
        for name, (shape, required) in self._iter_tensor_shapes():
            if name not in tensors:
                if required:
                    raise MissingTensorError(path, f"tensor {name!r}, which a {self.architecture} "
                                                   "model needs, is not in the file",
                                                   "The file is incomplete: re-convert it")
                continue
            got, where = tensors[name]
            if tuple(got) != shape:
                raise TensorSizeError(
                    where, f"tensor {name!r} has shape {list(got)}, but the metadata "
                           f"({self._dims()}) implies {list(shape)}",
                           "The metadata and the tensors disagree: re-convert the model")

    def _dims(self) -> str:
        dims = (f"vocab {self.vocab_size}, hidden {self.hidden}, heads "
                f"{self.n_heads}/{self.n_kv_heads}, head_dim {self.head_dim}, ffn {self.ffn}")
        if self.is_moe:
            dims += f", experts {self.n_experts}, expert_ffn {self.expert_ffn}"
        return dims

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any],
                      tensor_shapes: Mapping[str, tuple[int, ...]] | None = None,
                      path: str | Path = "<metadata>") -> ModelSpec:
        """Build the spec from GGUF metadata. `tensor_shapes` (name -> numpy-order shape) fills what
        metadata may leave out (tied output, shared expert, MoE layers, vocab size); without it the
        output is taken as untied and every layer from leading_dense_block_count on as MoE when
        there are experts."""
        arch = metadata.get("general.architecture")
        if arch is None:
            raise MetadataError(path, "no general.architecture key: this GGUF does not say what "
                                      "model it holds",
                                "Re-convert it with llama.cpp's convert_hf_to_gguf.py")
        if arch not in SUPPORTED_ARCHITECTURES and arch not in READ_ONLY_ARCHITECTURES:
            raise UnsupportedArchitectureError(
                path, f"architecture {arch!r} is not supported (supported: "
                      f"{', '.join(SUPPORTED_ARCHITECTURES)}; read and described, not yet run: "
                      f"{', '.join(READ_ONLY_ARCHITECTURES) or 'none'})",
                "Use a model of one of the supported families")
        shapes = tensor_shapes or {}
        get = _Getter(metadata, arch, path)

        n_blocks = get.int("block_count")
        n_nextn = get.int("nextn_predict_layers", 0)
        if not 0 <= n_nextn < n_blocks:
            raise MetadataError(path, f"{arch}.nextn_predict_layers is {n_nextn}, but block_count "
                                      f"is {n_blocks}",
                                "The metadata cannot be right: re-convert the model")
        n_layers = n_blocks - n_nextn  # llama.cpp stores the NextN (MTP) blocks after the main ones
        blocks = {n.split(".")[1] for n in shapes if n.startswith("blk.")}
        if shapes and n_blocks > len(blocks):
            raise MetadataError(path, f"{arch}.block_count is {n_blocks}, but the file has tensors "
                                      f"for {len(blocks)} blocks",
                                      "The metadata and the tensors disagree: re-convert the model")
        hidden = get.int("embedding_length")
        n_heads = get.int("attention.head_count")
        n_kv_heads = get.int("attention.head_count_kv", n_heads)
        head_dim = get.int("attention.key_length", hidden // n_heads if n_heads else 0)
        n_experts = get.int("expert_count", 0)
        n_experts_used = get.int("expert_used_count", 0)
        ffn = get.int("feed_forward_length", 0)
        up_exps = shapes.get("blk.0.ffn_up_exps.weight") or next(
            (s for n, s in shapes.items() if n.endswith(".ffn_up_exps.weight")), None)
        up_shexp = next((s for n, s in shapes.items() if n.endswith(".ffn_up_shexp.weight")), None)

        if n_experts:
            found = sorted(i for n in shapes if n.endswith(".ffn_gate_inp.weight")
                           and (i := int(n.split(".")[1])) < n_layers)
            moe_layers = (tuple(found)
                          or tuple(range(get.int("leading_dense_block_count", 0), n_layers)))
        else:
            moe_layers = ()
        vocab = metadata.get("tokenizer.ggml.tokens")
        if vocab is not None and not isinstance(vocab, list):
            raise MetadataError(path, f"tokenizer.ggml.tokens is a {type(vocab).__name__}, not an "
                                      "array of strings",
                                "Re-convert the model with llama.cpp's convert_hf_to_gguf.py")
        if vocab is not None:
            vocab_size = len(vocab)
        elif "token_embd.weight" in shapes:
            vocab_size = shapes["token_embd.weight"][0]
        else:
            vocab_size = get.int("vocab_size")

        spec = cls(
            architecture=arch,
            n_layers=n_layers,
            hidden=hidden,
            ffn=ffn,
            n_heads=n_heads,
            n_kv_heads=n_kv_heads,
            head_dim=head_dim,
            value_dim=get.int("attention.value_length", head_dim),
            rope_theta=get.float("rope.freq_base", 10000.0),
            rope_dims=get.int("rope.dimension_count", head_dim),
            rope_type="neox" if arch in _NEOX else "norm",
            rope_scaling=_rope_scaling(metadata, arch),
            rms_eps=get.float("attention.layer_norm_rms_epsilon", 1e-5),
            vocab_size=vocab_size,
            context_length=get.int("context_length"),
            tied_output=bool(shapes) and "output.weight" not in shapes,
            attn_bias="blk.0.attn_q.bias" in shapes if shapes else arch in _ATTN_BIAS,
            qk_norm=("blk.0.attn_q_norm.weight" in shapes) if arch in _OPTIONAL_QK_NORM
                    else arch in _QK_NORM,
            n_experts=n_experts,
            n_experts_used=n_experts_used,
            expert_ffn=get.int("expert_feed_forward_length", up_exps[1] if up_exps else ffn)
                       if n_experts else 0,
            shared_ffn=_shared_ffn(get, up_shexp) if n_experts else 0,
            shared_expert_gate=any(n.endswith(".ffn_gate_inp_shexp.weight") for n in shapes),
            expert_weights_norm=bool(get.value("expert_weights_norm",
                                               _EXPERT_WEIGHTS_NORM.get(arch, False))),
            expert_weights_scale=get.float("expert_weights_scale", 1.0),
            expert_gating=_gating(get.int("expert_gating_func", _DEFAULT_GATING.get(arch, 1)) or
                                  _DEFAULT_GATING.get(arch, 1)),
            moe_layers=moe_layers,
            # llama.cpp requires GLM-4.5's selection bias; other families have none.
            expert_bias=arch == "glm4moe" and n_experts > 0,
            n_nextn=n_nextn,
            name=str(metadata.get("general.name", "")),
            **(_hybrid_fields(metadata, get, arch, n_layers, path) if arch in _HYBRID else {}),
        )
        if arch in MLA_ARCHITECTURES:
            spec = replace(spec, **mla_fields(get, shapes, n_heads, path))
        if arch in _GPT_OSS:   # over the common keys' values: llama.cpp's graph fixes the router's
            spec = replace(spec, **_gpt_oss_fields(metadata, get, arch, n_layers, path))
        spec._validate(path)
        return spec

    def _validate(self, path: str | Path) -> None:
        def bad(problem: str) -> MetadataError:
            return MetadataError(path, problem,
                                 "The metadata cannot be right: re-convert the model")

        for field in ("n_layers", "hidden", "n_heads", "n_kv_heads", "head_dim", "vocab_size",
                      "context_length"):
            if getattr(self, field) <= 0:
                raise bad(f"{field} is {getattr(self, field)}")
        if self.n_heads % self.n_kv_heads:
            raise bad(f"attention.head_count {self.n_heads} is not a multiple of head_count_kv "
                      f"{self.n_kv_heads}")
        if self.mla:
            check_mla(self, bad)
        if self.rope_dims > self.head_dim or self.rope_dims % 2:
            raise bad(f"rope.dimension_count {self.rope_dims} must be even and at most the head "
                      f"size {self.head_dim}")
        if self.is_moe and not 0 < self.n_experts_used <= self.n_experts:
            raise bad(f"expert_used_count {self.n_experts_used} must be 1..expert_count "
                      f"({self.n_experts})")
        if self.is_moe and self.expert_ffn <= 0:
            raise bad("a MoE model without expert_feed_forward_length or expert tensors")
        if self.dense_layers and self.ffn <= 0:
            raise bad("dense FFN layers but no feed_forward_length")
        if d := self.deltanet:
            a = self.architecture
            for key, value in (("ssm.conv_kernel", d.conv_kernel), ("ssm.group_count", d.k_heads),
                               ("ssm.time_step_rank", d.v_heads), ("ssm.state_size", d.head_dim),
                               ("ssm.inner_size", d.inner)):
                if value <= 0:
                    raise bad(f"{a}.{key} is {value}")
            if d.v_heads % d.k_heads:
                raise bad(f"{a}.ssm.time_step_rank {d.v_heads} (v heads) is not a multiple of "
                          f"{a}.ssm.group_count {d.k_heads} (k heads)")
            if d.inner % d.v_heads:
                raise bad(f"{a}.ssm.inner_size {d.inner} is not a multiple of "
                          f"{a}.ssm.time_step_rank {d.v_heads}")


class _Getter:
    """Reads `{arch}.key` with llama.cpp's leniency: a per-layer array whose entries agree counts as
    one value."""

    def __init__(self, metadata: Mapping[str, Any], arch: str, path: str | Path):
        self.metadata, self.arch, self.path = metadata, arch, path

    def value(self, key: str, default: Any = _MISSING) -> Any:
        full = f"{self.arch}.{key}"
        value = self.metadata.get(full, default)
        if value is _MISSING:
            raise MetadataError(self.path, f"metadata key {full!r} is missing",
                                "Re-convert the model with a recent llama.cpp")
        if isinstance(value, list):
            if not value or any(x != value[0] for x in value):
                raise MetadataError(self.path, f"{full} has per-layer values {value[:8]}..., which "
                                               "strata-jax does not support",
                                               "Use a model with the same value in every layer")
            value = value[0]
        return value

    def int(self, key: str, default: Any = _MISSING) -> int:
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise MetadataError(self.path, f"{self.arch}.{key} is {value!r}, not an integer",
                                "Re-convert the model")
        return value

    def float(self, key: str, default: Any = _MISSING) -> float:
        value = self.value(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise MetadataError(self.path, f"{self.arch}.{key} is {value!r}, not a number",
                                "Re-convert the model")
        return float(value)


def _hybrid_fields(metadata: Mapping[str, Any], get: _Getter, arch: str, n_layers: int,
                   path) -> dict[str, Any]:
    """qwen3next / qwen35moe: the layer pattern (attention.recurrent_layers, else every
    full_attention_interval-th layer is attention, default 4, as llama.cpp reads them), the DeltaNet
    sizes (ssm.*), the output-gated attention and qwen35moe's rope sections."""
    key = f"{arch}.attention.recurrent_layers"
    recurrent = metadata.get(key)
    if recurrent is not None:
        if not isinstance(recurrent, list) or len(recurrent) < n_layers:
            raise MetadataError(path, f"{key} must be an array of a bool for each of the {n_layers}"
                                      f" layers (got {recurrent!r:.80})", "Re-convert the model")
        kinds = tuple("deltanet" if r else "attention" for r in recurrent[:n_layers])
    else:
        interval = get.int("full_attention_interval", 4)
        if interval < 1:
            raise MetadataError(path, f"{arch}.full_attention_interval is {interval}: it must be "
                                      "at least 1",
                                "Re-convert the model")
        kinds = tuple("attention" if (i + 1) % interval == 0 else "deltanet"
                      for i in range(n_layers))
    v_heads = get.int("ssm.time_step_rank")
    inner = get.int("ssm.inner_size")
    d = DeltaNetSpec(conv_kernel=get.int("ssm.conv_kernel"), k_heads=get.int("ssm.group_count"),
                     v_heads=v_heads,
                     head_dim=get.int("ssm.state_size"),
                     v_head_dim=inner // v_heads if v_heads > 0 else 0,
                     fused_ba=arch == "qwen3next")
    sections = metadata.get(f"{arch}.rope.dimension_sections")
    if arch == "qwen35moe" and sections is None:
        raise MetadataError(path, f"metadata key '{arch}.rope.dimension_sections' is missing "
                                  "(llama.cpp requires it for qwen35moe)",
                                  "Re-convert the model with a recent llama.cpp")
    return {"layer_kinds": kinds, "deltanet": d, "attn_output_gate": True,
            "rope_sections": tuple(int(x) for x in sections or ())}


def _gpt_oss_fields(metadata: Mapping[str, Any], get: _Getter, arch: str, n_layers: int,
                    path) -> dict[str, Any]:
    """gpt-oss (openai-moe.cpp): attention.sliding_window (required) and the layers it applies to:
    attention.sliding_window_pattern as an array of a bool a layer, or as a number n (default 2;
    llama.cpp's set_swa_pattern: layer i uses the window iff i % n < n - 1, n = 0 every layer, so
    with 2 the even layers, as HF's layer_types); the sinks; router scores SOFTMAX_WEIGHT (top-k of
    the logits, then a softmax over the k), with neither renormalization nor scale, as llama.cpp's
    graph fixes them."""
    window = get.int("attention.sliding_window")
    if window < 1:
        raise MetadataError(path, f"{arch}.attention.sliding_window is {window}: it must be at "
                                  "least 1", "Re-convert the model")
    key = f"{arch}.attention.sliding_window_pattern"
    pattern = metadata.get(key, 2)
    if isinstance(pattern, list):
        if len(pattern) < n_layers:
            raise MetadataError(path, f"{key} must have a bool for each of the {n_layers} layers "
                                      f"(got {pattern!r:.80})", "Re-convert the model")
        swa = tuple(i for i in range(n_layers) if pattern[i])
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        swa = tuple(i for i in range(n_layers) if pattern == 0 or i % pattern < pattern - 1)
    else:
        raise MetadataError(path, f"{key} is {pattern!r}: a layer count or a bool array",
                            "Re-convert the model")
    base_swa = metadata.get(f"{arch}.rope.freq_base_swa")
    if base_swa is not None and float(base_swa) != get.float("rope.freq_base", 10000.0):
        raise MetadataError(path, f"{arch}.rope.freq_base_swa is {base_swa}, not rope.freq_base: "
                                  "strata-jax rotates every layer at one base",
                            "Use a file without a separate sliding-window rope base")
    return {"sliding_window": window, "swa_layers": swa, "attn_sinks": True,
            "expert_act": "swiglu_oai", "expert_gating": "softmax_weight",
            "expert_weights_norm": False, "expert_weights_scale": 1.0}


def _rope_scaling(metadata: Mapping[str, Any], arch: str) -> RopeScaling | None:
    prefix = f"{arch}.rope.scaling."
    kind = metadata.get(prefix + "type")
    factor = metadata.get(prefix + "factor")
    # older files
    if kind is None and (linear := metadata.get(f"{arch}.rope.scale_linear")) is not None:
        kind, factor = "linear", linear
    if kind in (None, "none") or factor in (None, 0, 1.0) and kind == "linear":
        return None
    skip = {"type", "factor", "original_context_length"}
    extra = tuple(sorted((k[len(prefix):], v) for k, v in metadata.items() if k.startswith(prefix)
                         and k[len(prefix):] not in skip))
    return RopeScaling(type=str(kind), factor=float(factor if factor is not None else 1.0),
                       original_context=metadata.get(prefix + "original_context_length"),
                       extra=extra)


def _shared_ffn(get: _Getter, up_shexp: tuple[int, ...] | None) -> int:
    """The shared expert's width: expert_shared_feed_forward_length, else (GLM-4.5, as llama.cpp
    reads it) expert_shared_count x expert_feed_forward_length, else the tensor's shape."""
    width = get.int("expert_shared_feed_forward_length", 0)
    if not width and (count := get.int("expert_shared_count", 0)):
        width = count * get.int("expert_feed_forward_length", 0)
    return width or (up_shexp[0] if up_shexp else 0)


def _gating(number: int) -> str:
    return _GATING.get(number, f"unknown gating function {number}")
