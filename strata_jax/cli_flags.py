"""Engine flags on the command line: one flag a field of EngineConfig (`max_context` <->
`--max-context`), so serve, generate and bench take the same flags and Python users the same
names."""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, fields
from typing import Any

from . import envs
from .config import ConfigError, EngineConfig


@dataclass(frozen=True)
class Flag:
    # what the flag takes, as docs/FLAGS.md's table shows it ("auto|N"; "" for a switch)
    values: str
    help: str              # its meaning: --help and docs/FLAGS.md's table
    # the default as shown, where the field's own would mislead ("" : the field's)
    default: str = ""


# One entry an EngineConfig field: the CLI's flags (add_engine_flags) and docs/FLAGS.md's
# engine-flag table (flag_table; tests/test_layers.py checks docs/FLAGS.md holds it) are made from
# these and the fields' defaults.
FLAGS = {
    "parallel": Flag("N", "slots: conversations decoded together"),
    "max_context": Flag("N", "tokens a slot holds (prompt + answer)"),
    "kv": Flag("bf16|f16|f32|int8|auto", "KV cache type (auto: f32 on a CPU, bf16 on a GPU); int8 "
               "keeps a float32 scale a token and head"),
    "prefill": Flag("auto|N", "prompt tokens a window reads for one slot (auto: 256 on a CPU, 1024 "
                    "on a GPU; a power of two)"),
    "batch_tokens": Flag("auto|N", "tokens a window holds: every decoding row plus prompt chunks "
                         "of as many reading slots as fit (llama.cpp's --batch-size, vLLM's "
                         "max_num_batched_tokens; auto: 512 on a CPU, 2048 on a GPU, never below "
                         "--prefill)"),
    "spec": Flag("N", "speculative decoding: up to N drafts a slot, verified in one window"),
    "spec_min_p": Flag("P", "drafting stops below this drafter probability"),
    "spec_max_rows": Flag("N", "draft only while at most N slots decode (0: always), like vLLM's "
                          "speculative_disable_by_batch_size; on a CPU a verify window of many "
                          "rows costs more than it saves"),
    "drafter": Flag("ngram|mtp|none|draft:PATH.gguf", "where drafts come from: n-grams of the "
                    "context, the model's own MTP (NextN) layer, none, or a small draft model"),
    "expert_cache": Flag("auto|N", "experts on the device: auto = all when they fit the ledger, "
                         "else an arena; N = an arena of N expert slots a MoE layer. On a CPU, "
                         "auto with a file larger than the memory the engine may use "
                         "(--memory-limit-gib) sizes the tiers from it: a quarter of what is left "
                         "the arena, a quarter --resident-budget-gib, --host-experts off "
                         "(engine/execute/tier_sizes.py)"),
    "expert_profile": Flag("FILE", "expert hotness written from live traffic (POST "
                           "/expert-profile): preloads and pins the hottest experts at start"),
    "expert_policy": Flag("freq|lru",
                          "device expert cache eviction: freq (frequency-aware LRU) or lru"),
    "expert_prefetch": Flag("", "copy the experts the next layer will likely need into the device "
                                "cache ahead of it"),
    "host_experts": Flag("auto|on|off", "a layer whose routed experts miss the device arena "
                         "computes them where they live, from the host tier with the CPU expert "
                         "kernel (packed like the weights when every expert is in host RAM, else "
                         "the file's GGUF blocks), instead of copying them in (misses still fill "
                         "free arena slots). On a CPU device the host tier is the device's own "
                         "memory: every miss is computed in place, inside the window's one "
                         "program. Beside a GPU the layer's normed input and router ids go to the "
                         "host CPU, which computes only the missed experts' rows; the GPU computes "
                         "the held ones and adds the host's rows in. auto chooses per layer and "
                         "window by the cost rule printed at start (rows x expert bytes / host "
                         "kernel rate against expert bytes / link rate, both measured); on: every "
                         "miss on the host. auto is off, with a warning, for a file whose experts "
                         "outside the RAM tier do not start at 64-byte boundaries (GGUF aligns to "
                         "32: the host path would hold a copy of them; on is refused there; "
                         "LIMITS.md)"),
    "pcie_frac": Flag("F", "up to a fraction F of a layer's routed experts in a window are read by "
                      "the device straight from host memory (JAX's pinned_host memory kind, over "
                      "the link on a GPU) instead of being copied into the device cache: the "
                      "coldest misses first (the fewest rows in the window), so they never evict a "
                      "hotter expert; the same kernel, the same bits. An error where the device "
                      "has no pinned_host memory kind. On a CPU device the default host experts "
                      "already read every miss in place; this matters with --host-experts off "
                      "there, and on GPUs"),
    "host_device": Flag("auto|cpu:N", "the CPU device that computes host experts: auto is the "
                        "device itself on a CPU and the first CPU device beside a GPU (tested with "
                        "two forced CPU devices: tests/test_host_device.py)"),
    "layer_step": Flag("auto|always", "expert tiers: auto runs a window as ONE program whenever "
                       "its experts are where one program can read them (every routed expert in "
                       "the device arena, or the host tier's blocks with --host-experts), else "
                       "layer by layer (a window tried as one program that meets a miss is run "
                       "again stepped); always: every window layer by layer"),
    "resident_budget_gib": Flag("G", "host RAM for experts, GiB; the rest is read from the GGUF "
                                     "file in place", "all"),
    "memory_limit_gib": Flag("G", "host memory the engine may plan for, GiB: a start whose KV "
                             "cache, weight copies, device expert cache (on a CPU), "
                             "--resident-budget-gib and conversation cache (and a 1 GiB runtime "
                             "reserve) exceed it is refused with the figures. "
                             "The file's own pages are not counted (a model larger than RAM runs "
                             "from its file)", "the memory cgroup's limit, else the RAM"),
    "pool_workers": Flag("N", "file-tier reader threads"),
    "vram_reserve_mib": Flag("M", "device memory kept free, MiB"),
    "device_memory_mib": Flag("M", "a device-memory budget the engine's ledger enforces, MiB (how "
                              "tests make memory run out on a CPU)", "device's own"),
    "max_programs": Flag("N", "live compiled window programs (LRU); 0 = no bound",
                         "64 (env STRATA_BATCH_GRAPHS)"),
    "prefix_cache": Flag("", "a slot keeps its KV after its request; a new request reuses the "
                         "longest matching prefix"),
    "conversation_cache_mib": Flag("M", "host RAM (MiB) for slots' KV that new requests overwrite, "
                                   "restored by exact token prefix"),
    "conversation_cache_slots": Flag("N", "conversations kept there (0 = no bound but the MiB)"),
    "ctx_checkpoints": Flag("N", "hybrid families (qwen3next, qwen35moe): Gated DeltaNet state "
                            "checkpoints kept in host RAM a slot, taken at each prompt's end and "
                            "every --checkpoint-every tokens of a long one; a new request resumes "
                            "from the longest one its prompt starts with (its recurrent state "
                            "cannot be cut at any token, as KV can); 0 = none (llama.cpp's "
                            "--ctx-checkpoints)"),
    "checkpoint_every": Flag("N", "hybrid families: a state checkpoint every N prompt tokens (at "
                             "the first chunk end past each multiple)"),
    "kv_resident": Flag("N", "a slot's KV past its first N positions in host RAM (N: a multiple of "
                        "the attention chunk)"),
    "attn_chunk": Flag("auto|N", "keys an attention step reads (auto: 256, less for a max context "
                       "under 256; a power of two)"),
    "weights": Flag("blocks|packed|dequantized|auto",
                    "keep GGUF blocks (read by the kernels, in place: the file's own pages on a "
                    "CPU), pack them (the cpu backend's int8 math: the dense matrices of Q4_0, "
                    "Q4_1, Q8_0, IQ4_NL, Q4_K and MXFP4 copied at load with 8 rows' blocks side by "
                    "side, "
                    "about twice as fast at decode, the same bits; a private copy of those bytes "
                    "instead of the file's shared pages) or dequantize at load (auto: packed on "
                    "the cpu backend with int8 math while the copy takes at most half the RAM "
                    "available, else blocks; blocks on the other kernel backends; dequantized only "
                    "on the xla backend on a CPU when the float32 copy is under 4 GiB)"),
    "backend": Flag("auto|cpu|xla|pallas|interpret", "kernel backend (auto: pallas on a GPU; on a "
                    "CPU, cpu where its C++ kernels were built at install, else xla)"),
    "cpu_math": Flag("int8|exact", "the arithmetic of the C++ CPU kernels' products of GGUF "
                     "blocks: int8 quantizes each row of activations to 8 bits per block, as "
                     "llama.cpp does, and multiplies with integer dot products (fast); exact keeps "
                     "them float32 against the dequantized weights (the oracle, for research that "
                     "needs those bits); float weights (F32, F16, BF16) are always exact. Applies "
                     "to the cpu backend (stats and GET /props then name it cpu or cpu-exact) and "
                     "to host experts computed beside a GPU; other backends ignore it"),
    "dtype": Flag("auto|float32|bfloat16",
                  "activations (auto: float32 on a CPU, bfloat16 on a GPU)"),
    "request_timeout_s": Flag("S", "every request's deadline, seconds"),
    "max_grammar_rules": Flag("N", "rules a request's GBNF grammar may have (more: a 400 naming "
                                   "this flag)"),
    "max_grammar_depth": Flag("N", "how deep a request's GBNF grammar may nest: a chain of rules "
                              "that are lexer terminals, or groups in groups (llguidance compiles "
                              "them by recursion; deeper: a 400)"),
    "warmup": Flag("", "build the decode programs at start (with a progress bar) and every other "
                   "window layout on a builder thread while the engine serves; off: each layout is "
                   "built when first met, and its window waits"),
    "run_ahead": Flag("", "dispatch the next decode window before this one's tokens are applied "
                      "(the cpu kernels, families without a recurrent state or rings): the cores "
                      "work while the engine hands out tokens; off: one window at a time"),
    "compile_cache": Flag("", "keep compiled programs in <cache folder>/jax-compile (private) so a "
                          "restart does not compile again (env STRATA_JAX_COMPILE_CACHE=DIR or "
                          "off)"),
    "seed": Flag("N", "the seed a request to llama.cpp's routes (/completion) without its own "
                 "samples with (llama.cpp's -s)"),
    "devices": Flag("N", "devices of this host the model runs over (several CPU devices: XLA_FLAGS="
                    "--xla_force_host_platform_device_count=N); see --split"),
    "split": Flag("auto|experts|layers",
                  "with --devices N > 1: experts = each device holds E/N experts of every layer, "
                  "the rest replicated (one program over all devices, the expert rows summed by a "
                  "psum); layers = each device a contiguous run of layers and their KV (a chain of "
                  "stage programs); auto: experts for a MoE model, else layers"),
    "micro_batches": Flag("auto|M", "with --split layers: each window's rows cut into up to M "
                          "parts that follow each other through the stages, so device s + 1 runs "
                          "one part while device s runs the next (the same bits; no extra "
                          "programs); auto: 1 on CPU devices (they share the host's cores: slower "
                          "when cut, docs/DISTRIBUTED.md), else the number of devices"),
    "coordinator": Flag("HOST:PORT", "process 0's address when one model spans processes or hosts "
                        "(jax.distributed's coordinator; process 0 also listens on PORT + 1 for "
                        "its followers); every process gets the same one"),
    "num_processes": Flag("N", "processes (hosts) the model's experts are split over, every device "
                          "of each in one mesh; process 0 serves HTTP, the others follow it "
                          "(docs/DISTRIBUTED.md)"),
    "process_id": Flag("I", "this process's number, 0 to N - 1; the others are started with the "
                       "same model and flags"),
    "group_key_file": Flag("FILE", "the key every process of a group proves before it may join "
                           "(its first line, 16 characters or more; the same on every host); "
                           "needed when the coordinator is not a loopback address; default there: "
                           "<cache folder>/group-key, made once (mode 0600)"),
}


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    for f in fields(EngineConfig):
        default = _default(f)
        if f.name == "max_programs":
            default = _env_max_programs()
        if isinstance(default, bool):
            g.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                           action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                           help=f"{FLAGS[f.name].help} (default {_shown(f.name, default)})")
            continue
        kind = {"int": int, "float": float}.get(type(default).__name__, str)
        if f.name in ("resident_budget_gib", "device_memory_mib", "memory_limit_gib"):
            kind = float
        if f.name == "kv_resident":
            kind = int
        g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind,
                       default=argparse.SUPPRESS,
                       metavar=FLAGS[f.name].values or "X",
                       help=f"{FLAGS[f.name].help} (default {_shown(f.name, default)})")


def engine_config(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    values = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    if "max_programs" not in values and "max_programs" not in overrides:
        # the flag's default: env STRATA_BATCH_GRAPHS, else 64
        values["max_programs"] = _env_max_programs()
    return EngineConfig(**{**overrides, **values})


def _env_max_programs() -> int:
    try:
        return envs.max_programs()
    except envs.EnvError as e:
        raise ConfigError(str(e)) from None


def _default(f) -> Any:
    return f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]


def _shown(name: str, default: Any) -> str:
    if FLAGS[name].default:
        return FLAGS[name].default
    if isinstance(default, bool):
        return "on" if default else "off"
    return "-" if default is None else str(default)


def flag_table() -> str:
    """docs/FLAGS.md's table of engine flags, made from FLAGS and EngineConfig's defaults."""
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for f in fields(EngineConfig):
        flag, default = FLAGS[f.name], _default(f)
        name = "--" + f.name.replace("_", "-")
        shown = f"`{name} / --no-{name[2:]}`" if isinstance(default, bool) else \
            f"`{name} {flag.values}`".replace("|", "\\|")
        rows.append(f"| {shown} | {_shown(f.name, default)} | "
                    f"{flag.help.replace('|', chr(92) + '|')} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":          # python -m strata_jax.cli_flags > the table docs/FLAGS.md holds
    print(flag_table(), end="")
