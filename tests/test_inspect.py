"""`strata-jax inspect`: its figures, checked against numbers computed here from the options and
from the gguf package's own reader."""

from __future__ import annotations

import json
from collections import defaultdict

import gguf
import pytest

from strata_jax.cli import main

E, EFF, H, L, V = 8, 64, 64, 3, 512
Q4_0_BYTES, Q8_0_BYTES = 18 / 32, 34 / 32  # bytes per value


@pytest.fixture(scope="module")
def moe_path(tiny_model):
    return tiny_model(arch="qwen2moe", layers=L, hidden=H, experts=E, experts_used=2,
                      expert_ffn=EFF, shared_ffn=64, expert_quant="Q4_0", quant="Q8_0",
                      embed_quant="F16", split=2)


def _inspect(capsys, *args) -> str:
    assert main(["inspect", *map(str, args)]) == 0
    return capsys.readouterr().out


def _reference(parts):
    """Per type: [tensors, values, bytes], from gguf.GGUFReader over every part."""
    types = defaultdict(lambda: [0, 0, 0])
    for p in parts:
        for t in gguf.GGUFReader(p).tensors:
            row = types[t.tensor_type.name]
            row[0] += 1
            row[1] += int(t.n_elements)
            row[2] += int(t.n_bytes)
    return types


def test_inspect_figures(moe_path, capsys):
    parts = sorted(moe_path.parent.glob("*.gguf"))
    ref = _reference(parts)
    params = sum(r[1] for r in ref.values())
    # gate, up and down rows of one expert of one layer
    one_expert = round(3 * EFF * H * Q4_0_BYTES)
    expert_params = L * E * 3 * EFF * H

    figures = json.loads(_inspect(capsys, parts[1], "--json"))
    assert figures["architecture"] == "qwen2moe" and figures["paths"] == [str(p) for p in parts]
    assert figures["params"] == params
    assert figures["active_params"] == params - expert_params + expert_params * 2 // E
    assert {r["qtype"]: [r["tensors"], r["params"], r["bytes"]] for r in figures["types"]} == ref
    assert set(ref) == {"F32", "F16", "Q8_0", "Q4_0"}
    assert (figures["n_experts"] == E and figures["n_experts_used"] == 2
            and figures["moe_layers"] == [0, 1, 2])
    assert figures["expert_bytes_per_layer"] == {str(i): one_expert for i in range(L)}
    assert figures["expert_bytes"] == L * E * one_expert == ref["Q4_0"][2]
    assert figures["dense_bytes"] == sum(r[2] for r in ref.values()) - L * E * one_expert
    assert figures["file_bytes"] == sum(p.stat().st_size for p in parts) and figures["runnable"]

    text = _inspect(capsys, parts[0])
    assert f"parameters    {params:,}" in text
    assert f"one expert    {one_expert:,} B" in text
    assert f"all experts   {L * E * one_expert:,} B" in text
    assert "8 per layer (top 2) in 3 MoE layers" in text
    for name, (n, values, nbytes) in ref.items():
        line = next(line for line in text.splitlines() if line.startswith(name + " "))
        assert line.split()[:4] == [name, str(n), f"{values:,}", f"{nbytes:,}"]


def test_inspect_device_budget(moe_path, capsys):
    ref = _reference(sorted(moe_path.parent.glob("*.gguf")))
    total = sum(r[2] for r in ref.values())
    experts = ref["Q4_0"][2]
    dense, one = total - experts, experts // (L * E)

    budget = (dense + 10.5 * one) / 2**30  # room for the dense weights and 10 experts
    fit = json.loads(_inspect(capsys, moe_path, "--json", "--device-budget-gib", budget))["budget"]
    assert fit["experts_after_dense"] == 10 and fit["n_experts_total"] == L * E
    assert fit["experts_fit"] and not fit["all_fit"]  # the experts alone (41 KiB) would fit
    assert ("it holds 10 of 24 experts (41.7%)" in _inspect(capsys, moe_path, "--device-budget-gib",
                                                            budget))

    roomy = json.loads(_inspect(capsys, moe_path, "--json", "--device-budget-gib", 1))["budget"]
    assert roomy["all_fit"] and roomy["experts_after_dense"] == L * E
    assert "all weights fit" in _inspect(capsys, moe_path, "--device-budget-gib", 1)

    tiny = json.loads(_inspect(capsys, moe_path, "--json", "--device-budget-gib",
                               experts / 2 / 2**30))["budget"]
    assert not tiny["experts_fit"] and tiny["experts_after_dense"] == 0


def test_inspect_dense_model(tiny_model, capsys):
    path = tiny_model(arch="qwen3", tied=True)
    text = _inspect(capsys, path)
    assert "experts       none" in text and "tied output" in text
    ref = _reference([path])
    assert f"parameters    {sum(r[1] for r in ref.values()):,}" in text


def test_inspect_unsupported_file_still_described(tiny_model, tmp_path, capsys):
    from strata_jax.testing.edit_gguf import rewrite_gguf

    path = rewrite_gguf(tiny_model(arch="qwen3moe"), tmp_path / "x.gguf",
                        set_metadata={"general.architecture": "grok"})
    text = _inspect(capsys, path)
    assert "not runnable: architecture 'grok' is not supported" in text
    assert json.loads(_inspect(capsys, path, "--json"))["n_experts"] == 8


def test_inspect_bad_file_is_one_clear_line(tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    assert main(["inspect", str(bad)]) == 1
    err = capsys.readouterr().err
    assert (err.startswith("strata-jax inspect: error: ") and str(bad) in err
            and "not a GGUF file" in err)
