"""The Python parts of scripts/device_check.sh (run from the repository root, PYTHONPATH set by it).

    python3 scripts/device_check.py imports [--need-gpu]     every module the check needs imports;
                                                             versions; with --need-gpu, JAX must see
                                                             a GPU
    python3 scripts/device_check.py expert-bytes MAKE_ARGS   bytes of the experts `make-model
                                                             MAKE_ARGS` writes
    python3 scripts/device_check.py table OUTDIR CACHE EXPERTS MODEL
                                                             the two
                                                                 benches' JSON as one Markdown
                                                                     table,
                                                             printed and written to
                                                                 OUTDIR/results.md
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

NEED = ["numpy", "jax", "jaxlib", "gguf", "yaml", "tokenizers", "jinja2", "pytest", "strata_jax",
        "pallas_kernels", "strata_jax.cli", "strata_jax.bench.run", "strata_jax.engine",
        "pallas_kernels.gpu"]
VERSIONS = ["jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "numpy", "gguf", "triton",
            "tokenizers"]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "-"


def imports(need_gpu: bool) -> int:
    missing = []
    for name in NEED:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 -- any failure to import is what this reports
            missing.append(f"{name} ({type(e).__name__}: {e})")
    if missing:
        print("!!! cannot import: " + "; ".join(missing))
        print("!!! carry the missing packages as wheels in .whl/ (see the head of "
              "scripts/device_check.sh)")
        return 1
    import jax

    print("versions: " + ", ".join(f"{d} {_version(d)}" for d in VERSIONS))
    print(f"jax backend {jax.default_backend()}: {jax.devices()}")
    if need_gpu and jax.default_backend() != "gpu":
        print(f"!!! JAX sees no GPU (backend {jax.default_backend()!r}): the Pallas tests and the "
              "GPU bench cannot run")
        return 1
    return 0


def expert_bytes(args: list[str]) -> int:
    from quant_types import as_qtype, block_size, type_size

    a = dict(zip(args[::2], args[1::2]))
    q = as_qtype(a.get("--expert-quant", a["--quant"]))
    values = (int(a["--layers"]) * int(a["--experts"]) * 3 * int(a["--hidden"])
              * int(a["--expert-ffn"]))
    print(values // block_size(q) * type_size(q))
    return 0


def _cell(result: dict | None, f, digits: int) -> str:
    if result is None:
        return "failed"
    try:
        return f"{f(result):,.{digits}f}"
    except (KeyError, TypeError, StopIteration, ZeroDivisionError):
        return "-"


def _decode(result: dict, n: int) -> dict:
    return next(d for d in result["strata_jax"]["decode"] if d["parallel"] == n)


def table(outdir: str, cache: str, experts: str, model: str) -> int:
    out = Path(outdir)
    runs = [("every expert on the device", out / "bench_all.json"),
            (f"expert cache {cache} of {experts}", out / "bench_cache.json"),
            (f"expert cache {cache}, misses on the host CPU", out / "bench_hybrid.json")]
    res = [(name, json.loads(p.read_text()) if p.is_file() else None) for name, p in runs]
    first = next((r for _, r in res if r), None)
    parallel = [d["parallel"] for d in first["strata_jax"]["decode"]] if first else []
    rows = [(f"prefill, {first['settings']['prompt_tokens'] if first else '?'} tokens (tok/s)",
             lambda r: r["strata_jax"]["prefill"]["tokens_per_second"], 1)]
    for n in parallel:
        seqs = f"{n} sequence{'s' if n > 1 else ''}"
        rows.append((f"decode, {seqs}: total (tok/s)",
                     lambda r, n=n: _decode(r, n)["aggregate"], 1))
        if n > 1:
            rows.append((f"decode, {seqs}: per sequence (tok/s)",
                         lambda r, n=n: _decode(r, n)["per_sequence"], 1))
    rows += [("load (s)", lambda r: r["strata_jax"]["load_seconds"], 1),
             ("process RSS after load (MiB)", lambda r: r["strata_jax"]["rss_mib_after_load"], 0),
             ("expert bytes a token, 1 sequence (MB)",
              lambda r: r["bound"]["strata_jax"]["expert_bytes_per_token"] / 1e6, 1)]
    try:
        gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                              "--format=csv,noheader"],
                             check=False, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        gpu = ""
    lines = [f"device check: {gpu or 'no GPU named by nvidia-smi'}; model {model}"]
    if first:
        m, e, md = first["machine"], first["strata_jax"]["engine"], first["model"]
        lines.append(f"{md['architecture']}, {md['parameters'] / 1e6:,.0f}M parameters, "
                     f"{md['experts']}, {md['types']}; jax {m['jax']} ({m['jax_backend']}); "
                     f"weights {e['weights']}, backend {e['backend']}, kv {e['kv']}, prefill chunk "
                     f"{e['prefill']}; {m['date']}")
    lines += ["", "| measurement | " + " | ".join(n for n, _ in res) + " |",
              "|---|" + "---:|" * len(res)]
    for name, f, digits in rows:
        lines.append(f"| {name} | " + " | ".join(_cell(r, f, digits) for _, r in res) + " |")
    text = "\n".join(lines)
    print(text)
    (out / "results.md").write_text(text + "\n")
    return 0 if first else 1            # a bench that failed is already reported as its own step


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__)
        return 2
    what, rest = argv[0], argv[1:]
    if what == "imports":
        return imports("--need-gpu" in rest)
    if what == "expert-bytes":
        return expert_bytes(rest)
    if what == "table":
        return table(*rest)
    print(f"device_check.py: unknown command {what!r}\n{__doc__}")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
