"""--devices N checks and figures, in a process of its own: XLA_FLAGS must force the CPU devices before JAX
starts, so tests/test_devices.py (whose JAX already has one device) runs this as a child.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python scripts/multi_device.py check MODEL.gguf \\
        '[[1, "auto"], [2, "experts"], [4, "experts"], [2, "layers"], [4, "layers"]]'
        -> one JSON line: per (devices, split) whether the logits are the same bits as the first entry's,
           their largest difference, and whether greedy tokens (alone, and two requests at once) agree
    XLA_FLAGS=... python scripts/multi_device.py bench MODEL.gguf '[[1, "auto"], [4, "experts"]]' [TOKENS]
        -> one JSON line: decode tokens/s of one request and of four at once, per entry
    XLA_FLAGS=... python scripts/multi_device.py errors MODEL.gguf '[{"devices": 3, "split": "experts"}, ...]'
        -> one JSON line: each config's ConfigError message (null: it started)
    XLA_FLAGS=... python scripts/multi_device.py kernels - 200
        -> one JSON line: the cpu kernels called from every device's thread at once give the bits of alone
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from strata_jax import Engine, EngineConfig
from strata_jax.config import ConfigError

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 31, 77]
OTHER = [9, 8, 7, 6, 5, 4, 3, 2]


def engine(path: str, devices: int = 1, split: str = "auto", **extra) -> Engine:
    cfg = {"parallel": 4, "max_context": 128, "prefill": 16, "warmup": False, "devices": devices,
           "split": split} | extra
    return Engine.from_gguf(path, EngineConfig(**cfg))


def run_check(path: str, entries: list) -> dict:
    out, base = [], None
    for devices, split, *extra in entries:               # [devices, split(, {more EngineConfig settings})]
        eng = engine(path, devices, split, **(extra[0] if extra else {}))
        try:
            logits = eng.logits(PROMPT)
            alone = eng.generate(PROMPT, max_tokens=6, temperature=0.0).tokens
            hs = [eng.submit(p, max_tokens=6, temperature=0.0) for p in (PROMPT, OTHER)]
            together = [[ev.token for ev in h if ev.kind == "token"] for h in hs]
            stats = eng.stats()
            kv = kv_moves(eng)
        finally:
            eng.close()
        res = {"logits": logits, "alone": alone, "together": together, "kv": kv}
        base = base or res
        out.append({"devices": devices, "split": split, "bits_equal": bool(np.array_equal(logits, base["logits"])),
                    "max_diff": float(np.max(np.abs(logits - base["logits"]))),
                    "tokens_equal": alone == base["alone"] and together == base["together"],
                    "kv_equal": all(np.array_equal(kv[k], base["kv"][k]) for k in kv),
                    "alone": alone, "together": together, "runner": stats.get("devices"),
                    "programs": [{k: p[k] for k in ("live", "evicted", "oom_recoveries")}
                                 for p in stats["programs"].get("devices", [stats["programs"]])],
                    "memory": stats["memory"]})
    return {"results": out}


def kv_moves(eng: Engine) -> dict[str, np.ndarray]:
    """The KV cache's moves the prefix cache makes (KVCache.read, write, copy: per stage with --split
    layers), between windows on the engine thread's idle slots 2 and 3 -> what each left in slot 3."""
    kv, out = eng.runner.kv, {}
    block = kv.read(0, 0, 16)                               # slot 0 holds PROMPT's KV
    kv.write(3, 0, block)
    out["written"] = kv.slot(3, 16)["k"]
    kv.copy(1, 3, 1, 16)                                    # slot 1: OTHER's
    out["copied"] = kv.slot(3, 16)["k"]
    out["read"] = block["k"]
    return out


def run_bench(path: str, entries: list, tokens: int) -> dict:
    """Decode tokens/s of one request (the engine's own predicted_per_second: after the first token) and
    of four at once (all generated tokens / wall time from submitting them, prompts included), with every
    base layout built first (the warm-up, then wait_for_programs: no compile inside what is timed); each
    workload three times, the best kept."""
    out = []
    for devices, split, *extra in entries:
        eng = engine(path, devices, split, warmup=True, **(extra[0] if extra else {}))
        one, four = [], []
        try:
            eng.wait_for_programs()
            for rep in range(4):                # the first pass: any layout the warm-up left out gets built
                done = eng.generate(PROMPT, max_tokens=tokens, temperature=0.0, ignore_eos=True)
                t0 = time.perf_counter()
                hs = [eng.submit([rep + 1, *OTHER, *PROMPT[i:]], max_tokens=tokens, temperature=0.0,
                                 ignore_eos=True) for i in range(4)]
                n = sum(sum(ev.kind == "token" for ev in h) for h in hs)
                wall = time.perf_counter() - t0
                eng.wait_for_programs()
                if rep:
                    one.append(done.stats["predicted_per_second"])
                    four.append(n / wall)
        finally:
            eng.close()
        out.append({"devices": devices, "split": split, **(extra[0] if extra else {}),
                    "one_tok_s": round(max(one), 1), "four_tok_s": round(max(four), 1),
                    "runs_one": [round(x, 1) for x in one], "runs_four": [round(x, 1) for x in four]})
    return {"results": out}


def run_kernels(iters: int) -> dict:
    """The cpu kernels called from every device's thread at once (their own spin pool: one caller holds
    its helpers, the others run alone): each device multiplies its own rows (a product large enough to use
    the helpers, and a small one) `iters` times in one program over all devices; every result must be the
    bits of the same product run alone on one device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import pallas_kernels as pk
    from pallas_kernels.random_blocks import random_blocks

    n = len(jax.devices())
    rng = np.random.default_rng(0)
    w = jnp.asarray(random_blocks("Q8_0", (512, 256), rng))                      # [n_out, k] as blocks
    x = jnp.asarray(rng.standard_normal((n, 64, 256), np.float32))              # each device its own rows

    def body(x):                                # x [1, 64, 256]: this device's rows
        def step(i, acc):                       # inputs that change each time: nothing to hoist out of the loop
            xi = x[0] + acc[:, :256] * 1e-3 + i.astype(jnp.float32)
            return acc + pk.qmatmul(xi, w, "Q8_0", backend="cpu") + pk.qmatmul(xi[:2], w, "Q8_0",
                                                                               backend="cpu").sum(0)
        return jax.lax.fori_loop(0, iters, step, jnp.zeros((64, 512), jnp.float32))[None]

    mesh = Mesh(np.array(jax.devices()), ("d",))
    spread = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"), check_vma=False))
    xs, one = jax.device_put(x, NamedSharding(mesh, P("d"))), jax.jit(body)
    np.asarray(spread(xs)), np.asarray(one(x[:1]))                              # built
    t0 = time.perf_counter()
    got = np.asarray(spread(xs))
    t1 = time.perf_counter()
    alone = np.stack([np.asarray(one(x[i:i + 1]))[0] for i in range(n)])
    t2 = time.perf_counter()
    return {"results": {"devices": n, "bits_equal": bool(np.array_equal(got, alone)),
                        "together_s": round(t1 - t0, 3), "one_after_another_s": round(t2 - t1, 3)}}


def run_errors(path: str, configs: list) -> dict:
    out = []
    for extra in configs:
        try:
            engine(path, **extra).close()
            out.append(None)
        except ConfigError as e:
            out.append(str(e))
    return {"results": out}


if __name__ == "__main__":
    mode, model, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    if mode == "check":
        res = run_check(model, spec)
    elif mode == "errors":
        res = run_errors(model, spec)
    elif mode == "kernels":
        res = run_kernels(int(spec))
    else:
        res = run_bench(model, spec, int(sys.argv[4]) if len(sys.argv) > 4 else 32)
    print(json.dumps(res, default=lambda a: a.tolist() if hasattr(a, "tolist") else str(a)))
