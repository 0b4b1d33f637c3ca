"""The hybrid Gated DeltaNet + MoE families (qwen3next, qwen35moe), issue 34 item 1: their GGUF
files are read and checked (ModelSpec: the layer pattern, the DeltaNet sizes, every tensor's shape),
`strata-jax inspect` shows the layer kinds, an inconsistent file is a GGUFError naming the key or
tensor, and `serve` refuses a setting the family cannot run with yet at once, with a clear message
(never a restarting engine). The files are make-model's; tests/test_llamacpp.py checks that
llama.cpp loads and runs the same files; tests/test_hybrid_model.py runs them."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from strata_jax.gguf import (
    GGUFModel,
    MetadataError,
    MissingTensorError,
    TensorSizeError,
    UnsupportedArchitectureError,
)
from strata_jax.testing.edit_gguf import rewrite_gguf

HYBRID = {"layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 8, "experts_used": 2,
          "expert_ffn": 32, "shared_ffn": 64}


@pytest.mark.parametrize("arch", ["qwen3next", "qwen35moe"])
def test_a_hybrid_file_is_read_with_its_layer_kinds_and_sizes(tiny_model, arch):
    # strict: every tensor's shape checked
    spec = GGUFModel.open(tiny_model(arch=arch, **HYBRID)).spec
    # full_attention_interval 4
    assert spec.layer_kinds == ("deltanet", "deltanet", "deltanet", "attention")
    d = spec.deltanet
    assert (d.conv_kernel, d.k_heads, d.v_heads, d.head_dim, d.v_head_dim) == (4, 2, 4, 16, 16)
    assert d.qkv_dim == 2 * 2 * 16 + 4 * 16 and d.fused_ba == (arch == "qwen3next")
    assert (spec.attn_output_gate and spec.qk_norm and spec.rope_type == "neox"
            and spec.rope_dims == 4)
    assert spec.moe_layers == (0, 1, 2, 3) and spec.shared_expert_gate and spec.expert_weights_norm
    assert spec.ffn_norm_tensor == "post_attention_norm.weight"
    assert spec.rope_sections == ((1, 1, 0, 0) if arch == "qwen35moe" else ())
    assert spec.runnable
    names = spec.tensor_shapes()
    assert (names["blk.0.ssm_conv1d.weight"] == ((d.qkv_dim, 4), True)
            and "blk.0.attn_q.weight" not in names)
    assert names["blk.3.attn_q.weight"] == ((2 * 4 * 16, 64), True)           # [q | gate] a head
    assert (("blk.0.ssm_ba.weight" in names) == (arch == "qwen3next")
            == ("blk.0.ssm_beta.weight" not in names))


def test_the_layer_pattern_follows_the_interval_or_the_recurrent_layers_key(tiny_model, tmp_path):
    path = tiny_model(arch="qwen3next", **dict(HYBRID, layers=6, full_attention_interval=2))
    assert GGUFModel.open(path).spec.layer_kinds == ("deltanet", "attention") * 3
    # attention.recurrent_layers, where a file has it, wins over the interval; here it must agree
    # with the tensors, so the same pattern written out as bools
    both = rewrite_gguf(path, tmp_path / "rec.gguf", set_metadata={
        "qwen3next.attention.recurrent_layers": [True, False] * 3})
    assert GGUFModel.open(both).spec.layer_kinds == ("deltanet", "attention") * 3


def test_inspect_shows_the_layer_kinds(tiny_model):
    path = tiny_model(arch="qwen35moe", **dict(HYBRID, layers=8))
    out = subprocess.run([sys.executable, "-m", "strata_jax", "inspect", str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert ("layers        6 Gated DeltaNet (conv 4, q/k heads 2 x 16, v heads 4 x 16) + 2 gated "
            "attention" in out)
    assert "DDDADDDA" in out and "not runnable" not in out
    js = json.loads(subprocess.run([sys.executable, "-m", "strata_jax", "inspect", "--json",
                                    str(path)],
                                   capture_output=True, text=True, check=True).stdout)
    assert (js["architecture"] == "qwen35moe" and js["runnable"] is True
            and js["layers"].endswith("DDDADDDA"))


@pytest.mark.parametrize(("change", "error", "named"), [
    ({"drop_metadata": ["qwen3next.ssm.state_size"]}, MetadataError,
     "'qwen3next.ssm.state_size' is missing"),
    ({"set_metadata": {"qwen3next.ssm.time_step_rank": 3}}, MetadataError,
     "qwen3next.ssm.time_step_rank 3 (v heads) is not a multiple of qwen3next.ssm.group_count 2"),
    ({"set_metadata": {"qwen3next.ssm.inner_size": 128}}, TensorSizeError,
     "'blk.0.attn_qkv.weight'"),
    ({"set_metadata": {"qwen3next.full_attention_interval": 2}}, MissingTensorError,
     "'blk.1.attn_q.weight'"),
    ({"set_metadata": {"qwen3next.attention.recurrent_layers": [True]}}, MetadataError,
     "qwen3next.attention.recurrent_layers must be an array of a bool for each of the 4 layers"),
    ({"drop_tensors": ["blk.2.ssm_a"]}, MissingTensorError, "'blk.2.ssm_a'"),
    ({"tensor_shapes": {"blk.1.ssm_conv1d.weight": (96, 8)}}, TensorSizeError,
     "'blk.1.ssm_conv1d.weight'"),
])
def test_an_inconsistent_hybrid_file_is_an_error_naming_the_key_or_tensor(tiny_model, tmp_path,
                                                                          change, error, named):
    bad = rewrite_gguf(tiny_model(arch="qwen3next", **HYBRID), tmp_path / "bad.gguf", **change)
    with pytest.raises(error) as e:
        GGUFModel.open(bad)
    assert named in str(e.value)


def test_a_family_read_but_not_run_is_refused_by_name(tiny_model, monkeypatch):
    """The read-only state a family passes through on its way in (spec.READ_ONLY_ARCHITECTURES): the
    engine refuses it with what the file holds, before any work."""
    from strata_jax.engine import Engine
    from strata_jax.gguf import spec as spec_module

    path = tiny_model(arch="qwen3next", **HYBRID)
    monkeypatch.setattr(spec_module, "SUPPORTED_ARCHITECTURES", ("llama",))
    monkeypatch.setattr(spec_module, "READ_ONLY_ARCHITECTURES", ("qwen3next",))
    with pytest.raises(UnsupportedArchitectureError, match=r"'qwen3next' \(3 Gated DeltaNet and 1 "
                                                           r"attention layers, MoE\) is read and "
                                                           r"checked, but strata-jax does not "
                                                           r"run it"):
        Engine.from_gguf(path)


def test_serve_refuses_a_setting_the_family_cannot_run_with_at_once(tiny_model):
    """`serve --kv-resident 256` on a qwen3next file says so and exits, instead of a supervisor
    restarting an engine that cannot start (engine/families.py)."""
    path = tiny_model(arch="qwen3next", **HYBRID)
    done = subprocess.run([sys.executable, "-m", "strata_jax", "serve", str(path), "--port", "0",
                           "--kv-resident", "256"], check=False, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0 and "--kv-resident 256" in done.stderr and "issue 34" in done.stderr


@pytest.mark.parametrize("options, message", [
    ({"nextn": 2}, "--nextn must be 0 or 1 for qwen3next"),
    ({"nextn_head": True}, "--nextn-head needs --nextn 1"),
    ({"leading_dense": 1}, "--leading-dense is for --arch glm4moe"),
    ({"ssm_v_heads": 3}, "--ssm-v-heads 3 must be a multiple of --ssm-k-heads 2"),
    ({"full_attention_interval": 0}, "--full-attention-interval must be at least 1"),
])
def test_bad_hybrid_make_model_options_say_what_is_wrong(tmp_path, options, message):
    from strata_jax.makers.make_model import make_model

    with pytest.raises(ValueError, match=message):
        make_model(tmp_path / "x.gguf", arch="qwen3next", **options)


def test_a_nextn_block_is_read_as_gated_attention_after_the_main_layers(tiny_model):
    """The MTP block (blk.{n_layers}) is full gated attention whatever the interval says, as
    llama.cpp's qwen3next loader marks it; its KV layer follows the main attention layers'."""
    spec = GGUFModel.open(tiny_model(arch="qwen35moe", nextn=1, **dict(HYBRID, layers=3))).spec
    assert spec.n_layers == 3 and spec.n_nextn == 1 and spec.layer_kinds == ("deltanet",) * 3
    assert spec.kind(3) == "attention" and spec.kv_layer(3) == 0 and spec.n_kv_layers == 1
    assert spec.tensor_shapes()["blk.3.attn_q.weight"] == ((2 * 4 * 16, 64), True)
    assert "blk.3.nextn.eh_proj.weight" in spec.tensor_shapes()


def _legacy_ssm_in(path, dst):
    """The file as converted before llama.cpp split the DeltaNet input projection: attn_qkv and
    attn_gate fused into one ssm_in in transformers' in_proj_qkvz order (per k-head group: q, k, v x
    r, z x r)."""
    import numpy as np

    model = GGUFModel.open(path)
    d = model.spec.deltanet
    r, dk, nk = d.v_heads // d.k_heads, d.head_dim, d.k_heads * d.head_dim
    add, drop = {}, []
    for i in model.spec.deltanet_layers:
        b = f"blk.{i}."
        qkv, z = (model.tensors[b + n].dequantize()
                  for n in ("attn_qkv.weight", "attn_gate.weight"))
        q, k, v = qkv[:nk], qkv[nk:2 * nk], qkv[2 * nk:]
        add[b + "ssm_in.weight"] = np.concatenate([np.concatenate([
            q[g * dk:(g + 1) * dk], k[g * dk:(g + 1) * dk], v[g * r * dk:(g + 1) * r * dk],
            z[g * r * dk:(g + 1) * r * dk]])
            for g in range(d.k_heads)])
        drop += [b + "attn_qkv.weight", b + "attn_gate.weight"]
    return rewrite_gguf(path, dst, drop_tensors=drop, add_tensors=add)


def test_a_legacy_ssm_in_file_is_read_as_todays_layout(tiny_model, tmp_path):
    """A qwen3next file with the legacy fused ssm_in (gguf/legacy.py): read as attn_qkv and
    attn_gate equal to the split file's, bit for bit; llama.cpp (its legacy path) and our engine
    give the same logits on it."""
    import importlib.util

    import numpy as np

    from strata_jax import Engine, EngineConfig

    path = tiny_model(arch="qwen3next", quant="F32", **HYBRID)
    legacy = _legacy_ssm_in(path, tmp_path / "legacy.gguf")
    old, new = GGUFModel.open(legacy), GGUFModel.open(path)
    from gguf import GGUFReader

    # the file is legacy
    assert "blk.0.ssm_in.weight" in {t.name for t in GGUFReader(legacy).tensors}
    assert "blk.0.ssm_in.weight" not in old.tensors and "blk.0.attn_qkv.weight" in old.tensors
    for i in new.spec.deltanet_layers:
        for name in (f"blk.{i}.attn_qkv.weight", f"blk.{i}.attn_gate.weight"):
            assert np.array_equal(old.tensors[name].dequantize(),
                                  new.tensors[name].dequantize()), name
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    from test_llamacpp import llamacpp_logits

    ids = [int(t) for t in np.random.default_rng(4).integers(3, 500, 24)]
    ref = llamacpp_logits(legacy, ids)
    with Engine.from_gguf(legacy,
                          EngineConfig(max_context=64, weights="dequantized", warmup=False)) as eng:
        ours = eng.logits(ids)
    np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * np.abs(ref).max())


def test_fused_gate_up_experts_are_read_as_two_views_and_run_on_the_tiers(tiny_model, tmp_path):
    """A file written with convert_hf_to_gguf.py --fuse-gate-up-exps (ffn_gate_up_exps [E, 2f, h],
    gate first): read as ffn_gate_exps and ffn_up_exps views of the mapped file (gguf/legacy.py),
    equal to the split file's; the engine gives the split file's logits bit for bit, all experts on
    the device and on the tiers (--expert-cache 2 of 8: experts read from the fused tensor by the
    host tier), and llama.cpp's on it."""
    import importlib.util

    import numpy as np

    from strata_jax import Engine, EngineConfig

    path = tiny_model(arch="qwen35moe", quant="F32", **HYBRID)
    split = GGUFModel.open(path)
    add, drop = {}, []
    for i in range(split.spec.n_layers):
        gate, up = (split.tensors[f"blk.{i}.ffn_{n}_exps.weight"].dequantize()
                    for n in ("gate", "up"))
        add[f"blk.{i}.ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
        drop += [f"blk.{i}.ffn_gate_exps.weight", f"blk.{i}.ffn_up_exps.weight"]
    fused_path = rewrite_gguf(path, tmp_path / "fused.gguf", drop_tensors=drop, add_tensors=add)
    fused = GGUFModel.open(fused_path)
    assert "blk.0.ffn_gate_up_exps.weight" not in fused.tensors
    for i in range(split.spec.n_layers):
        for n in ("gate", "up"):
            t = fused.tensors[f"blk.{i}.ffn_{n}_exps.weight"]
            # a view, not a copy
            assert t.data.base is not None and not t.data.flags.c_contiguous
            assert np.array_equal(t.dequantize(), split.tensors[t.name].dequantize()), t.name
    ids = [int(t) for t in np.random.default_rng(6).integers(3, 500, 24)]

    def logits(p, **kw):
        with Engine.from_gguf(p,
                              EngineConfig(max_context=64, warmup=False, prefill=16, **kw)) as eng:
            return eng.logits(ids)

    want = logits(path)
    np.testing.assert_array_equal(logits(fused_path), want)
    np.testing.assert_array_equal(logits(fused_path, expert_cache=2), want)
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    from test_llamacpp import llamacpp_logits

    ref = llamacpp_logits(fused_path, ids)
    np.testing.assert_allclose(want, ref, rtol=0, atol=1e-4 * np.abs(ref).max())
