#!/usr/bin/env python3
"""`llama-server`'s command line, run as `strata-jax serve` with the same meaning: for tools
(editors' plugins, llama.cpp's own server tests) that launch llama-server.

    python scripts/llama_server_compat.py -m model.gguf --port 8080 -c 4096 -np 4 -n 256 --temp 0.7
        --api-key KEY

What maps (llama-server -> strata-jax serve): -m/--model -> MODEL, --host, --port, -c/--ctx-size N
with -np/--parallel P -> --max-context N/P (llama.cpp splits its context over the slots unless
--kv-unified) and --parallel P, -n/--n-predict, --temp, --top-k, --top-p, --min-p, --repeat-penalty,
--repeat-last-n, --presence-penalty, --frequency-penalty, -s/--seed, --api-key,
--chat-template (a built-in name or Jinja), --api-key-file, -a/--alias -> --model-name (a comma
list: several names), --tags, --no-ui/--no-webui -> --no-webui, --host (a comma list: several
addresses), --ui-mcp-proxy, --tools / --mcp-servers-* (not run; CORS then defaults to localhost, as
llama-server's), --slot-save-path, --cors-origins (llama.cpp's proxy list: here the allowed
origins), --slots/--no-slots, --props, --chat-template-file, -md/--model-draft -> --drafter
draft:PATH, --draft-max/--spec-draft-n-max -> --spec, -to/--timeout -> --request-timeout-s,
--reasoning (default auto, as llama-server's: the chat template's enable_thinking is true),
-v/--verbose -> --verbose-responses, --prefill-assistant unless --no-prefill-assistant
(llama-server's default: a final assistant message is continued), --no-metrics unless --metrics
(llama-server's default), -b/--batch-size N -> --batch-tokens N with prompt chunks of the largest
power of two up to N (at most 256), and always --llama-conventions (llama-server's answers where
they differ from OpenAI's and vLLM's: serve --help says which).

No model hub is reachable from here: --hf-repo / --hf-file / --model-url serve the GGUF named by the
environment variable STRATA_COMPAT_MODEL (default: strata-jax's default model), with a warning.
Flags that change how llama.cpp runs but not what it answers (threads, micro-batch sizes, GPU
layers, flash attention, mmap, logging, --jinja: strata-jax always renders templates with Jinja) are
accepted with a warning; flags whose meaning strata-jax cannot keep (--lora, --mmproj, --embedding,
...) are accepted with a warning saying what will differ. The flags the strata-jax in use does not
know (an older version) are left out, with a warning.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

# llama-server flag -> strata-jax serve flag, for flags that take a value and mean the same
SAME = {
    "--host": "--host", "--port": "--port", "--n-predict": "--n-predict", "--temp": "--temp",
    "--top-k": "--top-k", "--top-p": "--top-p", "--min-p": "--min-p",
    "--repeat-penalty": "--repeat-penalty", "--repeat-last-n": "--repeat-last-n",
    "--presence-penalty": "--presence-penalty", "--frequency-penalty": "--frequency-penalty",
    "--seed": "--seed", "--api-key": "--api-key", "--api-key-file": "--api-key-file",
    "--alias": "--model-name", "--slot-save-path": "--slot-save-path",
    "--cors-origins": "--cors-origins", "--chat-template-file": "--chat-template-file",
    "--timeout": "--request-timeout-s", "--reasoning": "--reasoning", "--tags": "--tags",
    "--chat-template": "--chat-template", "--pooling": "--pooling",
}
SHORT = {"-m": "--model", "-c": "--ctx-size", "-np": "--parallel", "-n": "--n-predict",
         "-s": "--seed", "-b": "--batch-size", "-a": "--alias", "-md": "--model-draft",
         "-to": "--timeout", "-hf": "--hf-repo", "-hfr": "--hf-repo", "-hff": "--hf-file",
         "-mu": "--model-url", "--predict": "--n-predict", "--draft": "--draft-max",
         "--draft-n": "--draft-max", "--spec-draft-n-max": "--draft-max",
         "--threads-http": "--threads-http", "--ctx_size": "--ctx-size", "-v": "--verbose",
         "--log-verbose": "--verbose", "-rea": "--reasoning"}
# accepted, and what differs: shown in the warning
DIFFERS = {
    "--lora": "strata-jax loads no LoRA adapters: the base model answers",
    "--mmproj": "strata-jax reads text only: no multimodal projector",
    "--mmproj-url": "strata-jax reads text only: no multimodal projector",
    "--embedding": "strata-jax serves embeddings and generation alike: the flag changes nothing",
    "--embeddings": "strata-jax serves embeddings and generation alike: the flag changes nothing",
    "--reranking": "strata-jax serves no reranking (/rerank answers 404); generation routes work",
    "--context-shift": "strata-jax does not shift the context: a prompt that does not fit is a 400",
}


# llama-server's built-in tools and MCP servers: not served here, but with any of them llama-server
# limits its default CORS origins to localhost (common/arg.cpp), and so does the wrapper
TOOLS = ("--tools", "--mcp-servers-config", "--mcp-servers-json")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="llama_server_compat.py", allow_abbrev=False, add_help=True,
                                description="llama-server's command line, run as strata-jax serve")
    p.add_argument("--model")
    p.add_argument("--ctx-size", type=int)
    p.add_argument("--parallel", type=int)
    p.add_argument("--kv-unified", action="store_true")
    p.add_argument("--hf-repo")
    p.add_argument("--hf-file")
    p.add_argument("--model-url")
    p.add_argument("--model-draft")
    p.add_argument("--draft-max", type=int)
    p.add_argument("--slots", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--props", action="store_true")
    p.add_argument("--verbose", action="store_true")
    p.add_argument("--no-prefill-assistant", action="store_true")
    p.add_argument("--metrics", action="store_true")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--no-ui", "--no-webui", dest="no_ui", action="store_true")
    p.add_argument("--ui-mcp-proxy", action="store_true")
    for flag in TOOLS:
        p.add_argument(flag)
    for flag in SAME:
        p.add_argument(flag)
    return p


def translate(argv: list[str], known: set[str] | None = None) -> tuple[list[str], list[str]]:
    """llama-server's argv -> (strata-jax serve's argv, warnings). `known`: the flags that serve
    accepts (when given, others are left out with a warning)."""
    warnings: list[str] = []
    argv = [SHORT.get(a.split("=", 1)[0], a.split("=", 1)[0])
            + ("=" + a.split("=", 1)[1] if "=" in a else "")
            if a.startswith("-") else a for a in argv]
    args, rest = parser().parse_known_args(_values_as_equals(argv))
    out: list[str] = []
    model = args.model
    if model is None and (args.hf_repo or args.hf_file or args.model_url):
        model = os.environ.get("STRATA_COMPAT_MODEL")
        where = " ".join(filter(None, (args.hf_repo, args.hf_file, args.model_url)))
        warnings.append(f"{where}: no model hub is reachable; serving "
                        f"{model or 'the default model'} (env STRATA_COMPAT_MODEL) instead")
    if model is None and os.environ.get("STRATA_COMPAT_MODEL"):
        model = os.environ["STRATA_COMPAT_MODEL"]
    if model:
        out.append(model)
    parallel = args.parallel if args.parallel and args.parallel > 0 else None
    if parallel:
        out += ["--parallel", str(parallel)]
    if args.ctx_size:                     # llama.cpp: n_ctx over all slots, unless --kv-unified
        per_slot = args.ctx_size if args.kv_unified or not parallel else args.ctx_size // parallel
        out += ["--max-context", str(per_slot)]
    for flag, ours in SAME.items():
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is not None:
            out += [ours, value]
    if args.model_draft:
        out += ["--drafter", f"draft:{args.model_draft}"]
    if args.draft_max is not None:
        out += ["--spec", str(args.draft_max)]
    if args.slots is not None:
        out.append("--slots" if args.slots else "--no-slots")
    if args.props:
        out.append("--props")
    # llama-server's --verbose also puts "__verbose" in every answer
    if args.verbose:
        out.append("--verbose-responses")
    if not args.metrics:                  # llama-server serves /metrics only with --metrics
        out.append("--no-metrics")
    # llama-server's default: a final assistant message is continued
    if not args.no_prefill_assistant:
        out.append("--prefill-assistant")
    # llama-server's default: templates get enable_thinking = true
    if args.reasoning is None:
        out += ["--reasoning", "auto"]
    # the tokens a window holds, and a prompt's chunk within it (a power of two; 256 is the CPU's
    # auto)
    if args.batch_size and args.batch_size >= 16:
        chunk = min(1 << (args.batch_size.bit_length() - 1), 256)
        out += ["--batch-tokens", str(args.batch_size), "--prefill", str(chunk)]
    if args.no_ui:
        out.append("--no-webui")
    if args.ui_mcp_proxy:
        out.append("--ui-mcp-proxy")
    tools = [f for f in TOOLS if getattr(args, f[2:].replace("-", "_")) is not None]
    if tools:
        warnings.append(f"{', '.join(tools)}: strata-jax runs no built-in tools or MCP servers "
                        "(ignored)")
        # llama-server's default with tools: pages on localhost only
        if args.cors_origins is None:
            out += ["--cors-origins", "localhost"]
    # llama-server's answers where they differ from OpenAI's and vLLM's
    out.append("--llama-conventions")
    i = 0
    while i < len(rest):
        flag, _, value = rest[i].partition("=")
        takes = not value and i + 1 < len(rest) and not _is_flag(rest[i + 1])
        shown = f"{flag} {rest[i + 1]}" if takes else rest[i]
        why = DIFFERS.get(flag, "it changes how llama.cpp runs, not what it answers")
        warnings.append(f"{shown}: accepted and ignored ({why})")
        i += 2 if takes else 1
    if known is not None:
        out, dropped = _only_known(out, known)
        warnings += [f"{f}: this strata-jax serve has no such flag; left out" for f in dropped]
    return out, warnings


def _values_as_equals(argv: list[str]) -> list[str]:
    """`--seed -1` -> `--seed=-1`: argparse would take a negative number for a flag."""
    out, i = [], 0
    takes = set(SAME) | {"--model", "--ctx-size", "--parallel", "--hf-repo", "--hf-file",
                         "--model-url", "--model-draft", "--draft-max", "--batch-size"}
    while i < len(argv):
        if argv[i] in takes and i + 1 < len(argv):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _is_flag(token: str) -> bool:
    return token.startswith("-") and not re.fullmatch(r"-\d+(\.\d+)?", token)


def _only_known(out: list[str], known: set[str]) -> tuple[list[str], list[str]]:
    kept, dropped, i = [], [], 0
    while i < len(out):
        token = out[i]
        if not token.startswith("--"):
            kept.append(token)
            i += 1
            continue
        takes = i + 1 < len(out) and not out[i + 1].startswith("--")
        if token in known:
            kept += out[i:i + 2] if takes else [token]
        else:
            dropped.append(token)
        i += 2 if takes else 1
    return kept, dropped


def serve_flags(command: list[str]) -> set[str]:
    """The flags `strata-jax serve --help` lists (remembered in the temp folder for the code at
    hand)."""
    import strata_jax

    root = Path(strata_jax.__file__).parent
    stamp = "|".join([sys.executable, str(root)]
                     + [str((root / f).stat().st_mtime_ns) for f in ("cli.py", "cli_flags.py")])
    memo = (Path(tempfile.gettempdir())
            / f"strata-serve-flags-{hashlib.sha1(stamp.encode()).hexdigest()[:12]}")
    if memo.exists():
        return set(memo.read_text().split())
    text = subprocess.run([*command, "serve", "--help"], capture_output=True, text=True,
                          check=True).stdout
    flags = set(re.findall(r"--[a-z][a-z0-9-]*", text))
    memo.write_text(" ".join(sorted(flags)))
    return flags


def main(argv: list[str]) -> int:
    command = [sys.executable, "-m", "strata_jax"]
    ours, warnings = translate(argv, serve_flags(command))
    for w in warnings:
        print(f"llama_server_compat: warning: {w}", file=sys.stderr, flush=True)
    print(f"llama_server_compat: strata-jax serve {' '.join(ours)}", file=sys.stderr, flush=True)
    os.execv(sys.executable, [*command, "serve", *ours])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
