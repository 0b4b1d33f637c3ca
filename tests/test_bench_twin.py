"""`strata-jax bench --moe-twin E:K` without a benchmark run: the value's parsing and its errors,
the twin made from a tiny dense model (a MoE GGUF with E experts, top-K) and reused from the cache,
and a bench run with the measurements stubbed out that hands both engines the twin's file and says
so in the report."""

from __future__ import annotations

import os

import pytest

from strata_jax.bench import BenchOptions, run_bench
from strata_jax.bench.report import render, twin_line
from strata_jax.bench.twin import make_twin, parse_moe_twin, twin_path
from strata_jax.cli import main
from strata_jax.gguf import GGUFModel

DENSE = {"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "ffn": 128,
         "quant": "Q8_0"}


def test_parse_moe_twin():
    assert parse_moe_twin("8:2") == (8, 2)
    assert parse_moe_twin(" 16 : 4 ") == (16, 4)
    assert parse_moe_twin("2:2") == (2, 2)


@pytest.mark.parametrize("value, why",
                         [("8x2", "EXPERTS:TOP_K"), ("8", "EXPERTS:TOP_K"), ("8:", "EXPERTS:TOP_K"),
                                        ("a:b", "EXPERTS:TOP_K"), ("", "EXPERTS:TOP_K"),
                                        ("-8:2", "EXPERTS:TOP_K"),
                                        ("1:1", "at least 2 experts"),
                                        ("8:0", "top-k must be 1 to"),
                                        ("8:9", "top-k must be 1 to")])
def test_parse_moe_twin_errors_name_the_value(value, why):
    with pytest.raises(ValueError, match=f"--moe-twin {value!r}: .*{why}"):
        parse_moe_twin(value)


def test_options_validate_the_twin():
    with pytest.raises(ValueError, match="--moe-twin '8:9'"):
        BenchOptions(model="x.gguf", moe_twin=(8, 9)).validate()
    BenchOptions(model="x.gguf", moe_twin=(8, 2)).validate()


def test_cli_malformed_value_is_an_error_before_anything_runs(tiny_model, capsys):
    assert main(["bench", str(tiny_model(**DENSE)), "--moe-twin", "8x2"]) == 1
    err = capsys.readouterr().err
    assert "strata-jax bench: error: --moe-twin '8x2': must be EXPERTS:TOP_K" in err


def test_cli_refuses_a_moe_model(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("STRATA_JAX_CACHE", str(tmp_path))
    moe = tiny_model(**{**DENSE, "experts": 4, "experts_used": 2})
    assert main(["bench", str(moe), "--moe-twin", "8:2"]) == 1
    err = capsys.readouterr().err
    assert f"--moe-twin 8:2: {moe} is already a MoE model (4 experts, top-2)" in err
    assert not (tmp_path / "twins").exists() or not any((tmp_path / "twins").iterdir())


def test_refuses_a_dense_model_upcycle_does_not_take(tiny_model, tmp_path):
    qwen3 = tiny_model(**{**DENSE, "arch": "qwen3"})
    with pytest.raises(ValueError, match="--moe-twin 4:2: .* is a dense qwen3 model; .*llama"):
        make_twin(qwen3, 4, 2, tmp_path, progress=lambda _: None)


def test_make_twin_makes_a_moe_gguf_and_reuses_it(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setenv("STRATA_JAX_CACHE", str(tmp_path / "cache"))
    src = tiny_model(**DENSE)
    lines: list[str] = []
    path, reused = make_twin(src, 8, 2, progress=lines.append)
    assert not reused
    assert path == tmp_path / "cache" / "twins" / f"{src.stem}-8x2.gguf" == twin_path(src, 8, 2)
    twin = GGUFModel.open(path)
    assert twin.spec.is_moe and twin.spec.n_experts == 8 and twin.spec.n_experts_used == 2
    assert twin.tensors["blk.0.ffn_up_exps.weight"].shape[0] == 8
    dense = GGUFModel.open(src)
    # every expert is the dense FFN, byte for byte
    assert (twin.tensors["blk.1.ffn_down_exps.weight"].data[5]
            == dense.tensors["blk.1.ffn_down.weight"].data).all()
    assert not [p for p in path.parent.iterdir() if p.name.endswith(".tmp")]

    again, reused = make_twin(src, 8, 2, progress=lines.append)
    assert again == path and reused and "reusing" in lines[-1]
    made_at = path.stat().st_mtime_ns

    # the source changed (its mtime): the twin is made again
    st = os.stat(src)
    os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    try:
        again, reused = make_twin(src, 8, 2, progress=lines.append)
        assert not reused and "upcycling" in lines[-1]
        assert path.stat().st_mtime_ns >= made_at
    finally:
        os.utime(src, ns=(st.st_atime_ns, st.st_mtime_ns))

    other, reused = make_twin(src, 4, 1, progress=lines.append)   # another E:K is another file
    assert other.name == f"{src.stem}-4x1.gguf" and not reused
    assert GGUFModel.open(other).spec.n_experts == 4


def _side(path: str) -> dict:
    return {"path": path,
            "prefill": {"prompt_tokens": 8, "tokens_per_second": 100.0, "runs": [100.0]},
            "decode": [{"parallel": 1, "aggregate": 10.0, "per_sequence": 10.0,
                        "per_sequence_min": 10.0, "steady_seconds": 1.0, "tokens": 8}],
            "load_seconds": 0.1}


def test_bench_hands_both_engines_the_twin(tiny_model, tmp_path, monkeypatch):
    """run_bench with the measurements stubbed: each engine is given the twin's path, the result and
    the report say it is a twin."""
    from strata_jax.bench import llamacpp, ours, run

    def fake_ours(opts, cfg, progress=print):
        return {**_side(opts.model), "engine": {"weights": "blocks", "dtype": "float32",
                                                 "kv": "f32", "backend": "xla", "prefill": 256},
                "config": cfg.to_dict(), "rss_mib_after_load": 1.0}

    def fake_llamacpp(opts, vocab, progress=print):
        return {**_side(opts.model), "engine": {"weights": "blocks", "threads": opts.threads}}

    monkeypatch.setattr(ours, "measure_ours", fake_ours)
    monkeypatch.setattr(llamacpp, "measure_llamacpp", fake_llamacpp)
    monkeypatch.setattr(run, "memory_bandwidth",
                        lambda *a, **k: {"bytes_per_second": 1e10, "method": "stub"})
    src = tiny_model(**DENSE)
    opts = BenchOptions(model=str(src), prompt_tokens=8, decode_tokens=8, decode_prompt_tokens=8,
                        parallel_list=(1,),
                        vs="llama.cpp", threads=1, moe_twin=(8, 2), twin_cache=str(tmp_path))
    result = run_bench(opts, progress=lambda _: None)
    twin = str(tmp_path / "twins" / f"{src.stem}-8x2.gguf")
    assert (result["strata_jax"]["path"] == result["llama_cpp"]["path"] == result["model"]["path"]
            == twin)
    assert (result["twin"]["source"] == str(src) and result["twin"]["experts"] == 8
            and result["twin"]["top_k"] == 2)
    assert result["model"]["experts"] == "8 experts, top-2"
    assert result["bound"]["strata_jax"]["experts_used"] == "2 of 8"
    text = render(result)
    assert twin_line(result["twin"]) in text
    assert f"benchmarked: {twin}, a MoE twin of {src} (8 experts, top-2" in text
    assert twin_line(None) is None
