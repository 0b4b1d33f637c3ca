"""Issue 33 item 5: how far the int8 path's next-token distributions sit from the exact path's,
beside llama.cpp's.

For each model (default: SmolLM2-135M-Instruct Q4_1 and its 8-expert top-2 twin, made as `strata-jax
bench --moe-twin 8:2` makes it), over --positions positions of real English text read in windows of
--chunk tokens (each window is BOS and then chunk - 1 tokens of the text; every window's logits rows
count, BOS's included):

- exact:     `Engine.logits` with EngineConfig(cpu_math="exact"): weights dequantized, float32
  products (the oracle);
- int8:      the same with cpu_math="int8": activations quantized per block, integer dot products;
- llama.cpp: llama-cpp-python's logits for the same ids (logits_all, a fresh KV cache a window).

Against the exact path, for int8 and for llama.cpp: the mean over positions of KL(exact ||
candidate) (natural log, softmaxes in float64), top-1 agreement (the two argmaxes equal), and each
side's perplexity of the text's next tokens (the last row of a window has no next token and is left
out of that one figure only). Then int8 against llama.cpp, position by position (both against the
same exact rows): the mean KL ratio with a 95% interval and the top-1 difference with its standard
error, over blocks of --block consecutive positions (the JSON's paired_with_llama_cpp): whether
the two can be told apart on this text at all.

The text: Python's own `pydoc_data.topics` (the language reference's help topics: English prose with
grammar and code), fixed for a Python version; the topics in sorted order joined by blank lines.
Windows start at paragraph starts spread evenly over it. The JSON records the Python version and the
text's sha256 (and the windows' token ids' sha256), so a rerun elsewhere can tell whether it read
the same text. --text FILE reads another file instead.

llama.cpp runs in a child process of its own (as in `strata-jax bench` and the tests: its OpenMP
runtime beside another in one process can crash it). --llama-cpp-path DIR puts DIR first on that
child's PYTHONPATH, to measure another build (e.g. one made with -DGGML_NATIVE=OFF
-DGGML_AVX2=ON ... -DGGML_AVX512=OFF into `pip install --target DIR`); the JSON records its
llama_print_system_info() line and where it was loaded from. Its KV cache is F32 by default, as ours
is on a CPU, so the comparison is of the products alone; --llama-kv f16 gives llama.cpp's default
cache.

    python scripts/accuracy_int8.py --out docs/results/accuracy-int8.json
    python scripts/accuracy_int8.py --model m.gguf --positions 256 --chunk 128 --llama-cpp-path
        /work/llama_avx2

Memory: each window's logits go to a temporary folder as they come (a 512-token window of a
49,152-token vocab is 100 MB in float32), one engine is alive at a time, and the comparison reads a
window at a time.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import hashlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# logits rows turned to float64 together (bounds the comparison's memory)
ROWS_AT_ONCE = 128

# The llama.cpp side, run as `python -c _CHILD ARGS_JSON`; prints one JSON line with what it was.
_CHILD = r"""
import json, sys, time
import numpy as np
import llama_cpp
a = json.loads(sys.argv[1])
windows = json.loads(open(a["windows"]).read())
kv = {"f32": llama_cpp.GGML_TYPE_F32, "f16": llama_cpp.GGML_TYPE_F16}[a["kv"]]
llm = llama_cpp.Llama(a["model"], n_ctx=a["n_ctx"], n_batch=a["n_ctx"], n_ubatch=min(a["n_ctx"], 512),
                      logits_all=True, n_threads=a["threads"], n_threads_batch=a["threads"], n_gpu_layers=0,
                      type_k=kv, type_v=kv, verbose=False)
t = time.perf_counter()
for i, ids in enumerate(windows):
    llm.reset()                      # a fresh sequence: position 0, nothing of the last window in the KV
    llm.eval(ids)
    np.save(f"{a['out']}/{i}.npy", np.array(llm.scores[: len(ids)], dtype=np.float32))
seconds = time.perf_counter() - t
info = llama_cpp.llama_print_system_info()
print(json.dumps({"system_info": info.decode() if isinstance(info, bytes) else str(info),
                  "version": llama_cpp.__version__, "module": llama_cpp.__file__, "seconds": seconds}))
llm.close()
"""  # noqa: E501


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--model", action="append", metavar="PATH",
                   help="a GGUF file (repeatable); default: SmolLM2 (`strata-jax fetch-model "
                        "smollm2`) and its 8-expert top-2 twin (made once into the cache folder's "
                        "twins/)")
    p.add_argument("--positions", type=int, default=2048,
                   help="logits rows compared a model (default 2048)")
    p.add_argument("--chunk", type=int, default=512,
                   help="tokens a window, BOS included (default 512)")
    p.add_argument("--block", type=int, default=64,
                   help="consecutive positions a block for the paired comparison's standard "
                        "errors (default 64)")
    p.add_argument("--text", metavar="FILE",
                   help="read this UTF-8 text instead of Python's pydoc_data.topics")
    p.add_argument("--llama-cpp-path", metavar="DIR",
                   help="first on llama.cpp's child's PYTHONPATH (a `pip install --target DIR` "
                        "build); default: the llama_cpp this Python imports")
    p.add_argument("--llama-kv", choices=("f32", "f16"), default="f32",
                   help="llama.cpp's KV cache type (default f32, as ours on a CPU; f16 is "
                        "llama.cpp's default)")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's threads (default 2)")
    p.add_argument("--out", metavar="FILE",
                   help="write the rows and the run's details as JSON here")
    a = p.parse_args(argv)
    if not 16 <= a.chunk <= 1 << 16:
        p.error(f"--chunk {a.chunk}: must be 16 to 65536 tokens")
    if a.positions < 1:
        p.error(f"--positions {a.positions}: must be at least 1")
    if not 1 <= a.block <= a.positions // 2:
        p.error(f"--block {a.block}: must be 1 to half of --positions ({a.positions // 2}), so "
                "that there are at least two blocks")
    if a.threads < 1:
        p.error(f"--threads {a.threads}: must be at least 1")
    if a.llama_cpp_path and not Path(a.llama_cpp_path, "llama_cpp").is_dir():
        p.error(f"--llama-cpp-path {a.llama_cpp_path}: has no llama_cpp package folder; give the "
                "folder that `pip install --target DIR llama-cpp-python` filled")
    for m in a.model or []:
        if not Path(m).is_file():
            p.error(f"--model {m}: no such file")
    return a


def default_models() -> list[Path]:
    from strata_jax.bench.twin import make_twin
    from strata_jax.fetch import smollm2_path

    smol = smollm2_path()
    twin, _ = make_twin(smol, 8, 2, progress=lambda line: print(line, file=sys.stderr))
    return [smol, twin]


# ---- the text and its windows --------------------------------------------------------------------

def load_text(path: str | None) -> tuple[str, dict]:
    if path:
        text = Path(path).read_text(encoding="utf-8")
        source = {"source": str(Path(path).resolve())}
    else:
        from pydoc_data.topics import topics

        text = "\n\n".join(topics[k] for k in sorted(topics))
        source = {"source": f"pydoc_data.topics of Python {platform.python_version()} (topics in "
                            "sorted order, joined by blank lines)"}
    return text, {**source, "chars": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()}


def make_windows(tokenizer, text: str, positions: int, chunk: int) -> list[list[int]]:
    """ceil(positions / chunk) windows, the last one cut to make `positions` rows in all; each BOS
    and then the text's tokens from a paragraph start, the starts spread evenly over the text."""
    if tokenizer.bos_id is None:
        raise SystemExit("the model's vocabulary has no BOS token; the windows start at BOS")
    sizes = [chunk] * (positions // chunk) + ([positions % chunk] if positions % chunk else [])
    windows = []
    short = SystemExit(f"the text ({len(text):,} characters) is too short for {len(sizes)} windows "
                       f"of {chunk} tokens: give fewer --positions or a longer --text")
    for i, size in enumerate(sizes):
        at = len(text) * i // len(sizes)
        if at:
            at = text.find("\n\n", at) + 2                     # the next paragraph's start
            if at == 1:
                raise short
        # > 1 character a token, with room to spare
        piece = text[at:at + 12 * size]
        ids = tokenizer.encode(piece, add_special=False, parse_special=False)[:size - 1]
        if len(ids) < size - 1:
            raise short
        windows.append([tokenizer.bos_id, *ids])
    return windows


# ---- the three sources of logits, each writing <folder>/<window>.npy -----------------------------

def our_logits(model: Path, windows: list[list[int]], math: str, folder: Path) -> dict:
    from strata_jax import Engine, EngineConfig

    if "cpu_math" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        raise SystemExit("EngineConfig has no cpu_math field in this checkout (issue 33 item 4 is "
                         "not in yet), so the exact and int8 paths cannot be told apart: update "
                         "the checkout")
    folder.mkdir()
    config = EngineConfig(cpu_math=math, max_context=max(len(w) for w in windows), parallel=1,
                          warmup=False)
    t = time.perf_counter()
    with Engine.from_gguf(model, config) as eng:
        choices = {k: str(v) for k, v in eng.runner.choices.items()}
        for i, ids in enumerate(windows):
            np.save(folder / f"{i}.npy", np.asarray(eng.logits(ids), np.float32))
    seconds = time.perf_counter() - t
    del eng
    gc.collect()                    # the engine's weights and KV go before the next one loads
    return {"engine": choices, "seconds": round(seconds, 1)}


def llamacpp_logits(model: Path, windows: list[list[int]], folder: Path, args) -> dict:
    folder.mkdir()
    ids_file = folder / "windows.json"
    ids_file.write_text(json.dumps(windows))
    env = dict(os.environ)
    if args.llama_cpp_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(args.llama_cpp_path).resolve()),
                                                        env.get("PYTHONPATH")) if p)
    child_args = {"model": str(model), "windows": str(ids_file), "out": str(folder),
                  "threads": args.threads,
                  "n_ctx": max(len(w) for w in windows), "kv": args.llama_kv}
    done = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(child_args)], env=env,
                          capture_output=True, text=True, timeout=3600, check=False)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp failed on {model} (exit code {done.returncode}; a negative "
                         "code is the signal, -4 an illegal instruction: a build for another "
                         f"CPU):\n{done.stderr[-3000:]}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    return {**info, "seconds": round(info["seconds"], 1), "kv": args.llama_kv,
            "threads": args.threads, "build": build_label(info["system_info"], args.llama_cpp_path)}


def build_label(system_info: str, path: str | None) -> str:
    """'AVX2 = 1 | AVX512 = 0 | ...' -> 'AVX2, AVX512, AVX512_VNNI (site-packages)': the SIMD levels
    on."""
    on = [k.strip() for k, _, v in (part.partition("=") for part in system_info.split("|"))
          if v.strip() == "1" and k.strip().startswith(("AVX", "AMX"))]
    return f"{', '.join(on) or 'no AVX'} ({path or 'site-packages'})"


# ---- the figures ---------------------------------------------------------------------------------

def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare(exact: Path, other: Path, windows: list[list[int]]) -> tuple[dict, dict]:
    """Mean KL(exact || other), top-1 agreement, and both sides' perplexity of the next tokens;
    and each position's KL and agreement (for the paired comparison, not written out)."""
    nll = {"exact": 0.0, "other": 0.0}
    targets = 0
    each = {"kl": [], "agree": []}
    for i, ids in enumerate(windows):
        a, b = (np.load(exact / f"{i}.npy", mmap_mode="r"),
                np.load(other / f"{i}.npy", mmap_mode="r"))
        if a.shape != b.shape or a.shape[0] != len(ids):
            raise SystemExit(f"window {i}: logits of shape {a.shape} against {b.shape} for "
                             f"{len(ids)} tokens; the two sides must give a row of the same "
                             "vocabulary for every token")
        for s in range(0, len(ids), ROWS_AT_ONCE):
            la, lb = log_softmax(a[s:s + ROWS_AT_ONCE]), log_softmax(b[s:s + ROWS_AT_ONCE])
            if not (np.isfinite(la).all() and np.isfinite(lb).all()):
                raise SystemExit(f"window {i}, rows {s}..: non-finite logits")
            each["kl"].append((np.exp(la) * (la - lb)).sum(axis=-1))
            each["agree"].append(la.argmax(-1) == lb.argmax(-1))
            # the text's next tokens, where there are
            nxt = np.array(ids[s + 1:s + 1 + la.shape[0]])
            n = len(nxt)
            nll["exact"] -= float(la[np.arange(n), nxt].sum())
            nll["other"] -= float(lb[np.arange(n), nxt].sum())
            targets += n
    each = {k: np.concatenate(v) for k, v in each.items()}
    return ({"positions": len(each["kl"]), "mean_kl": float(each["kl"].mean()),
             "top1_agreement": float(each["agree"].mean()),
             "ppl_exact": float(np.exp(nll["exact"] / targets)),
             "ppl": float(np.exp(nll["other"] / targets))}, each)


def paired(a: dict, b: dict, block: int) -> dict:
    """a minus b over the same positions (int8 against llama.cpp, both against the exact path): the
    mean difference of KL and of top-1 agreement, each with its standard error over blocks of
    `block` consecutive positions (neighbouring positions share their context, so they are not
    independent draws; the blocks' means nearly are). The mean KL ratio a / b with the 95% interval
    of the difference (+-1.96 standard errors) turned into ratios: an interval that holds 1.0 means
    the two cannot be told apart on this text."""
    n = len(a["kl"]) // block * block
    out = {"block": block, "blocks": n // block}
    for key in ("kl", "agree"):
        d = (a[key][:n].astype(np.float64) - b[key][:n].astype(np.float64)).reshape(-1, block)
        means = d.mean(axis=1)
        out[f"{key}_diff"] = float(means.mean())
        out[f"{key}_diff_se"] = float(means.std(ddof=1) / np.sqrt(len(means)))
    base = float(b["kl"][:n].mean())
    out["kl_ratio"] = 1 + out["kl_diff"] / base
    out["kl_ratio_95"] = [1 + (out["kl_diff"] + s * 1.96 * out["kl_diff_se"]) / base
                          for s in (-1, 1)]
    return out


def measure(model: Path, text: str, args) -> list[dict]:
    from strata_jax.gguf import GGUFModel, load_tokenizer

    tokenizer = load_tokenizer(GGUFModel.open(model).metadata)
    windows = make_windows(tokenizer, text, args.positions, args.chunk)
    ids_sha = hashlib.sha256(json.dumps(windows).encode()).hexdigest()
    rows = []
    with tempfile.TemporaryDirectory(prefix="accuracy-int8-") as tmp:
        tmp = Path(tmp)
        print(f"{model.name}: {len(windows)} windows, {sum(map(len, windows))} positions",
              file=sys.stderr)
        ran = {"exact": our_logits(model, windows, "exact", tmp / "exact")}
        each = {}
        for name in ("int8", "llama.cpp"):
            ran[name] = (our_logits(model, windows, "int8", tmp / name) if name == "int8"
                         else llamacpp_logits(model, windows, tmp / name, args))
            figures, each[name] = compare(tmp / "exact", tmp / name, windows)
            rows.append({"model": model.name, "model_path": str(model), "candidate": name,
                         **figures,
                         "windows": len(windows), "chunk": args.chunk, "window_ids_sha256": ids_sha,
                         "exact_run": ran["exact"], "run": ran[name]})
            print(table_row(rows[-1]), flush=True)
    int8, llama = rows
    int8["paired_with_llama_cpp"] = pair = paired(each["int8"], each["llama.cpp"], args.block)
    print(f"{model.name}: int8's mean KL is {pair['kl_ratio']:.3f}x llama.cpp's (95%: "
          f"{pair['kl_ratio_95'][0]:.3f}-{pair['kl_ratio_95'][1]:.3f}, {pair['blocks']} blocks of "
          f"{pair['block']} positions); top-1 {100 * int8['top1_agreement']:.2f}% against "
          f"{100 * llama['top1_agreement']:.2f}% (difference {100 * pair['agree_diff']:+.2f} +- "
          f"{100 * pair['agree_diff_se']:.2f} points)", flush=True)
    return rows


TABLE_HEAD = ("| model | candidate | positions | mean KL(exact ‖ candidate) | top-1 agreement | "
              "ppl exact | ppl candidate |\n|---|---|---:|---:|---:|---:|---:|")


def table_row(r: dict) -> str:
    who = (r["candidate"] if r["candidate"] != "llama.cpp"
           else f"llama.cpp {r['run']['version']}, {r['run']['build']}")
    return (f"| {r['model']} | {who} | {r['positions']:,} | {r['mean_kl']:.3e} | "
            f"{100 * r['top1_agreement']:.2f}% | {r['ppl_exact']:.3f} | {r['ppl']:.3f} |")


def main(argv=None) -> int:
    args = parse_args(argv)
    from strata_jax.bench.machine import cpu_model, load_average

    models = [Path(m) for m in args.model] if args.model else default_models()
    text, text_info = load_text(args.text)
    run = {"date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "cpu": cpu_model(),
           "cores": os.cpu_count(), "load_average_at_start": round(load_average() or 0, 2),
           "python": platform.python_version(),
           # a forced kernel level (issue 33 item 3) and the like change what "int8" measures
           "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("STRATA")},
           "text": text_info, "positions": args.positions, "chunk": args.chunk,
           "command": " ".join([Path(sys.argv[0]).name,
                                *(argv if argv is not None else sys.argv[1:])])}
    print(f"{run['date']}, {run['cpu']} ({run['cores']} cores), load {run['load_average_at_start']}"
          f"; text: {text_info['source']}, sha256 {text_info['sha256'][:16]}", flush=True)
    print(TABLE_HEAD, flush=True)
    rows = [r for m in models for r in measure(m, text, args)]
    if args.out:
        Path(args.out).write_text(json.dumps({"run": run, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
