"""--devices N checks and figures, in a process of its own: XLA_FLAGS must force the CPU devices
before JAX starts, so tests/test_devices.py (whose JAX already has one device) runs this as a child.

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python scripts/multi_device.py check MODEL.gguf \\
        '[[1, "auto"], [2, "experts"], [4, "experts"], [2, "layers"], [4, "layers"]]'
        -> one JSON line: per (devices, split) whether the logits are the same bits as the first
           entry's, their largest difference, and whether greedy tokens (alone, and two requests at
               once; gpt-oss: a prompt that wraps its rings too) agree, the prefix cache's KV moves
               and a slot's state (gpt-oss's rings) read and written
    XLA_FLAGS=... python scripts/multi_device.py bench MODEL.gguf '[[1, "auto"], [4, "experts"]]'
        [TOKENS] -> one JSON line: decode tokens/s of one request and of four at once, per entry
    XLA_FLAGS=... python scripts/multi_device.py overlap MODEL.gguf '[[2, 1], [2, 4]]' [WINDOWS]
        -> one JSON line: per (devices, --micro-batches) of the layers split, the order the stage
           programs were dispatched in and in how many windows a later stage finished a part before
               an earlier
           stage finished its last part (the stages computed at once)
    XLA_FLAGS=... python scripts/multi_device.py errors MODEL.gguf
        '[{"devices": 3, "split": "experts"}, ...]' -> one JSON line: each
            config's ConfigError message (null: it started)
    XLA_FLAGS=... python scripts/multi_device.py kernels - 200
        -> one JSON line: the cpu kernels called from every device's thread at once give the bits of
            alone
"""  # noqa: E501

from __future__ import annotations

import json
import sys
import time

import numpy as np

from strata_jax import Engine, EngineConfig
from strata_jax.config import ConfigError
from strata_jax.engine.execute.layouts import GroupInput
from strata_jax.engine.execute.sampler import SamplingRows

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 31, 77]
OTHER = [9, 8, 7, 6, 5, 4, 3, 2]
# gpt-oss: a prompt past its rings' entries (the window and a prompt chunk: engine() gives 8 + 16),
# so that every ring wraps
LONG = (PROMPT + OTHER) * 2


def engine(path: str, devices: int = 1, split: str = "auto", **extra) -> Engine:
    cfg = {"parallel": 4, "max_context": 128, "prefill": 16, "warmup": False, "devices": devices,
           "split": split} | extra
    return Engine.from_gguf(path, EngineConfig(**cfg))


def run_check(path: str, entries: list) -> dict:
    out, base = [], None
    # [devices, split(, {more EngineConfig settings})]
    for devices, split, *extra in entries:
        eng = engine(path, devices, split, **(extra[0] if extra else {}))
        try:
            logits = eng.logits(PROMPT)
            cut = cut_window_logits(eng)
            alone = eng.generate(PROMPT, max_tokens=6, temperature=0.0).tokens
            hs = [eng.submit(p, max_tokens=6, temperature=0.0) for p in (PROMPT, OTHER)]
            together = [[ev.token for ev in h if ev.kind == "token"] for h in hs]
            wrapped = (eng.generate(LONG, max_tokens=6, temperature=0.0).tokens if eng.runner.ring
                       else [])
            stats = eng.stats()
            kv = kv_moves(eng)
            state = state_moves(eng)
        finally:
            eng.close()
        res = {"logits": logits, "alone": alone, "together": together, "kv": kv | state.pop("kv"),
               "cut": cut, "wrapped": wrapped}
        base = base or res
        out.append({"devices": devices, "split": split,
                    "bits_equal": bool(np.array_equal(logits, base["logits"])),
                    "max_diff": float(np.max(np.abs(logits - base["logits"]))),
                    "cut_bits_equal": all(np.array_equal(a, b) for a, b in zip(cut, base["cut"])),
                    "cut_max_diff": max(float(np.max(np.abs(a - b)))
                                        for a, b in zip(cut, base["cut"])),
                    "parts": parts_of(eng, cut_window(eng)), **(extra[0] if extra else {}),
                    "tokens_equal": (alone == base["alone"] and together == base["together"]
                                     and wrapped == base["wrapped"]),
                    "kv_equal": all(np.array_equal(res["kv"][k], base["kv"][k])
                                    for k in res["kv"]),
                    "alone": alone, "together": together, "wrapped": wrapped, **state,
                    "runner": stats.get("devices"),
                    "programs": [{k: p[k] for k in ("live", "evicted", "oom_recoveries")}
                                 for p in stats["programs"].get("devices", [stats["programs"]])],
                    "memory": stats["memory"]})
    return {"results": out}


def cut_window(eng: Engine) -> list[GroupInput]:
    """A window of two prompts read at once (PROMPT in slot 0, OTHER in slot 1), with the logits of
    every token: packed (one group of 20 tokens in 32 rows, 32 picks: the real tokens', then
    padding) where the backend packs, else a group each; so the layers split cuts it into
    micro-batches (a prompt across two)."""
    if eng.runner.packed:
        toks, pos = np.zeros((32, 1), np.int32), np.full((32, 1), -1, np.int32)
        toks[:20, 0], pos[:20, 0] = PROMPT + OTHER, list(range(12)) + list(range(8))
        slots = np.array([0] * 12 + [1] * 8 + [0] * 12, np.int32)
        picks = np.array(list(range(20)) + [0] * 12, np.int32)
        return [GroupInput(toks, pos, slots, SamplingRows.greedy(32), picks=picks)]
    out = []
    for slot, ids in enumerate((PROMPT, OTHER)):
        toks, pos = np.zeros((1, 16), np.int32), np.full((1, 16), -1, np.int32)
        toks[0, :len(ids)], pos[0, :len(ids)] = ids, np.arange(len(ids))
        out.append(GroupInput(toks, pos, np.array([slot], np.int32), SamplingRows.greedy(1),
                              all_logits=True))
    return out


def cut_window_logits(eng: Engine) -> list[np.ndarray]:
    """cut_window's logits per group, read on a scratch KV cache between windows (the engine is
    idle)."""
    with eng.runner.scratch_kv():
        return [np.asarray(x) for x in eng.runner.forward_logits(cut_window(eng), 16)]


def parts_of(eng: Engine, groups: list[GroupInput]) -> int:
    """The parts (micro-batches) a window of these groups runs as: 1 without the layers split."""
    pipe = eng.runner.pipeline
    return 1 if pipe is None else len(pipe.cut(eng.runner.layout_of(groups, 16)).parts)


def kv_moves(eng: Engine) -> dict[str, np.ndarray]:
    """The KV cache's moves the prefix cache makes (KVCache.read, write, copy: per stage with
    --split layers), between windows on the engine thread's idle slots 2 and 3 -> what each left in
    slot 3."""
    kv, out = eng.runner.kv, {}
    block = kv.read(0, 0, 16)                               # slot 0 holds PROMPT's KV
    kv.write(3, 0, block)
    out["written"] = kv.slot(3, 16)["k"]
    kv.copy(1, 3, 1, 16)                                    # slot 1: OTHER's
    out["copied"] = kv.slot(3, 16)["k"]
    out["read"] = block["k"]
    return out


def state_moves(eng: Engine) -> dict:
    """A slot's fixed-size state (gpt-oss's rings; what a state checkpoint keeps: KVCache's
    read_state, write_state, per stage with --split layers), between windows: slot 0's read, written
    into idle slot 3 and read back -> {"kv": {"state_<name>": slot 0's}, "state_round_trip": slot
    3's is the same, "state_layers": {name: each stage's layers of it}}; {} parts for a family
    without one."""
    kv = eng.runner.kv
    parts = kv.arrays if isinstance(kv.arrays, tuple) else [kv.arrays]       # a stage's each
    state = kv.read_state(0)
    if state:
        kv.write_state(3, state)
    back = kv.read_state(3)
    return {"kv": {f"state_{k}": v for k, v in state.items()},
            "state_round_trip": all(np.array_equal(back[k], v) for k, v in state.items()),
            "state_layers": {k: [int(p[k].shape[0]) for p in parts if k in p]
                             for k in state}}


def run_bench(path: str, entries: list, tokens: int) -> dict:
    """Decode tokens/s of one request (the engine's own predicted_per_second: after the first token)
    and of four at once (all generated tokens / wall time from submitting them, prompts included),
    with every base layout built first (the warm-up, then wait_for_programs: no compile inside what
    is timed); each workload three times, the best kept."""
    out = []
    for devices, split, *extra in entries:
        eng = engine(path, devices, split, warmup=True, **(extra[0] if extra else {}))
        one, four = [], []
        try:
            eng.wait_for_programs()
            # the first pass: any layout the warm-up left out gets built
            for rep in range(4):
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
            read = []
            # prompt reading: four 96-token prompts at once, one token each
            for rep in range(3):
                t0 = time.perf_counter()
                hs = [eng.submit([(rep * 4 + i) % 200 + 1, *(PROMPT * 8)[:95]], max_tokens=1,
                                 temperature=0.0)
                      for i in range(4)]
                for h in hs:
                    list(h)
                read.append(4 * 96 / (time.perf_counter() - t0))
                eng.wait_for_programs()
        finally:
            eng.close()
        out.append({"devices": devices, "split": split, **(extra[0] if extra else {}),
                    "one_tok_s": round(max(one), 1), "four_tok_s": round(max(four), 1),
                    "read_tok_s": round(max(read[1:]), 1), "runs_read": [round(x, 1) for x in read],
                    "runs_one": [round(x, 1) for x in one],
                    "runs_four": [round(x, 1) for x in four]})
    return {"results": out}


def run_kernels(iters: int) -> dict:
    """The cpu kernels called from every device's thread at once (their own spin pool: one caller
    holds its helpers, the others run alone): each device multiplies its own rows (a product large
    enough to use the helpers, and a small one) `iters` times in one program over all devices; every
    result must be the bits of the same product run alone on one device."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    import pallas_kernels as pk
    from pallas_kernels.random_blocks import random_blocks

    n = len(jax.devices())
    rng = np.random.default_rng(0)
    # [n_out, k] as blocks
    w = jnp.asarray(random_blocks("Q8_0", (512, 256), rng))
    # each device its own rows
    x = jnp.asarray(rng.standard_normal((n, 64, 256), np.float32))

    def body(x):                                # x [1, 64, 256]: this device's rows
        # inputs that change each time: nothing to hoist out of the loop
        def step(i, acc):
            xi = x[0] + acc[:, :256] * 1e-3 + i.astype(jnp.float32)
            return acc + pk.qmatmul(xi, w, "Q8_0", backend="cpu") + pk.qmatmul(xi[:2], w, "Q8_0",
                                                                               backend="cpu").sum(0)
        return jax.lax.fori_loop(0, iters, step, jnp.zeros((64, 512), jnp.float32))[None]

    mesh = Mesh(np.array(jax.devices()), ("d",))
    spread = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("d"), out_specs=P("d"),
                                   check_vma=False))
    xs, one = jax.device_put(x, NamedSharding(mesh, P("d"))), jax.jit(body)
    np.asarray(spread(xs)), np.asarray(one(x[:1]))                              # built
    t0 = time.perf_counter()
    got = np.asarray(spread(xs))
    t1 = time.perf_counter()
    alone = np.stack([np.asarray(one(x[i:i + 1]))[0] for i in range(n)])
    t2 = time.perf_counter()
    return {"results": {"devices": n, "bits_equal": bool(np.array_equal(got, alone)),
                        "together_s": round(t1 - t0, 3), "one_after_another_s": round(t2 - t1, 3)}}


def run_overlap(path: str, entries: list, windows: int) -> dict:
    """Whether the stages compute at once: each window (four 16-token prompts read together, packed)
    is dispatched whole, then the host sweeps over every (stage, part) program's outputs, later
    stages first, and notes the sweep in which each is ready. A stage s + 1 part ready in an earlier
    sweep than stage s's last part means device s + 1 finished a part while device s still computed:
    impossible with one part a window (the old chain: stage s + 1 starts after all of stage s's
    work), and never a false sign from the poller being descheduled, since within a sweep an earlier
    stage is checked after a later one."""
    out = []
    for devices, micro in entries:
        eng = engine(path, devices, "layers", micro_batches=micro, batch_tokens=64)
        pipe, runner = eng.runner.pipeline, eng.runner
        toks, pos = np.zeros((64, 1), np.int32), np.full((64, 1), -1, np.int32)
        for i in range(4):
            toks[16 * i:16 * i + 16, 0], pos[16 * i:16 * i + 16, 0] = (OTHER + PROMPT[:8],
                                                                       np.arange(16))
        group = GroupInput(toks, pos, np.repeat(np.arange(4, dtype=np.int32), 16),
                           SamplingRows.greedy(4), picks=np.array([15, 31, 47, 63], np.int32))
        overlapped, order, pending = 0, [], []
        try:
            with runner.scratch_kv():
                np.asarray(runner.forward_logits([group], 16)[0])          # built
                for _ in range(windows):
                    seen: list = []
                    pipe.on_dispatch = lambda s, p, xs, seen=seen: seen.append((s, p, xs))
                    runner.forward_logits([group], 16)
                    pipe.on_dispatch = None
                    order = [(s, p) for s, p, _ in seen]
                    ready: dict = {}
                    pending.append(sum(not all(x.is_ready() for x in xs) for _, _, xs in seen))
                    # each sweep checks the later stages first: a part seen ready before an earlier
                    # stage's part in the same sweep was really so
                    sweep = 0
                    while len(ready) < len(seen):
                        sweep += 1
                        for s, p, xs in reversed(seen):
                            if (s, p) not in ready and all(x.is_ready() for x in xs):
                                ready[s, p] = sweep
                    last = max(p for _, p in order)
                    overlapped += any(ready[s + 1, p] < ready[s, last] for s, p in order
                                      if (s + 1, p) in ready)
        finally:
            eng.close()
        out.append({"devices": devices, "micro_batches": micro, "order": order,
                    "overlapped": overlapped, "windows": windows,
                    "pending_after_dispatch": pending})
    return {"results": out}


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
    elif mode == "overlap":
        res = run_overlap(model, spec, int(sys.argv[4]) if len(sys.argv) > 4 else 20)
    elif mode == "kernels":
        res = run_kernels(int(spec))
    else:
        res = run_bench(model, spec, int(sys.argv[4]) if len(sys.argv) > 4 else 32)
    print(json.dumps(res, default=lambda a: a.tolist() if hasattr(a, "tolist") else str(a)))
