"""A whole bench run: machine, model, our engine, llama.cpp (with --vs llama.cpp), the bandwidth
bound."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

from strata_jax.bench.machine import (
    limit_threads,
    load_average,
    machine_info,
    memory_bandwidth,
)
from strata_jax.bench.options import BenchOptions
from strata_jax.bench.traffic import bound, bytes_per_token
from strata_jax.gguf import GGUFModel


def describe_model(model: GGUFModel, path: str) -> dict:
    spec = model.spec
    types = Counter(t.qtype.name for t in model.tensors.values() if len(t.shape) > 1)
    return {"path": str(path), "file": Path(path).name, "architecture": spec.architecture,
            "parameters": sum(t.n_values for t in model.tensors.values()),
            "experts": f"{spec.n_experts} experts, top-{spec.n_experts_used}" if spec.n_experts
                       else None,
            "types": ", ".join(f"{n} {k}" for k, n in types.most_common()),
            "vocab": spec.vocab_size}


def run_bench(opts: BenchOptions, progress=print) -> dict:
    """Measure, and return every figure as a JSON-ready dict (see report.render for the printed
    form)."""
    from strata_jax.bench.ours import engine_config, measure_ours

    opts.validate()
    # a setting that cannot work is an error before anything runs
    cfg = engine_config(opts)
    twin = None
    if opts.moe_twin is not None:                # both engines then read the twin's file
        from strata_jax.bench.twin import make_twin

        experts, top_k = opts.moe_twin
        t = time.perf_counter()
        path, reused = make_twin(opts.model, experts, top_k, opts.twin_cache, progress=progress)
        twin = {"source": str(opts.model), "path": str(path), "experts": experts, "top_k": top_k,
                "reused": reused, "seconds": time.perf_counter() - t}
        opts = replace(opts, model=str(path))
    started = time.perf_counter()
    machine = machine_info(opts.threads)         # before we load the machine ourselves
    machine["pinned_to_threads"] = limit_threads(opts.threads)
    model = GGUFModel.open(opts.model)
    result: dict = {"machine": machine, "model": describe_model(model, opts.model), "twin": twin,
                    "settings": {"prompt_tokens": opts.prompt_tokens,
                                 "decode_tokens": opts.decode_tokens,
                                 "decode_prompt_tokens": opts.decode_prompt_tokens,
                                 "parallel_list": list(opts.parallel_list), "threads": opts.threads,
                                 "repeat": opts.repeat, "vs": opts.vs,
                                 "moe_twin": list(opts.moe_twin) if opts.moe_twin else None}}
    progress(f"memory bandwidth: reading a {opts.bandwidth_gib:g} GiB array")
    result["bandwidth"] = memory_bandwidth(opts.bandwidth_gib, opts.threads)
    result["strata_jax"] = measure_ours(opts, cfg, progress)
    result["llama_cpp"] = None
    if opts.vs == "llama.cpp":
        from strata_jax.bench.llamacpp import measure_llamacpp

        result["llama_cpp"] = measure_llamacpp(opts, model.spec.vocab_size, progress)
    result["ratio"] = _ratios(result)

    bw = result["bandwidth"]["bytes_per_second"]
    eng = result["strata_jax"]["engine"]
    one = _one_sequence(result["strata_jax"])
    result["bound"] = {"strata_jax": bound(bw, bytes_per_token(model, eng["weights"],
                                                               eng["dtype"]), one)}
    if result["llama_cpp"]:
        result["bound"]["llama_cpp"] = bound(bw, bytes_per_token(model, "blocks"),
                                             _one_sequence(result["llama_cpp"]))
    result["seconds"] = time.perf_counter() - started
    # includes our own load: about `threads` when alone
    machine["load_average_at_end"] = load_average()
    return result


def _one_sequence(side: dict) -> float | None:
    return next((d["aggregate"] for d in side["decode"] if d["parallel"] == 1), None)


def _ratios(result: dict) -> dict | None:
    ours, theirs = result["strata_jax"], result["llama_cpp"]
    if not theirs:
        return None
    out = {"prefill": ours["prefill"]["tokens_per_second"] / theirs["prefill"]["tokens_per_second"]}
    for a, b in zip(ours["decode"], theirs["decode"]):
        out[f"decode_{a['parallel']}_aggregate"] = a["aggregate"] / b["aggregate"]
        out[f"decode_{a['parallel']}_per_sequence"] = a["per_sequence"] / b["per_sequence"]
    return out


def write_json(result: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n")
