"""Decode speed of one request on any GGUF (issue 36: a model larger than RAM), with the memory
figures that matter there: the process's RSS (anonymous and file-backed apart) and the page cache.

    python scripts/decode_once.py MODEL.gguf [--tokens 16] [--prompt-tokens 32] [engine flags...]

Prints one JSON line: load seconds, time to first token, decode tok/s over the rest, RSS, the
engine's expert stats. Random-weight models (make-model --shape) answer noise: the prompt is token
ids and EOS is ignored.
"""

from __future__ import annotations

import argparse
import json
import time


def _fields(path: str) -> dict[str, str]:
    with open(path) as f:
        return dict(line.split(":", 1) for line in f if ":" in line)


def memory() -> dict:
    status, info = _fields("/proc/self/status"), _fields("/proc/meminfo")

    def mib(s: str) -> int:                             # "123 kB" -> MiB
        return int(s.split()[0]) // 1024
    return {"rss_mib": mib(status["VmRSS"]), "rss_anon_mib": mib(status["RssAnon"]),
            "rss_file_mib": mib(status["RssFile"]), "page_cache_mib": mib(info["Cached"]),
            "available_mib": mib(info["MemAvailable"])}


def main() -> None:
    from strata_jax.cli_flags import add_engine_flags, engine_config
    from strata_jax.engine import Engine

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=32)
    add_engine_flags(p)
    args = p.parse_args()
    t0 = time.monotonic()
    with Engine.from_gguf(args.model, engine_config(args)) as eng:
        loaded = time.monotonic() - t0
        ids = [(7 * i + 11) % 1000 + 300 for i in range(args.prompt_tokens)]
        times = []
        start = time.monotonic()
        for ev in eng.submit(ids, max_tokens=args.tokens, ignore_eos=True):
            if ev.kind == "token":
                times.append(time.monotonic())
        ttft = times[0] - start
        rate = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
        stats = eng.stats()
    print(json.dumps({"model": args.model, "load_s": round(loaded, 1), "ttft_s": round(ttft, 2),
                      "tokens": len(times), "decode_tok_s": round(rate, 3), **memory(),
                      "experts": stats.get("experts")}))


if __name__ == "__main__":
    main()
