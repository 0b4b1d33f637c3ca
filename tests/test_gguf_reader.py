"""GGUF reading: split models, memory-mapping, metadata, ModelSpec."""

from __future__ import annotations

import mmap

import gguf
import numpy as np
import pytest

from strata_jax.gguf import SUPPORTED_ARCHITECTURES, GGUFModel, read_metadata
from strata_jax.gguf.mla import MLA_ARCHITECTURES
from strata_jax.gguf.spec import HYBRID_ARCHITECTURES


def _mapped_root(a: np.ndarray) -> np.ndarray:
    """The array that owns the memory map `a` is a view of."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    assert isinstance(a.base, mmap.mmap), type(a.base)
    return a


def test_split_model_and_its_one_file_twin_hold_identical_tensors(tiny_model):
    options = {"arch": "qwen2moe", "layers": 3, "quant": "Q4_0", "attn_quant": "Q8_0", "seed": 7}
    single = tiny_model(**options)
    first = tiny_model(**options, split=3)
    parts = sorted(first.parent.glob("*.gguf"))
    assert [p.name for p in parts] == [f"model-0000{i}-of-00003.gguf" for i in (1, 2, 3)]

    one = GGUFModel.open(single)
    for given in parts:  # any part finds all the others
        split = GGUFModel.open(given)
        assert split.paths == tuple(parts)
        assert list(split.tensors) == list(one.tensors)
        for name, t in one.tensors.items():
            s = split.tensors[name]
            assert (s.qtype, s.shape, s.n_bytes) == (t.qtype, t.shape, t.n_bytes)
            assert s.data.tobytes() == t.data.tobytes(), name
        assert ({k: v for k, v in split.metadata.items() if not k.startswith("split.")}
                == one.metadata)
        assert split.spec == one.spec

    assert split.metadata["split.count"] == 3 and split.metadata["split.no"] == 0
    by_part = [sum(t.path == p for t in split.tensors.values()) for p in parts]
    assert all(n > 0 for n in by_part) and sum(by_part) == split.metadata["split.tensors.count"]
    # The gguf package's own reader reads every part, and llama.cpp's layout: metadata only in
    # part 1.
    for i, p in enumerate(parts):
        reader = gguf.GGUFReader(p)
        assert len(reader.tensors) == by_part[i]
        assert reader.fields["split.no"].contents() == i
        assert ("general.architecture" in reader.fields) == (i == 0)


def test_tensors_are_views_of_the_mapped_file(tiny_model):
    model = GGUFModel.open(tiny_model(arch="qwen3moe"))
    t = model.tensors["blk.1.ffn_down_exps.weight"]
    assert t.shape == (8, 64, 32) and t.qtype == gguf.GGMLQuantizationType.Q8_0
    assert t.data.dtype == np.uint8 and t.data.shape == (8, 64, 32 // 32 * 34)
    root = _mapped_root(t.data)
    assert not t.data.flags.writeable and root.size == t.path.stat().st_size
    assert t.data.ctypes.data - root.ctypes.data == t.offset
    assert model.tensors["token_embd.weight"].shape == (512, 64)  # numpy order: (vocab, hidden)
    # The same values the gguf package's reader gives.
    reader = {r.name: r for r in gguf.GGUFReader(t.path).tensors}
    ref = gguf.quants.dequantize(reader[t.name].data, reader[t.name].tensor_type)
    np.testing.assert_array_equal(t.dequantize(), ref)


def test_metadata_is_plain_python(tiny_model):
    path = tiny_model(arch="qwen3moe")
    md = read_metadata(path)
    assert md == GGUFModel.open(path).metadata
    assert md["general.architecture"] == "qwen3moe"
    assert type(md["qwen3moe.block_count"]) is int and type(md["qwen3moe.rope.freq_base"]) is float
    assert type(md["tokenizer.ggml.add_bos_token"]) is bool
    tokens = md["tokenizer.ggml.tokens"]
    assert isinstance(tokens, list) and len(tokens) == 512 and all(type(x) is str for x in tokens)
    assert all(type(x) is int for x in md["tokenizer.ggml.token_type"])


@pytest.mark.parametrize("arch", [a for a in SUPPORTED_ARCHITECTURES
                                  if a not in (*HYBRID_ARCHITECTURES, *MLA_ARCHITECTURES,
                                               "gpt-oss")])
def test_spec_of_each_architecture(tiny_model, arch):
    """The attention families (the hybrid ones: tests/test_hybrid_read.py; deepseek2:
    tests/test_deepseek2.py; gpt-oss, whose layers are all MoE with biases and sinks:
    tests/test_gpt_oss.py)."""
    moe = arch in ("qwen2moe", "qwen3moe", "glm4moe")
    # GLM-4.5: a leading dense layer, half-head rope, shared expert = n x expert_ffn
    glm = arch == "glm4moe"
    options = {"arch": arch, "layers": 3, "hidden": 96, "heads": 6, "kv_heads": 2, "ffn": 160,
                   "vocab": 300, "context": 4096, "rope_theta": 1e6, "tied": arch == "qwen3"}
    if moe:
        options |= {"experts": 4, "experts_used": 3, "expert_ffn": 64,
                    "shared_ffn": 128 if glm else 96}
    spec = GGUFModel.open(tiny_model(**options)).spec
    assert (spec.architecture, spec.n_layers, spec.hidden, spec.ffn) == (arch, 3, 96, 160)
    assert ((spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.rope_dims)
            == (6, 2, 16, 8 if glm else 16))
    assert (spec.vocab_size, spec.context_length, spec.rope_theta) == (300, 4096, 1e6)
    assert spec.rms_eps == pytest.approx(1e-6) and spec.rope_scaling is None
    assert spec.tied_output == (arch == "qwen3")
    assert spec.rope_type == ("norm" if arch == "llama" else "neox")
    assert spec.attn_bias == (arch in ("qwen2", "qwen2moe", "glm4moe"))
    assert spec.qk_norm == (arch in ("qwen3", "qwen3moe"))
    if moe:
        assert (spec.n_experts, spec.n_experts_used, spec.expert_ffn) == (4, 3, 64)
        assert spec.moe_layers == ((1, 2) if glm else (0, 1, 2))
        assert spec.shared_ffn == {"qwen2moe": 96, "glm4moe": 128}.get(arch, 0)
        assert spec.shared_expert_gate == (arch == "qwen2moe")
        # llama.cpp's norm_w for each family
        assert spec.expert_weights_norm == (arch in ("qwen3moe", "glm4moe"))
        assert spec.expert_gating == ("sigmoid" if glm else "softmax") and spec.expert_bias == glm
        assert (spec.expert_tensors(1)
                == [f"blk.1.ffn_{k}_exps.weight" for k in ("gate", "up", "down")])
        assert len(spec.expert_tensors()) == (6 if glm else 9)
    else:
        assert not spec.is_moe and spec.expert_tensors() == [] and spec.moe_layers == ()


def test_mixtral_style_llama(tiny_model):
    model = GGUFModel.open(tiny_model(arch="llama", experts=4, experts_used=2, expert_ffn=64))
    spec = model.spec
    assert spec.is_moe and (spec.n_experts, spec.n_experts_used, spec.expert_ffn) == (4, 2, 64)
    assert spec.expert_weights_norm and spec.moe_layers == (0, 1)
    assert "llama.expert_feed_forward_length" not in model.metadata  # as in Mixtral's files
    assert model.tensors["blk.0.ffn_gate_inp.weight"].shape == (4, 64)
    assert model.tensors["blk.0.ffn_down_exps.weight"].shape == (4, 64, 64)


def test_opening_a_huge_file_reads_only_its_header(tmp_path):
    """An 8 GiB model (a sparse file: its data was never written) opens at once and leaves the data
    unread."""
    import resource
    import time

    from gguf import GGMLQuantizationType, GGUFWriter

    path = tmp_path / "huge.gguf"
    writer = GGUFWriter(path, "llama")
    rows, cols = 1 << 20, 4096  # F16: 8 GiB
    writer.add_tensor_info("token_embd.weight", (rows, cols * 2), np.dtype(np.uint8),
                           rows * cols * 2, raw_dtype=GGMLQuantizationType.F16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    data_start = -(-path.stat().st_size // 32) * 32
    with open(path, "r+b") as f:
        f.truncate(data_start + rows * cols * 2)

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    model = GGUFModel.open(path, strict=False)
    assert time.perf_counter() - start < 1.0
    t = model.tensors["token_embd.weight"]
    assert t.shape == (rows, cols) and t.n_bytes == 8 << 30 and t.data.shape == (rows, cols * 2)
    assert t.data[12345, :4].tolist() == [0, 0, 0, 0]  # one page read, on demand
    # KiB: under 64 MiB
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before < 64 << 10
