"""Every kind of bad GGUF file gives its own clear error, naming the file and what to do."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from quant_types import UnsupportedQuantType
from strata_jax.gguf import (
    GGUFError,
    GGUFModel,
    MissingSplitPartError,
    MissingTensorError,
    NotGGUFError,
    TensorSizeError,
    TruncatedGGUFError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
    read_metadata,
)
from strata_jax.testing.edit_gguf import rewrite_gguf


def _raises(cls, path, *words):
    with pytest.raises(cls) as info:
        GGUFModel.open(path)
    message = str(info.value)
    assert (str(path) in message and isinstance(info.value, GGUFError)
            and isinstance(info.value, ValueError))
    for word in words:
        assert word in message, message
    return message


def test_not_a_gguf_file(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 this is a zip file, not a model")
    _raises(NotGGUFError, path, "not a GGUF file", "b'PK\\x03\\x04'")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _raises(NotGGUFError, empty, "empty")


def test_truncated_tensor_data(tiny_model, tmp_path):
    good = tiny_model(arch="qwen3moe")
    data = good.read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:-1000])
    message = _raises(TruncatedGGUFError, path, "truncated", "output.weight",
                      f"{len(data) - 1000:,} bytes", "fetch the file again")
    assert "tensor" in message


def test_truncated_header(tiny_model, tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_model(arch="qwen3moe").read_bytes()[:3000])  # inside the vocabulary
    _raises(TruncatedGGUFError, path, "header is cut short", "the file has 3,000")
    with pytest.raises(TruncatedGGUFError):
        read_metadata(path)


def test_missing_split_part(tiny_model, tmp_path):
    parts = sorted(tiny_model(arch="qwen3moe", split=3).parent.glob("*.gguf"))
    for p in parts:
        shutil.copy(p, tmp_path / p.name)
    (tmp_path / parts[1].name).unlink()
    for given in (tmp_path / parts[0].name, tmp_path / parts[2].name):
        with pytest.raises(MissingSplitPartError) as info:
            GGUFModel.open(given)
        message = str(info.value)
        assert ("model-00002-of-00003.gguf" in message and "part 2 of 3" in message
                and "missing" in message)
        assert str(tmp_path) in message


def test_split_part_renamed_out_of_the_pattern(tiny_model, tmp_path):
    first = min(tiny_model(arch="qwen3moe", split=3).parent.glob("*.gguf"))
    lone = tmp_path / "renamed.gguf"
    shutil.copy(first, lone)
    _raises(MissingSplitPartError, lone, "part 1 of a 3-part split model", "-00001-of-0000N.gguf")


def test_unsupported_architecture(tiny_model, tmp_path):
    path = rewrite_gguf(tiny_model(arch="qwen3moe"), tmp_path / "neox.gguf",
                        set_metadata={"general.architecture": "gptneox"})
    _raises(UnsupportedArchitectureError, path, "'gptneox'",
            "llama, qwen2, qwen3, qwen2moe, qwen3moe")
    # inspect can still describe it
    assert GGUFModel.open(path, strict=False).architecture == "gptneox"


def test_unsupported_tensor_type(tmp_path):
    path = tmp_path / "iq1.gguf"
    writer = GGUFWriter(path, "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((4, 50), np.uint8),
                      raw_dtype=GGMLQuantizationType.IQ1_S)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    message = _raises(UnsupportedTensorTypeError, path, "'blk.0.attn_q.weight'", "IQ1_S", "Q4_K")
    assert "IQ4_XS" in message  # the supported types are listed
    with pytest.raises(UnsupportedQuantType):  # the kernels' error class too
        GGUFModel.open(path)
    assert GGUFModel.open(path, strict=False).tensors["blk.0.attn_q.weight"].shape == (4, 256)


def test_tensor_bytes_do_not_match_its_shape(tiny_model, tmp_path):
    # The declared shape needs twice the bytes that lie before the next tensor.
    path = rewrite_gguf(tiny_model(arch="qwen3moe"), tmp_path / "shape.gguf",
                        tensor_shapes={"blk.0.attn_q.weight": (128, 64)})
    _raises(TensorSizeError, path, "'blk.0.attn_q.weight'", "[128, 64]", "8,704 bytes",
            "4,352 bytes", "does not match its shape")


def test_tensor_shape_disagrees_with_metadata(tiny_model, tmp_path):
    path = rewrite_gguf(tiny_model(arch="qwen3moe"), tmp_path / "meta.gguf",
                        set_metadata={"qwen3moe.expert_feed_forward_length": 48})
    _raises(TensorSizeError, path, "'blk.0.ffn_gate_exps.weight'", "[8, 32, 64]", "[8, 48, 64]")


def test_missing_tensor(tiny_model, tmp_path):
    path = rewrite_gguf(tiny_model(arch="qwen3moe"), tmp_path / "gone.gguf",
                        drop_tensors=["blk.1.attn_k_norm.weight"])
    _raises(MissingTensorError, path, "'blk.1.attn_k_norm.weight'", "qwen3moe")


def test_corrupt_headers_always_give_a_gguf_error(tiny_model, tmp_path):
    """Random byte changes in the header: the file opens, or fails with a GGUFError, never anything
    else."""
    from strata_jax.gguf.reader import _read_header

    good = tiny_model(arch="qwen2moe")
    data = good.read_bytes()
    header_end = _read_header(good).data_start
    rng = np.random.default_rng(0)
    path = tmp_path / "fuzz.gguf"
    for _ in range(300):
        bad = bytearray(data)
        # half anywhere in the header, half in its tensor directory
        for _ in range(rng.integers(1, 4)):
            lo = 0 if rng.random() < 0.5 else max(0, header_end - 3000)
            bad[int(rng.integers(lo, header_end))] = int(rng.integers(0, 256))
        path.write_bytes(bad)
        try:
            GGUFModel.open(path)
        except GGUFError as e:
            assert str(path) in str(e)


def test_vocabulary_only_file(tmp_path):
    path = tmp_path / "ggml-vocab-tiny.gguf"
    writer = GGUFWriter(path, "qwen2")
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "ab"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert read_metadata(path)["tokenizer.ggml.tokens"] == ["a", "b", "ab"]
    assert GGUFModel.open(path, strict=False).tensors == {}
    _raises(MissingTensorError, path, "no tensors", "vocabulary-only", "load_tokenizer")
