"""`strata-jax bench`: prefill and decode speed on the engine, optionally against llama.cpp
(strata_jax/bench/)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

Subparsers = Any  # argparse's _SubParsersAction


def add_bench(sub: Subparsers) -> None:
    from strata_jax.cli_flags import add_engine_flags

    p = sub.add_parser("bench",
                       help="measure prefill and decode speed (optionally against llama.cpp)",
                                   description="Measure MODEL (default: SmolLM2) on the engine, "
                                   "without HTTP: prefill tokens/s (one request reading "
                                   "--prompt-tokens) and decode tokens/s (total and per sequence) "
                                   "with each count of --parallel-list sequences at once, each "
                                   "after a warm-up run so that program builds are not timed. With "
                                   "--vs llama.cpp, the same measurements with llama-cpp-python on "
                                   "the same GGUF and their ratio. Also this machine's memory "
                                   "bandwidth and the decode speed it bounds for one sequence.")
    p.add_argument("model", nargs="?",
                   help="a .gguf file (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("--prompt-tokens", type=int, default=512, metavar="N",
                   help="prefill prompt length (default 512)")
    p.add_argument("--decode-tokens", type=int, default=64, metavar="N",
                   help="tokens each sequence generates (default 64)")
    p.add_argument("--decode-prompt-tokens", type=int, default=32, metavar="N",
                   help="each decoding sequence's prompt (default 32)")
    p.add_argument("--parallel-list", default="1,4,8", metavar="N,N,...",
                   help="sequences decoding at once, one figure each (default 1,4,8)")
    p.add_argument("--vs", choices=["llama.cpp"],
                   help="measure llama.cpp (llama-cpp-python) on the same GGUF too")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, metavar="N",
                   help="cores for both engines (llama.cpp's threads; ours: the process is pinned "
                        "to N cores) (default: all)")
    p.add_argument("--repeat", type=int, default=1, metavar="N",
                   help="measured runs a figure, best kept (default 1)")
    p.add_argument("--bandwidth-gib", type=float, default=1.0, metavar="G",
                   help="size of the array memory bandwidth is measured on (default 1 GiB)")
    p.add_argument("--moe-twin", metavar="E:K",
                   help="bench a MoE twin of the dense MODEL instead (E experts, top-K, made by "
                        "`strata-jax upcycle` and kept in <cache folder>/twins, made again when "
                        "MODEL changes): both engines read the twin (default off)")
    p.add_argument("--json", metavar="FILE", help="write every figure to FILE as JSON")
    add_engine_flags(p)
    # the slots come from --parallel-list: --parallel is refused, so not shown
    for action in p._actions:
        if action.dest == "parallel":
            action.help = argparse.SUPPRESS
    p.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    from strata_jax.bench import BenchOptions
    from strata_jax.bench import run_bench as bench
    from strata_jax.bench.report import render
    from strata_jax.bench.run import write_json
    from strata_jax.bench.twin import parse_moe_twin
    from strata_jax.cli_flags import engine_config
    from strata_jax.fetch import smollm2_path

    try:
        parallel = tuple(int(n) for n in args.parallel_list.split(","))
    except ValueError:
        raise ValueError(f"--parallel-list {args.parallel_list!r}: must be whole numbers separated "
                         "by commas") from None
    if hasattr(args, "parallel"):     # engine flags are only set on args when given
        raise ValueError("bench takes the number of sequences from --parallel-list, not --parallel")
    twin = parse_moe_twin(args.moe_twin) if args.moe_twin is not None else None
    opts = BenchOptions(model=args.model or str(smollm2_path()), prompt_tokens=args.prompt_tokens,
                        decode_tokens=args.decode_tokens,
                        decode_prompt_tokens=args.decode_prompt_tokens, parallel_list=parallel,
                        vs=args.vs, threads=args.threads, repeat=args.repeat,
                        engine=engine_config(args), max_context=getattr(args, "max_context", None),
                        bandwidth_gib=args.bandwidth_gib, moe_twin=twin)
    # not a log line for every request
    logging.getLogger("strata_jax.engine").setLevel(logging.WARNING)
    result = bench(opts, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(render(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0
