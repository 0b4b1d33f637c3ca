"""`strata-jax bench` on a tiny made model: the JSON holds every figure and each is positive; with
--vs llama.cpp, llama.cpp's figures and the ratios too. Plus the parts that need no engine: the
steady-span decode rate and the bytes a decode step reads."""

from __future__ import annotations

import importlib.util
import json
import sys

import numpy as np
import pytest

from strata_jax.bench.ours import steady_rates
from strata_jax.bench.traffic import bytes_per_token
from strata_jax.cli import main
from strata_jax.gguf import GGUFModel

TINY = {"arch": "llama", "experts": 4, "experts_used": 2, "layers": 2, "hidden": 64, "heads": 4,
        "kv_heads": 2, "quant": "Q8_0"}
SMALL = ["--prompt-tokens", "32", "--decode-tokens", "8", "--decode-prompt-tokens", "8",
         "--parallel-list", "1,2", "--bandwidth-gib", "0.0625"]


def _bench(tmp_path, capsys, model, *extra) -> tuple[dict, str]:
    out = tmp_path / "bench.json"
    assert main(["bench", str(model), *SMALL, "--json", str(out), *extra]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def _check_side(side: dict) -> None:
    assert side["prefill"]["prompt_tokens"] == 32 and side["prefill"]["tokens_per_second"] > 0
    assert [d["parallel"] for d in side["decode"]] == [1, 2]
    for d in side["decode"]:
        assert d["aggregate"] > 0 and d["per_sequence"] > 0
        assert d["aggregate"] == pytest.approx(d["per_sequence"] * d["parallel"])


def test_bench_json(tiny_model, tmp_path, capsys):
    result, printed = _bench(tmp_path, capsys, tiny_model(**TINY))
    _check_side(result["strata_jax"])
    assert result["llama_cpp"] is None and result["ratio"] is None
    assert result["strata_jax"]["engine"]["weights"] in ("dequantized", "blocks")
    assert result["bandwidth"]["bytes_per_second"] > 0
    b = result["bound"]["strata_jax"]
    assert b["bytes_per_token"] > 0 and b["tokens_per_second"] > 0 and b["fraction"] > 0
    m = result["machine"]
    assert m["cpu"] and m["cores"] >= 1 and m["jax"] and m["date"]
    assert "| decode, 2 sequences: total (tok/s)" in printed and "bound, 1 sequence" in printed


def test_bench_vs_llamacpp(tiny_model, tmp_path, capsys):
    # looked up, not imported: the bench runs it in a child
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("llama-cpp-python is not installed")
    result, printed = _bench(tmp_path, capsys, tiny_model(**TINY), "--vs", "llama.cpp")
    _check_side(result["strata_jax"])
    _check_side(result["llama_cpp"])
    assert set(result["ratio"]) == {"prefill", "decode_1_aggregate", "decode_1_per_sequence",
                                    "decode_2_aggregate", "decode_2_per_sequence"}
    assert all(r > 0 for r in result["ratio"].values())
    assert result["bound"]["llama_cpp"]["fraction"] > 0
    assert "ours / llama.cpp" in printed and result["machine"]["llama_cpp_python"]


def test_llamacpp_crash_is_an_error_not_ours(tiny_model, monkeypatch):
    """llama.cpp measures in a child process: a child that dies (here by SIGSEGV, as llama.cpp did
    once in CI) raises an error naming the signal, and this process goes on."""
    from strata_jax.bench import llamacpp
    from strata_jax.bench.options import BenchOptions

    crash = ("import os, signal, sys; sys.stdin.read(); print('progress loading', flush=True); "
             "os.kill(os.getpid(), signal.SIGSEGV)")
    monkeypatch.setattr(llamacpp, "CHILD", [sys.executable, "-c", crash])
    said = []
    with pytest.raises(RuntimeError, match="died \\(signal SIGSEGV\\)"):
        llamacpp.measure_llamacpp(BenchOptions(model=str(tiny_model(**TINY))), 256, said.append)
    assert said == ["loading"]


def test_bench_refuses_bad_settings(tiny_model, capsys):
    path = str(tiny_model(**TINY))
    assert main(["bench", path, "--parallel", "4"]) == 1
    assert "--parallel-list" in capsys.readouterr().err
    assert main(["bench", path, "--parallel-list", "1,x"]) == 1
    assert main(["bench", path, "--decode-tokens", "1"]) == 1
    # the 512-token prefill prompt does not fit
    assert main(["bench", path, "--max-context", "64"]) == 1
    assert "too small" in capsys.readouterr().err


def test_steady_rates():
    # Two sequences: one from t=0, one joining at t=1; both then make a token every 0.1 s until t=3
    # / t=4.
    a = list(np.arange(0.0, 3.0001, 0.1))
    b = list(np.arange(1.0, 4.0001, 0.1))
    rates, span = steady_rates([a, b])
    assert span == pytest.approx(2.0)          # from b's first token (1.0) to a's last (3.0)
    assert rates == pytest.approx([10.0, 10.0])
    assert steady_rates([a])[0] == pytest.approx([10.0])


def test_bytes_per_token(tiny_model):
    dense = GGUFModel.open(tiny_model(**{**TINY, "experts": 0}))
    t = dense.tensors
    embed = t["token_embd.weight"]
    expected = sum(x.n_bytes if len(x.shape) > 1 else 4 * x.n_values for x in t.values())
    # one embedding row is read, not the table
    expected -= embed.n_bytes - embed.n_bytes / embed.shape[0]
    assert bytes_per_token(dense, "blocks")["bytes_per_token"] == pytest.approx(expected)
    f32 = bytes_per_token(dense, "dequantized", "float32")
    assert f32["bytes_per_token"] == pytest.approx(4 * (sum(x.n_values for x in t.values())
                                                        - embed.n_values
                                                        + embed.shape[1]))

    moe = GGUFModel.open(tiny_model(**TINY))
    got = bytes_per_token(moe, "blocks")
    exps = sum(x.n_bytes for n, x in moe.tensors.items() if "_exps." in n)
    assert got["expert_bytes_per_token"] == pytest.approx(exps * 2 / 4)     # top-2 of 4 experts
    assert got["bytes_per_token"] < got["weight_bytes"]
