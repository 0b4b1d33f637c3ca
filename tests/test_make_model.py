"""`make_model` / `strata-jax make-model`: synthetic GGUF models in llama.cpp's layout."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from strata_jax.gguf import GGUFModel
from strata_jax.makers.make_model import make_model
from strata_jax.makers.tiny_tokenizer import CHAT_TEMPLATE
from strata_jax.model.weights import in_place

REPO = Path(__file__).resolve().parents[1]
F32, F16, Q8_0, Q4_K = (gguf.GGMLQuantizationType[n] for n in ("F32", "F16", "Q8_0", "Q4_K"))


def test_same_seed_same_file_other_seed_other_weights(tmp_path):
    a = make_model(tmp_path / "a.gguf", arch="qwen3", seed=3)[0].read_bytes()
    b = make_model(tmp_path / "b.gguf", arch="qwen3", seed=3)[0].read_bytes()
    c = make_model(tmp_path / "c.gguf", arch="qwen3", seed=4)[0].read_bytes()
    assert a == b and len(a) == len(c) and a != c


def test_quant_flags_and_fallback(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="strata_jax.makers.make_model"):
        path = make_model(tmp_path / "m.gguf", arch="qwen3moe", hidden=256, heads=4, expert_ffn=128,
                          quant="Q4_K", attn_quant="Q8_0", expert_quant="Q4_K",
                          embed_quant="Q6_K")[0]
    t = GGUFModel.open(path).tensors
    assert t["token_embd.weight"].qtype.name == "Q6_K" and t["output.weight"].qtype.name == "Q6_K"
    assert t["blk.0.attn_q.weight"].qtype == Q8_0 and t["blk.0.attn_output.weight"].qtype == Q8_0
    assert (t["blk.0.ffn_gate_exps.weight"].qtype == Q4_K
            and t["blk.0.ffn_up_exps.weight"].qtype == Q4_K)
    # ffn_down_exps rows are expert_ffn = 128 values: not whole Q4_K blocks of 256, so F16, and said
    # so.
    assert t["blk.0.ffn_down_exps.weight"].qtype == F16
    assert "2 tensor(s) stored as F16 instead of Q4_K: their rows of 128 values" in caplog.text
    assert "blk.0.ffn_down_exps.weight" in caplog.text
    for name in ("blk.0.attn_norm.weight", "blk.0.attn_q_norm.weight", "output_norm.weight",
                 "blk.1.ffn_gate_inp.weight"):
        assert t[name].qtype == F32, name  # norms and the router stay F32


def test_weights_have_sane_scales(tiny_model):
    t = GGUFModel.open(tiny_model(arch="qwen2moe", quant="Q4_0")).tensors
    q = t["blk.0.attn_q.weight"].dequantize()
    assert abs(q.std() * np.sqrt(64) - 1) < 0.2 and abs(q.mean()) < 0.02
    norm = t["blk.0.attn_norm.weight"].dequantize()
    assert abs(norm.mean() - 1) < 0.05 and 0 < norm.std() < 0.1
    assert all(np.isfinite(x.dequantize()).all() for x in t.values())


def test_tied_output_and_tokenizer_from(tiny_model, tmp_path):
    donor = tiny_model(arch="llama", vocab=700)
    path = make_model(tmp_path / "t.gguf", arch="qwen3moe", tied=True, tokenizer_from=donor)[0]
    model, source = GGUFModel.open(path), GGUFModel.open(donor)
    assert "output.weight" not in model.tensors and model.spec.tied_output
    assert model.spec.vocab_size == 700 and model.tensors["token_embd.weight"].shape == (700, 64)
    for key, value in source.metadata.items():
        if key.startswith("tokenizer."):
            assert (model.metadata[key] == value
                    and model.metadata_types[key] == source.metadata_types[key])
    with pytest.raises(ValueError, match="--vocab 600 disagrees"):
        make_model(tmp_path / "u.gguf", vocab=600, tokenizer_from=donor)


def test_builtin_tokenizer(tiny_model):
    md = GGUFModel.open(tiny_model(arch="qwen3", vocab=1000)).metadata
    tokens, types, merges = (md["tokenizer.ggml.tokens"], md["tokenizer.ggml.token_type"],
                             md["tokenizer.ggml.merges"])
    assert len(tokens) == len(types) == 1000 and len(set(tokens)) == 1000
    assert md["tokenizer.ggml.model"] == "gpt2" and md["tokenizer.ggml.pre"] == "qwen2"
    # GPT-2's byte spelling
    assert tokens[ord("A")] == "A" and tokens[ord(" ")] == "Ġ" and tokens[ord("\n")] == "Ċ"
    index = {tok: i for i, tok in enumerate(tokens)}
    for merge in merges:  # each merge joins two earlier tokens into a later one
        left, right = merge.split(" ")
        assert max(index[left], index[right]) < index[left + right]
    eos, bos = md["tokenizer.ggml.eos_token_id"], md["tokenizer.ggml.bos_token_id"]
    assert tokens[eos] == "<|im_end|>" and tokens[bos] == "<|endoftext|>"
    assert types[index["<|im_start|>"]] == gguf.TokenType.CONTROL
    assert types[index["<think>"]] == gguf.TokenType.USER_DEFINED
    assert md["tokenizer.chat_template"] == CHAT_TEMPLATE
    with pytest.raises(ValueError, match="at least 261"):
        make_model("/nonexistent/x.gguf", vocab=100)


@pytest.mark.parametrize("options, message", [
    ({"arch": "qwen3", "experts": 4}, "dense family; for experts use --arch qwen3moe"),
    ({"arch": "qwen3moe", "experts": 1}, "at least 2"),
    ({"arch": "qwen3moe", "experts_used": 9}, "--experts-used must be 1..8"),
    ({"heads": 4, "kv_heads": 3}, "multiple of --kv-heads"),
    ({"arch": "mamba"}, "is not one of llama, qwen2"),
    ({"quant": "Q9_9"}, "unknown quant type"),
    ({"split": 1000}, "--split 1000: the model has"),
])
def test_bad_options_say_what_is_wrong(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        make_model(tmp_path / "x.gguf", **options)
    assert not list(tmp_path.iterdir())


def test_make_model_command(tmp_path):
    out = tmp_path / "cli.gguf"
    run = subprocess.run(
        [sys.executable, "-m", "strata_jax", "make-model", str(out), "--arch", "qwen3moe",
         "--layers", "3", "--experts", "4", "--experts-used", "2", "--expert-ffn", "64", "--quant",
         "Q4_K", "--attn-quant", "Q8_0", "--split", "2", "--tied", "--seed", "5"],
        check=False, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert run.returncode == 0, run.stderr
    parts = [tmp_path / "cli-00001-of-00002.gguf", tmp_path / "cli-00002-of-00002.gguf"]
    assert sorted(tmp_path.iterdir()) == parts
    assert f"wrote {parts[0]}" in run.stdout and f"wrote {parts[1]}" in run.stdout
    # rows of 64 values are not whole Q4_K blocks
    assert "stored as F16 instead of Q4_K" in run.stderr
    model = GGUFModel.open(parts[1])
    spec = model.spec
    assert (spec.architecture, spec.n_layers, spec.n_experts, spec.expert_ffn,
            spec.tied_output) == (
        "qwen3moe", 3, 4, 64, True)
    assert model.tensors["blk.0.attn_q.weight"].qtype == Q8_0
    same = make_model(tmp_path / "py" / "cli.gguf", arch="qwen3moe", layers=3, experts=4,
                      experts_used=2, expert_ffn=64, quant="Q4_K", attn_quant="Q8_0", split=2,
                      tied=True, seed=5)
    assert [p.read_bytes() for p in same] == [p.read_bytes() for p in parts]
    # every part says its 64-byte alignment (GGUFWriter would say it in the first only) and every
    # tensor starts at such a boundary: read in place, never copied (model/weights.py in_place)
    for part in parts:
        reader = gguf.GGUFReader(part)
        assert reader.fields["general.alignment"].parts[-1][0] == 64 and reader.alignment == 64
        assert all(t.data_offset % 64 == 0 for t in reader.tensors)
    assert all(in_place(t.data) for t in GGUFModel.open(parts[0]).tensors.values())
    # a tool that copies a made file keeps it readable: the copied alignment key pads the copy
    from strata_jax.testing.edit_gguf import rewrite_gguf

    one = make_model(tmp_path / "one" / "m.gguf", arch="qwen3", layers=2, hidden=64)[0]
    # names 32 bytes apart: the header of one of the two copies ends off a 64-byte boundary
    for i, name in enumerate(("c" * 8, "c" * 40)):
        copy = GGUFModel.open(rewrite_gguf(one, tmp_path / f"copy{i}.gguf",
                                           set_metadata={"general.name": name}))
        assert copy.metadata["general.alignment"] == 64
        assert all(np.array_equal(t.data, copy.tensors[n].data) and in_place(copy.tensors[n].data)
                   for n, t in GGUFModel.open(one).tensors.items())


def test_more_bits_quant_flag(tmp_path, capsys):
    """--more-bits-quant: attn_v and ffn_down (experts too) of llama.cpp's Q4_K_M "more bits" layers
    take that type, every other matrix keeps --quant; the flag is in make-model's help."""
    from strata_jax.cli import main

    with pytest.raises(SystemExit) as done:
        main(["make-model", "--help"])
    assert done.value.code == 0 and "--more-bits-quant" in capsys.readouterr().out
    out = tmp_path / "mix.gguf"
    assert main(["make-model", str(out), "--arch", "qwen2moe", "--layers", "3", "--hidden", "256",
                 "--ffn", "256", "--expert-ffn", "256", "--shared-ffn", "256", "--experts", "2",
                 "--experts-used", "1", "--quant", "Q4_K", "--more-bits-quant", "Q6_K"]) == 0
    t = GGUFModel.open(out).tensors
    # use_more_bits(i, 3): layer 2 (i >= 7*3//8)
    for name in ("attn_v", "ffn_down_exps", "ffn_down_shexp"):
        assert ([t[f"blk.{i}.{name}.weight"].qtype.name for i in range(3)]
                == ["Q4_K", "Q4_K", "Q6_K"]), name
    others = {t[f"blk.{i}.{n}.weight"].qtype.name for i in range(3)
              for n in ("attn_q", "ffn_gate_exps", "ffn_up_shexp")}
    assert others == {"Q4_K"}


def test_a_shape_writes_the_real_models_sizes(tmp_path, capsys):
    """--shape qwen3-30b-a3b: Qwen3-30B-A3B's sizes (its config.json), the other flags over it; the
    whole model's bytes are its real file's (Q4_K ~16, Q8_0 ~30 GiB: docs/BENCHMARKS.md's large
    models); progress is reported to the last byte."""
    from strata_jax.cli import main
    from strata_jax.makers.make_model import model_bytes

    assert 15.5 * 2**30 < model_bytes("qwen3-30b-a3b") < 17 * 2**30
    assert 29.5 * 2**30 < model_bytes("qwen3-30b-a3b", quant="Q8_0") < 31 * 2**30
    assert 42 * 2**30 < model_bytes("qwen3-next-80b-a3b") < 44 * 2**30
    seen: list[tuple[int, int]] = []
    small = {"layers": 1, "experts": 8, "vocab": 1024}
    (path,) = make_model(tmp_path / "s.gguf", shape="qwen3-30b-a3b", progress=lambda d, t:
                         seen.append((d, t)), **small)
    spec = GGUFModel.open(path).spec
    assert (spec.architecture, spec.hidden, spec.n_heads, spec.n_kv_heads, spec.head_dim,
            spec.n_experts, spec.n_experts_used, spec.expert_ffn) == (
        "qwen3moe", 2048, 32, 4, 128, 8, 8, 768)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert seen[-1] == (model_bytes("qwen3-30b-a3b", **small),) * 2
    with pytest.raises(ValueError, match="--shape 'qwen9' is not one of qwen3-30b-a3b"):
        make_model(tmp_path / "x.gguf", shape="qwen9")
    assert main(["make-model", str(tmp_path / "c.gguf"), "--shape", "qwen3-next-80b-a3b",
                 "--layers", "1", "--experts", "16", "--vocab", "1024", "--nextn", "0"]) == 0
    out = capsys.readouterr()
    assert "writing " in out.out and "GiB" in out.err       # the size first, then the progress line
    spec = GGUFModel.open(tmp_path / "c.gguf").spec
    assert (spec.architecture, spec.n_experts, spec.n_experts_used) == ("qwen3next", 16, 10)


def test_a_model_the_disk_cannot_hold_is_refused_before_a_byte(tmp_path, monkeypatch):
    import shutil

    from strata_jax.makers import make_model as mm

    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(mm.shutil, "disk_usage", lambda p: real._replace(free=50 << 20))
    with pytest.raises(ValueError, match=r"needs 0\.\d\d GiB of disk and .* has 0\.05 GiB free"):
        make_model(tmp_path / "big.gguf", layers=4, hidden=1024, ffn=1024)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q4_K", "Q6_K", "IQ4_XS", "Q2_K"])
def test_fast_random_blocks_are_valid_weights_of_the_std_asked(qtype):
    """random_blocks_fast (make-model's generator for tensors of 32 MiB and more): finite values
    (gguf.quants' dequantization), mean ~0, the std asked for, block scales spread by the jitter."""
    from gguf import quants as gq

    from pallas_kernels.random_blocks import random_blocks_fast
    from quant_types import as_qtype

    b = random_blocks_fast(qtype, (64, 1024), np.random.default_rng(1), std=0.05)
    w = gq.dequantize(b, as_qtype(qtype)).reshape(64, -1)
    assert np.isfinite(w).all()
    assert abs(w.mean()) < 0.005 and 0.045 < w.std() < 0.055, (w.mean(), w.std())
    per_block = w.reshape(-1, 256).std(axis=1)
    assert per_block.max() > 1.5 * per_block.min()


def share_of_hottest_tenth(path: Path, layers: int = 2) -> list[float]:
    """A MoE model's share of random hidden states' top-4 routings that go to each layer's hottest
    tenth of the experts."""
    t = GGUFModel.open(path).tensors
    shares = []
    for i in range(layers):
        w = t[f"blk.{i}.ffn_gate_inp.weight"].dequantize()                 # [experts, hidden]
        x = np.random.default_rng(i).standard_normal((4000, w.shape[1]))
        top = np.argpartition(-(x @ w.T), 4, axis=1)[:, :4]
        counts = np.sort(np.bincount(top.ravel(), minlength=w.shape[0]))[::-1]
        shares.append(counts[: w.shape[0] // 10].sum() / counts.sum())
    return shares


def test_router_skew_makes_some_experts_hot_token_by_token(tmp_path):
    """--router-skew 0.5: router rows scaled in a random order a layer, so the top-k choices of
    random hidden states concentrate (the hottest tenth of the experts get far more than a tenth);
    0 keeps every expert about as popular."""
    opts = {"arch": "qwen3moe", "layers": 2, "experts": 40, "experts_used": 4}
    (skewed,) = make_model(tmp_path / "s" / "m.gguf", router_skew=0.5, **opts)
    (uniform,) = make_model(tmp_path / "u" / "m.gguf", **opts)
    assert all(s > 0.25 for s in share_of_hottest_tenth(skewed))
    assert all(s < 0.2 for s in share_of_hottest_tenth(uniform))
    t = GGUFModel.open(skewed).tensors
    hot = [int(np.argmax(np.linalg.norm(t[f"blk.{i}.ffn_gate_inp.weight"].dequantize(), axis=1)))
           for i in range(2)]
    assert hot[0] != hot[1]                            # each layer has its own hot experts


def test_skew_router_skews_a_written_split_file_in_place_and_restores_it_bit_for_bit(tmp_path):
    """scripts/skew_router.py (the large model's skewed figures without writing it twice): on a
    2-part file, --skew 0.5 makes the routing as concentrated as make-model's --router-skew and
    touches nothing but the routers; --restore gives back the very bytes; a backup already there is
    refused (the uniform rows would be lost)."""
    parts = make_model(tmp_path / "m.gguf", arch="qwen3moe", layers=2, experts=40, experts_used=4,
                       split=2)
    before = [p.read_bytes() for p in parts]
    assert all(s < 0.2 for s in share_of_hottest_tenth(parts[0]))
    script = [sys.executable, str(REPO / "scripts" / "skew_router.py"), str(parts[0])]
    backup = tmp_path / "routers.npy"
    subprocess.run(script + ["--skew", "0.5", "--backup", str(backup)], check=True,
                   capture_output=True, text=True)
    assert all(s > 0.25 for s in share_of_hottest_tenth(parts[0]))
    routers = {n: t for n, t in GGUFModel.open(parts[0]).tensors.items()
               if n.endswith("ffn_gate_inp.weight")}
    assert len(routers) == 2
    for p, b in zip(parts, before):          # every byte outside the routers as it was
        after = bytearray(p.read_bytes())
        for t in routers.values():
            if Path(t.path) == p:
                after[t.offset:t.offset + t.n_bytes] = b[t.offset:t.offset + t.n_bytes]
        assert bytes(after) == b
    again = subprocess.run(script + ["--skew", "0.5", "--backup", str(backup)],
                           check=False, capture_output=True, text=True)
    assert again.returncode != 0 and "exists" in again.stderr
    subprocess.run(script + ["--restore", str(backup)], check=True, capture_output=True, text=True)
    assert [p.read_bytes() for p in parts] == before
