"""Make Engines of every mode, get an answer from each, and exit WITHOUT close(): the interpreter's
exit must end every thread they started (issue 32, finding 7: SIGABRT, "terminate called after
throwing an instance of '' / FATAL: exception not rethrown", exit 134).

    python scripts/exit_without_close.py FOLDER   (tiny models and a compile cache are made in
                                                  FOLDER)
        -> prints "answers: {mode: tokens, ...}" and exits 0; tests/test_hardening_engine.py runs it

Modes, each with the default warm-up (its builder thread still compiling when the script exits):
expert tiers with a tiny resident budget (most experts read from the file by the reader pool's
threads), a draft model, EngineCore stepped by hand (no engine thread) over layer-stepped windows
(--layer-step always) of the expert tiers, and --devices 2 with either split in a child process
whose XLA_FLAGS force four host devices (its own exit is checked the same way: its status is this
script's). The child runs first, so that this process exits just after its own engines answered.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

MOE = {"arch": "qwen3moe", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 8,
       "experts_used": 2, "expert_ffn": 32}
DENSE = {"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2}
BASE = {"parallel": 2, "max_context": 64, "prefill": 16}
PROMPT = [5, 17, 42, 7, 99, 3, 250, 11]
FORCED = "--xla_force_host_platform_device_count=4"


def model(folder: Path, name: str, options: dict) -> str:
    from strata_jax.makers.make_model import make_model

    path = folder / name / "model.gguf"
    return str(path if path.exists() else make_model(path, **options)[0])


def answer(eng) -> list[int]:
    return eng.generate(PROMPT, max_tokens=4, temperature=0.0, ignore_eos=True).tokens


def main(folder: Path) -> int:
    from strata_jax import Engine, EngineConfig
    from strata_jax.engine.core import EngineCore
    from strata_jax.gguf import GGUFModel

    moe, dense = model(folder, "moe", MOE), model(folder, "dense", DENSE)
    # every engine stays referenced and open until the interpreter exits
    kept, answers = [], {}
    # the child first, so that this process exits just after its own engines answered, their builder
    # threads still compiling the warm-up's queued layouts (the case that aborted)
    child = subprocess.run([sys.executable, __file__, "--devices", str(folder)],
                           capture_output=True, text=True,
                           env=dict(os.environ, XLA_FLAGS=FORCED, JAX_PLATFORMS="cpu"), timeout=600,
                           check=False)
    sys.stderr.write(child.stderr)
    if child.returncode != 0:
        print(f"the --devices child exited with status {child.returncode}", file=sys.stderr)
        return child.returncode if child.returncode > 0 else 128 - child.returncode
    answers["devices"] = child.stdout.strip().splitlines()[-1]
    # the case: tiers with a tiny resident budget, --host-experts and --layer-step as
    # default
    modes = {
        "tiers": (moe, {"expert_cache": 2, "resident_budget_gib": 0.001}),
        "draft": (dense, {"spec": 3, "drafter": f"draft:{dense}", "spec_min_p": 0.0}),
    }
    for name, (path, extra) in modes.items():
        eng = Engine.from_gguf(path, EngineConfig(**BASE, **extra))
        kept.append(eng)
        answers[name] = answer(eng)
    # EngineCore stepped by hand (no engine thread) over layer-stepped windows of the expert tiers
    stepped = {"expert_cache": 2, "resident_budget_gib": 0.001, "host_experts": "off",
               "layer_step": "always"}
    core = EngineCore(GGUFModel.open(moe), EngineConfig(**BASE, **stepped))
    kept.append(core)
    req = core.make_request(PROMPT, max_tokens=3, ignore_eos=True)
    core.add(req)
    events: list = []
    # a window waits while the builder thread compiles
    while not any(ev.kind == "final" for ev in events):
        events += core.step()
        time.sleep(0 if core.stepped else 0.02)
    answers["stepped"] = [ev.token for ev in events if ev.kind == "token"]
    print("answers:", answers, flush=True)
    # no close(): the interpreter's exit must end every thread
    return 0


def devices(folder: Path) -> int:
    from strata_jax import Engine, EngineConfig

    kept, out = [], {}
    for split, path in (("experts", model(folder, "moe", MOE)),
                        ("layers", model(folder, "dense", DENSE))):
        eng = Engine.from_gguf(path, EngineConfig(**BASE, devices=2, split=split))
        kept.append(eng)
        out[split] = answer(eng)
    print(out, flush=True)
    return 0


if __name__ == "__main__":
    # a compile cache of the folder's own: a fresh folder compiles everything, so the builder
    # threads are surely compiling when the script exits (with a warm cache they may have loaded
    # every program by then)
    os.environ["STRATA_JAX_COMPILE_CACHE"] = str(Path(sys.argv[-1]) / "compile-cache")
    if sys.argv[1] == "--devices":
        sys.exit(devices(Path(sys.argv[2])))
    sys.exit(main(Path(sys.argv[1])))
