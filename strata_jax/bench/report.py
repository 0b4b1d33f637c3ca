"""The bench's printed report: a header (machine, model, settings) and one Markdown table, so it
pastes into docs/BENCHMARKS.md as it is."""

from __future__ import annotations


def _num(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _rows(result: dict) -> list[tuple[str, float | None, float | None]]:
    ours, theirs = result["strata_jax"], result.get("llama_cpp")
    rows = [(f"prefill, {ours['prefill']['prompt_tokens']} tokens (tok/s)",
             ours["prefill"]["tokens_per_second"],
             theirs["prefill"]["tokens_per_second"] if theirs else None)]
    for i, d in enumerate(ours["decode"]):
        t = theirs["decode"][i] if theirs else None
        n = d["parallel"]
        seqs = f"{n} sequence{'s' if n > 1 else ''}"
        rows.append((f"decode, {seqs}: total (tok/s)", d["aggregate"],
                     t["aggregate"] if t else None))
        if n > 1:
            rows.append((f"decode, {seqs}: per sequence (tok/s)", d["per_sequence"],
                         t["per_sequence"] if t else None))
    return rows


def table(result: dict) -> str:
    with_them = result.get("llama_cpp") is not None
    head = ["measurement", "strata-jax"] + (["llama.cpp", "ours / llama.cpp"] if with_them else [])
    body = []
    for name, ours, theirs in _rows(result):
        row = [name, _num(ours)]
        if with_them:
            row += [_num(theirs), _num(ours / theirs if ours and theirs else None, 2)]
        body.append(row)
    widths = [max(len(r[i]) for r in [head] + body) for i in range(len(head))]

    def line(cells):
        return ("| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                  for i, (c, w) in enumerate(zip(cells, widths))) + " |")

    rule = ("|" + "|".join("-" * (w + 1) + ("-" if i == 0 else ":")
                           for i, w in enumerate(widths)) + "|")
    return "\n".join([line(head), rule] + [line(r) for r in body])


def twin_line(twin: dict | None) -> str | None:
    """The report's line for --moe-twin: which file was benchmarked, and that it is a twin."""
    if not twin:
        return None
    how = "reused from the cache" if twin["reused"] else f"made in {twin['seconds']:.1f} s"
    return (f"benchmarked: {twin['path']}, a MoE twin of {twin['source']} ({twin['experts']} "
            f"experts, top-{twin['top_k']}; strata-jax upcycle, {how}): both engines read this "
            "file")


def render(result: dict) -> str:
    m, model, s = result["machine"], result["model"], result["settings"]
    ours = result["strata_jax"]
    eng = ours["engine"]
    load = m["load_average_at_start"]
    versions = f"jax {m['jax']} ({m['jax_backend']})"
    if result.get("llama_cpp"):
        versions += f", llama-cpp-python {m['llama_cpp_python']}"
    weights = eng["weights"] + (f" ({eng['dtype']})" if eng["weights"] == "dequantized" else "") + (
        " packed" if eng.get("pack") else "")
    lines = [
        f"model: {model['file']} ({model['architecture']}, {model['parameters'] / 1e6:,.1f}M "
        "parameters, "
        + f"{model['experts'] or 'dense'}, {model['types']})",
        *filter(None, [twin_line(result.get("twin"))]),
        f"machine: {m['cpu']}, {m['cores']} cores ({m['threads']} used), load average "
        f"{_num(load, 2)} at start; "
        + f"{versions}; {m['date']}",
        f"strata-jax engine: weights {weights}, backend {eng['backend']}, kv {eng['kv']}, prefill "
        "chunk "
        + f"{eng['prefill']}, one engine of {ours['config']['parallel']} slots; loaded in "
        f"{ours['load_seconds']:.1f} s, "
        + f"process RSS {_num(ours.get('rss_mib_after_load'), 0)} MiB after load",
        f"sizes: prefill prompt {s['prompt_tokens']} tokens; decode {s['decode_tokens']} tokens a "
        "sequence after a "
        + f"{s['decode_prompt_tokens']}-token prompt; greedy; a warm-up run before each figure, "
          f"best of {s['repeat']}",
        "",
        table(result),
        "",
    ]
    bw = result["bandwidth"]
    lines.append(f"memory bandwidth: {bw['bytes_per_second'] / 1e9:.1f} GB/s ({bw['method']})")
    for who, b in (("strata-jax", result["bound"]["strata_jax"]),
                   ("llama.cpp", result["bound"].get("llama_cpp"))):
        if b is None:
            continue
        kind = f"{b['dtype']} weights" if b["weights"] == "dequantized" else "GGUF blocks"
        moe = f", experts {b['experts_used']}" if b["experts_used"] else ""
        reach = (f": {who} reaches {_num(b['reached'])} tok/s = {100 * b['fraction']:.0f}%"
                 if b["fraction"] else "")
        lines.append(f"bound, 1 sequence, {who} ({kind}{moe}): {b['bytes_per_token'] / 1e6:,.1f} "
                     f"MB a token -> {_num(b['tokens_per_second'])} tok/s{reach}")
    if load is not None and load > 0.5:
        lines.append(f"note: other work kept the machine busy (load average {load:.2f} at start, "
                     f"{_num(m.get('load_average_at_end'), 2)} at the end, ours included): figures "
                     "may be low, llama.cpp's most (its threads wait for each other at every step)")
    lines.append(f"bench took {result['seconds']:.0f} s")
    return "\n".join(lines)
