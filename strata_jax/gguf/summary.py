"""What `strata-jax inspect` reports: parameters, tensor types, expert sizes, and whether they fit a
device.

Figures come from the tensor directory alone (names, shapes, types), so any GGUF can be described,
even one of an architecture or quant type strata-jax cannot run (that is then said, not raised).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from quant_types import SUPPORTED

from .errors import GGUFError
from .reader import GGUFModel
from .spec import EXPERT_TENSOR_KINDS

GIB = 1 << 30


@dataclass(frozen=True)
class TypeRow:
    qtype: str
    tensors: int
    params: int
    bytes: int
    supported: bool


@dataclass(frozen=True)
class BudgetFit:
    budget_bytes: int
    dense_bytes: int  # every tensor that is not an expert's
    expert_bytes: int
    experts_fit: bool  # all experts fit the budget by themselves
    all_fit: bool  # dense weights and all experts together fit
    # experts that fit in what the dense weights leave (by their mean size)
    experts_after_dense: int
    n_experts_total: int


@dataclass(frozen=True)
class ModelSummary:
    paths: list[str]
    architecture: str | None
    name: str
    file_bytes: int
    tensor_bytes: int
    n_tensors: int
    params: int
    active_params: int  # per token: dense parameters plus experts_used of each MoE layer's experts
    types: list[TypeRow]
    n_experts: int
    n_experts_used: int
    moe_layers: list[int]
    # layer -> bytes of ONE expert (its gate, up and down rows)
    expert_bytes_per_layer: dict[int, int]
    expert_bytes: int  # all experts of all layers
    dense_bytes: int
    shape: str  # one line of hyper-parameters, or why there is no ModelSpec
    runnable: bool
    # the hybrid families: each layer's kind (D: Gated DeltaNet, A: attention) and sizes
    layers: str = ""
    not_run: str = ""  # a family read and checked but not run: why
    budget: BudgetFit | None = field(default=None)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(model: GGUFModel, device_budget_gib: float | None = None) -> ModelSummary:
    rows: dict[str, list[int]] = {}
    expert_layers: dict[int, int] = {}
    expert_bytes = expert_params = active_expert_params = 0
    n_experts_used = int(model.metadata.get(f"{model.architecture}.expert_used_count", 0) or 0)
    n_experts = 0
    for name, t in model.tensors.items():
        row = rows.setdefault(t.qtype.name, [0, 0, 0])
        row[0] += 1
        row[1] += t.n_values
        row[2] += t.n_bytes
        parts = name.split(".")
        if (len(parts) == 4 and parts[0] == "blk" and parts[2] in EXPERT_TENSOR_KINDS
                and len(t.shape) == 3):
            n_experts = max(n_experts, t.shape[0])
            layer = int(parts[1])
            expert_layers[layer] = expert_layers.get(layer, 0) + t.n_bytes // t.shape[0]
            expert_bytes += t.n_bytes
            expert_params += t.n_values
            active_expert_params += (t.n_values // t.shape[0]
                                     * min(n_experts_used or t.shape[0], t.shape[0]))
    params = sum(r[1] for r in rows.values())
    tensor_bytes = model.n_bytes
    try:
        spec = model.spec
        shape = (f"{spec.n_layers} layers, hidden {spec.hidden}, heads {spec.n_heads} (kv "
                 f"{spec.n_kv_heads}) x {spec.head_dim}, ffn {spec.ffn}, vocab {spec.vocab_size}, "
                 f"context {spec.context_length}"
                 + (f", {spec.n_experts} experts (top {spec.n_experts_used}) x ffn "
                    f"{spec.expert_ffn}"
                    if spec.is_moe else "")
                 + (f", shared expert ffn {spec.shared_ffn}" if spec.shared_ffn else "")
                 + (", tied output" if spec.tied_output else "")
                 + (f"; MLA: q_lora {m.q_lora}, kv_lora {m.kv_lora}, nope {m.nope}, rope "
                    f"{m.rope}, v {m.v_head} a head (cached: kv {spec.n_kv_heads} x "
                    f"{spec.head_dim}, the latent and rope key)" if (m := spec.mla) else ""))
        runnable = all(t.qtype in SUPPORTED for t in model.tensors.values()) and spec.runnable
        layers = _layer_kinds(spec)
        not_run = "" if spec.runnable else (f"{spec.architecture} is read and checked, but its "
                                            "forward pass is to come (issue 34)")
    except GGUFError as e:
        shape, runnable, layers, not_run = f"not runnable: {e.problem}", False, "", ""
    budget = None
    if device_budget_gib is not None:
        budget = _fit(int(device_budget_gib * GIB), tensor_bytes - expert_bytes, expert_bytes,
                      n_experts * len(expert_layers))
    return ModelSummary(
        paths=[str(p) for p in model.paths], architecture=model.architecture,
        name=str(model.metadata.get("general.name", "")), file_bytes=model.file_bytes,
        tensor_bytes=tensor_bytes,
        n_tensors=len(model.tensors), params=params,
        active_params=params - expert_params + active_expert_params,
        types=[TypeRow(k, v[0], v[1], v[2], any(k == s.name for s in SUPPORTED))
               for k, v in sorted(rows.items())],
        n_experts=n_experts, n_experts_used=n_experts_used, moe_layers=sorted(expert_layers),
        expert_bytes_per_layer=dict(sorted(expert_layers.items())), expert_bytes=expert_bytes,
        dense_bytes=tensor_bytes - expert_bytes, shape=shape, runnable=runnable, layers=layers,
        not_run=not_run, budget=budget)


def _layer_kinds(spec) -> str:
    """One line for the hybrid families: how many layers of each kind, their sizes, and the
    pattern."""
    d = spec.deltanet
    if d is None:
        return ""
    n_d, n_a = spec.layer_kinds.count("deltanet"), spec.layer_kinds.count("attention")
    pattern = "".join("D" if k == "deltanet" else "A" for k in spec.layer_kinds)
    return (f"{n_d} Gated DeltaNet (conv {d.conv_kernel}, q/k heads {d.k_heads} x {d.head_dim}, v "
            f"heads {d.v_heads} x {d.v_head_dim}) + {n_a} gated attention (rope {spec.rope_dims} "
            f"of {spec.head_dim} dims): {pattern}")


def _fit(budget: int, dense: int, experts: int, n_total: int) -> BudgetFit:
    mean = experts / n_total if n_total else 0
    left = max(budget - dense, 0)
    after = min(n_total, math.floor(left / mean)) if mean else 0
    return BudgetFit(budget, dense, experts, experts <= budget, dense + experts <= budget, after,
                     n_total)


def render(s: ModelSummary) -> str:
    """Plain aligned text."""
    lines = [
        f"model         {s.paths[0]}" + (f" ({len(s.paths)} parts)" if len(s.paths) > 1 else ""),
        f"architecture  {s.architecture}" + (f"  ({s.name})" if s.name else ""),
        f"shape         {s.shape}",
        *([f"layers        {s.layers}"] if s.layers else []),
        f"parameters    {s.params:,}"
        + (f"  (active per token: {s.active_params:,})" if s.n_experts else ""),
        (f"tensors       {s.n_tensors:,}, {fmt_bytes(s.tensor_bytes)} of data in "
         f"{fmt_bytes(s.file_bytes)} of files"),
        "",
    ]
    table = [("type", "tensors", "parameters", "bytes", "")]
    for r in s.types:
        table.append((r.qtype, f"{r.tensors:,}", f"{r.params:,}", fmt_bytes(r.bytes),
                      "" if r.supported else "not supported by the kernels"))
    table.append(("total", f"{s.n_tensors:,}", f"{s.params:,}", fmt_bytes(s.tensor_bytes), ""))
    widths = [max(len(row[i]) for row in table) for i in range(4)]
    for row in table:
        cells = [row[0].ljust(widths[0])] + [row[i].rjust(widths[i]) for i in (1, 2, 3)]
        lines.append("  ".join(cells + ([row[4]] if row[4] else [])).rstrip())
    lines.append("")
    if not s.n_experts:
        lines.append("experts       none (a dense model)")
    else:
        sizes = set(s.expert_bytes_per_layer.values())
        one = (fmt_bytes(sizes.pop()) if len(sizes) == 1 else
               ", ".join(f"layer {k}: {fmt_bytes(v)}" for k, v in s.expert_bytes_per_layer.items()))
        lines += [
            (f"experts       {s.n_experts} per layer (top {s.n_experts_used}) in "
             f"{len(s.moe_layers)} MoE layers"),
            f"one expert    {one} (gate + up + down of one layer)",
            (f"all experts   {fmt_bytes(s.expert_bytes)} "
             f"({100 * s.expert_bytes / max(s.tensor_bytes, 1):.1f}% of the data)"),
            f"dense         {fmt_bytes(s.dense_bytes)} (all other tensors)",
        ]
    if s.budget:
        lines.append(_render_budget(s.budget))
    if s.not_run:
        lines.append(f"not runnable: {s.not_run}")
    elif not s.runnable and not s.shape.startswith("not runnable"):
        lines.append("not runnable: some tensor types are not supported by the kernels (see the "
                     "table)")
    return "\n".join(lines)


def _render_budget(b: BudgetFit) -> str:
    head = f"device budget {fmt_bytes(b.budget_bytes)}: "
    if b.all_fit:
        return (head + f"all weights fit ({fmt_bytes(b.dense_bytes + b.expert_bytes)}), experts "
                       "included")
    if not b.n_experts_total:
        return head + f"the weights ({fmt_bytes(b.dense_bytes)}) do not fit"
    return head + (f"experts {'fit' if b.experts_fit else 'do not fit'} by themselves; with the "
                   f"dense weights ({fmt_bytes(b.dense_bytes)}) it holds {b.experts_after_dense:,} "
                   f"of {b.n_experts_total:,} experts "
                   f"({100 * b.experts_after_dense / b.n_experts_total:.1f}%)")


def fmt_bytes(n: int) -> str:
    """Exact bytes, then a binary-unit figure: '1,234,567 B (1.18 MiB)'."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n:,} B ({n / size:.2f} {unit})"
    return f"{n:,} B"
