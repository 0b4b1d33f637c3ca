"""EngineConfig and ServerConfig: every flag, validated in one place.

Field names are the CLI flags with underscores (`--max-context` -> `max_context`), so the CLI, the
server and Python users speak one language. Strata's / llama.cpp's flag names are kept where one
exists.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any


class ConfigError(ValueError):
    """A setting that cannot work: the message names the setting, the value, and what is allowed."""


KV_TYPES = ("bf16", "f16", "f32", "int8")
DRAFTERS = ("ngram", "mtp", "none")
WEIGHT_MODES = ("auto", "blocks", "packed", "dequantized")
# experts/policy.py: frequency-aware LRU (default), plain LRU
EXPERT_POLICIES = ("freq", "lru")
# engine/distributed/devices.py: auto = experts for a MoE model, else layers
SPLITS = ("auto", "experts", "layers")
# --cpu-math: pallas_kernels.cpu.MATHS, named here so the config needs no JAX
# (tests/test_cpu_math.py checks they agree)
CPU_MATHS = ("int8", "exact")
MAX_TEMPERATURE = 100.0


# One rule for each sampling value a request sets and a server-wide default may set (--temp, ...,
# POST /props): SamplingParams.validate (engine/request.py) and ServerConfig ask the same function,
# so no default can be one that every request which sets nothing would then be refused for.
def sampling_problem(name: str, value: Any, vocab_size: int | None = None) -> str | None:
    """What is wrong with `value` as the sampling field `name` (None: nothing), in words for an
    error message."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    number = (whole or isinstance(value, float)) and math.isfinite(value)
    if name == "temperature":
        return None if number and 0 <= value <= MAX_TEMPERATURE else \
            f"must be a finite number from 0 to {MAX_TEMPERATURE:g} (0: greedy)"
    if name == "top_k":
        limit = vocab_size or 2**31 - 1
        return None if whole and 0 <= value <= limit else \
            f"must be a whole number from 0 (off) to {limit}" + (" (the vocabulary)" if vocab_size
                                                                 else "")
    if name == "top_p":
        return None if number and 0 < value <= 1 else "must be a finite number in (0, 1]"
    if name == "min_p":
        return None if number and 0 <= value <= 1 else "must be a finite number in [0, 1]"
    if name in ("presence_penalty", "frequency_penalty"):
        return None if number and -2 <= value <= 2 else "must be a number from -2 to 2"
    if name == "repeat_penalty":
        return None if number and 0 < value <= 10 else "must be a number in (0, 10] (1: off)"
    if name == "repeat_last_n":
        return (None if whole and -1 <= value < 2**31
                else "must be a whole number >= -1 (-1: the whole context, 0: off)")
    raise KeyError(name)


def default_problem(key: str, value: Any, vocab_size: int | None = None) -> str | None:
    """What is wrong with `value` as the server's sampling default `key` (None: nothing).
    llama.cpp's names and meanings: n_predict (-1 or 0: no default), top_k -1 (off, as a request's
    -1 is); the rest is a request's rule."""
    whole = isinstance(value, int) and not isinstance(value, bool)
    if key == "n_predict":
        return (None if whole and -1 <= value < 2**31
                else "must be a whole number: the tokens a request generates, or -1 (up to the end "
                     "of the slot's context)")
    return sampling_problem(key, 0 if key == "top_k" and whole and value == -1 else value,
                            vocab_size)


def _loopback(host: str) -> bool:
    """A literal loopback address (or localhost): only this machine reaches it."""
    import ipaddress

    try:
        return host.lower() == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class EngineConfig:
    parallel: int = 1                    # slots: conversations decoded together
    max_context: int = 4096              # tokens a slot holds (prompt + generated)
    # KV cache type: bf16|f16|f32|int8 (auto: f32 on a CPU, bf16 on a GPU)
    kv: str = "auto"
    # prompt tokens a window reads for one slot (auto: 256 on a CPU, 1024 on a GPU)
    prefill: str | int = "auto"
    # tokens a window holds, decode rows and prompt chunks (llama.cpp's n_batch)
    batch_tokens: str | int = "auto"
    spec: int = 0                        # draft tokens a row (speculative decoding)
    spec_min_p: float = 0.5              # stop drafting below this drafter probability
    # draft only while at most this many slots decode (0: always)
    spec_max_rows: int = 0
    drafter: str = "ngram"               # ngram | mtp | none | draft:PATH.gguf
    # experts kept on the device: auto or a number of expert slots
    expert_cache: str | int = "auto"
    expert_profile: str | None = None    # expert hotness file to preload and pin
    # device expert cache eviction: freq (frequency-aware LRU) | lru
    expert_policy: str = "freq"
    # copy the experts the next layer will likely need ahead of it
    expert_prefetch: bool = False
    # compute a layer's experts from the host tier's blocks when the device cache misses
    host_experts: str = "auto"
    # up to this fraction of a layer's routed experts read over the link, not cached
    pcie_frac: float = 0.0
    # the CPU device that computes them: auto (the device itself on a CPU, else cpu:0) | cpu:N
    host_device: str = "auto"
    # expert tiers: auto (one program a window where it can) | always (layer by layer)
    layer_step: str = "auto"
    resident_budget_gib: float | None = None   # host RAM for experts (None: all of them)
    # host memory the engine may plan for (None: the memory cgroup's limit, else the machine's RAM)
    memory_limit_gib: float | None = None
    pool_workers: int = 4                # reader threads for the file tier
    vram_reserve_mib: int = 700          # device memory kept free
    # a device-memory budget the engine's ledger enforces (MiB)
    device_memory_mib: float | None = None
    # live compiled windows (0 = no bound; the CLI's default: env STRATA_BATCH_GRAPHS)
    max_programs: int = 64
    # a slot keeps its KV after its request; a new request reuses the longest match
    prefix_cache: bool = True
    conversation_cache_mib: int = 0      # host RAM for evicted conversations' KV (0: none)
    conversation_cache_slots: int = 0    # conversations kept there (0: no bound but the MiB)
    # hybrid families: recurrent-state checkpoints kept a slot (llama.cpp's --ctx-checkpoints)
    ctx_checkpoints: int = 8
    # ... and one every this many prompt tokens of a long prompt (at chunk ends)
    checkpoint_every: int = 4096
    kv_resident: int | None = None       # a slot's KV beyond this many tokens lives in host RAM
    # keys an attention step reads (auto: 256, less for a small max_context)
    attn_chunk: str | int = "auto"
    # blocks | packed | dequantized | auto (see engine/choices.resolve)
    weights: str = "auto"
    backend: str = "auto"                # kernel backend: auto | xla | cpu | pallas | interpret
    # the C++ CPU kernels' products: int8 (8-bit activations, fast) | exact (float32)
    cpu_math: str = "int8"
    # activations: auto (float32 on a CPU, bfloat16 on a GPU) | float32 | bfloat16
    dtype: str = "auto"
    request_timeout_s: float = 600.0     # a request's deadline
    # rules a request's GBNF grammar may have (engine/grammar/gbnf.py)
    max_grammar_rules: int = 2048
    # a GBNF chain of terminal rules, or of nested groups (llguidance recurses)
    max_grammar_depth: int = 256
    # build the base window programs at start; later layouts off the engine thread
    warmup: bool = True
    # dispatch the next decode window before this one's tokens are applied (run_ahead.py)
    run_ahead: bool = True
    # JAX's persistent compilation cache in the cache folder (compile_cache.py)
    compile_cache: bool = True
    # the seed a llama.cpp-route request without one samples with (-s)
    seed: int = 0
    # devices of this host the model runs over (engine/distributed/devices.py)
    devices: int = 1
    # how, with devices > 1: experts (each device E/N experts) | layers (stages) | auto
    split: str = "auto"
    # split layers: a window in up to this many parts, so stages overlap (pipeline.py)
    micro_batches: int | str = "auto"
    # HOST:PORT of process 0, with num_processes > 1 (engine/distributed/hosts.py)
    coordinator: str | None = None
    # processes (hosts) one model runs over, joined by jax.distributed
    num_processes: int = 1
    # this process's number among them: 0 serves HTTP, the others follow
    process_id: int = 0
    # the group channel's shared key (engine/distributed/group_channel.py); loopback: auto
    group_key_file: str | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, name: str, value: Any, what: str) -> None:
            if not cond:
                raise ConfigError(f"{name} = {value!r}: {what}")

        need(isinstance(self.parallel, int) and 1 <= self.parallel <= 256, "parallel",
             self.parallel, "must be a whole number from 1 to 256")
        need(isinstance(self.max_context, int) and 16 <= self.max_context <= 1 << 20, "max_context",
             self.max_context, "must be a whole number from 16 to 1048576")
        need(self.kv in KV_TYPES + ("auto",), "kv", self.kv,
             f"must be one of {', '.join(KV_TYPES)} or auto")
        if self.prefill != "auto":
            try:
                self.prefill = int(self.prefill)
            except (TypeError, ValueError):
                raise ConfigError(f"prefill = {self.prefill!r}: must be auto or a number of "
                                  "tokens") from None
            need(16 <= self.prefill <= 65536 and self.prefill & (self.prefill - 1) == 0, "prefill",
                 self.prefill, "must be auto or a power of two from 16 to 65536")
        if self.batch_tokens != "auto":
            try:
                self.batch_tokens = int(self.batch_tokens)
            except (TypeError, ValueError):
                raise ConfigError(f"batch_tokens = {self.batch_tokens!r}: must be auto or a number "
                                  "of tokens") from None
            need(16 <= self.batch_tokens <= 1 << 20, "batch_tokens", self.batch_tokens,
                 "must be auto or a number of tokens from 16 to 1048576")
            need(self.prefill == "auto" or self.batch_tokens >= self.prefill, "batch_tokens",
                 self.batch_tokens, f"must be at least prefill ({self.prefill}): a window holds at "
                                    "least one whole prompt chunk")
        need(isinstance(self.spec, int) and 0 <= self.spec <= 16, "spec", self.spec,
             "must be 0 to 16 draft tokens")
        need(0.0 <= self.spec_min_p <= 1.0, "spec_min_p", self.spec_min_p,
             "must be between 0 and 1")
        need(isinstance(self.spec_max_rows, int) and self.spec_max_rows >= 0, "spec_max_rows",
             self.spec_max_rows, "must be 0 (always draft) or a number of decoding slots")
        need(self.drafter in DRAFTERS or self.drafter.startswith("draft:"), "drafter", self.drafter,
             "must be ngram, mtp, none or draft:PATH.gguf")
        if self.expert_cache != "auto":
            try:
                self.expert_cache = int(self.expert_cache)
            except (TypeError, ValueError):
                raise ConfigError(f"expert_cache = {self.expert_cache!r}: must be auto or a number "
                                  "of expert slots") from None
            need(self.expert_cache >= 0, "expert_cache", self.expert_cache, "must be auto or >= 0")
        need(self.host_experts in ("auto", "on", "off"), "host_experts", self.host_experts,
             "must be auto, on or off")
        need(isinstance(self.pcie_frac, (int, float)) and 0.0 <= self.pcie_frac <= 1.0, "pcie_frac",
             self.pcie_frac, "must be a fraction from 0 (off) to 1")
        need(self.host_device == "auto" or re.fullmatch(r"cpu:\d+",
                                                        str(self.host_device)) is not None,
             "host_device", self.host_device, "must be auto or cpu:N (a CPU device's index)")
        need(self.layer_step in ("auto", "always"), "layer_step", self.layer_step,
             "must be auto or always")
        need(self.expert_policy in EXPERT_POLICIES, "expert_policy", self.expert_policy,
             f"must be one of {', '.join(EXPERT_POLICIES)} (freq: frequency-aware LRU, the "
             "default; lru: plain LRU)")
        need(self.resident_budget_gib is None or self.resident_budget_gib >= 0,
             "resident_budget_gib", self.resident_budget_gib, "must be >= 0")
        need(self.memory_limit_gib is None or self.memory_limit_gib > 0, "memory_limit_gib",
             self.memory_limit_gib, "must be a positive number of GiB")
        need(isinstance(self.pool_workers, int) and 1 <= self.pool_workers <= 64, "pool_workers",
             self.pool_workers, "must be 1 to 64")
        need(self.vram_reserve_mib >= 0, "vram_reserve_mib", self.vram_reserve_mib, "must be >= 0")
        need(self.device_memory_mib is None or self.device_memory_mib > 0, "device_memory_mib",
             self.device_memory_mib, "must be a positive number of MiB")
        need(isinstance(self.max_programs, int) and self.max_programs >= 0, "max_programs",
             self.max_programs, "must be >= 0 (0 = no bound)")
        need(self.conversation_cache_mib >= 0, "conversation_cache_mib",
             self.conversation_cache_mib, "must be >= 0")
        need(isinstance(self.prefix_cache, bool), "prefix_cache", self.prefix_cache,
             "must be true or false")
        need(isinstance(self.run_ahead, bool), "run_ahead", self.run_ahead,
             "must be true or false")
        need(self.prefix_cache or not self.conversation_cache_mib, "conversation_cache_mib",
             self.conversation_cache_mib,
             "needs the prefix cache (drop --no-prefix-cache, or set it to 0)")
        need(self.conversation_cache_slots >= 0, "conversation_cache_slots",
             self.conversation_cache_slots, "must be >= 0")
        need(self.ctx_checkpoints >= 0, "ctx_checkpoints", self.ctx_checkpoints,
             "must be >= 0 (0: none)")
        need(self.checkpoint_every >= 1, "checkpoint_every", self.checkpoint_every, "must be >= 1")
        if self.attn_chunk != "auto":
            try:
                self.attn_chunk = int(self.attn_chunk)
            except (TypeError, ValueError):
                raise ConfigError(f"attn_chunk = {self.attn_chunk!r}: must be auto or a number of "
                                  "keys") from None
            need(16 <= self.attn_chunk <= 4096 and self.attn_chunk & (self.attn_chunk - 1) == 0,
                 "attn_chunk", self.attn_chunk, "must be auto or a power of two from 16 to 4096")
        need(self.kv_resident is None
             or (isinstance(self.kv_resident, int) and 16 <= self.kv_resident),
             "kv_resident", self.kv_resident, "must be a whole number of at least 16 tokens")
        chunk = self.attention_chunk()
        need(self.kv_resident is None or self.kv_resident % chunk == 0, "kv_resident",
             self.kv_resident, f"must be a multiple of the attention chunk, {chunk} keys here "
             f"(attn_chunk = {self.attn_chunk!r}, max_context = {self.max_context}): try "
             f"{max(chunk, (self.kv_resident or 0) // chunk * chunk)}")
        need(self.weights in WEIGHT_MODES, "weights", self.weights,
             f"must be one of {', '.join(WEIGHT_MODES)}")
        need(self.backend in ("auto", "xla", "cpu", "pallas", "interpret"), "backend", self.backend,
             "must be auto, xla, cpu, pallas or interpret")
        need(self.cpu_math in CPU_MATHS, "cpu_math", self.cpu_math,
             f"must be one of {', '.join(CPU_MATHS)} (int8: 8-bit activations, fast; exact: "
             "float32, the oracle)")
        need(self.dtype in ("auto", "float32", "bfloat16"), "dtype", self.dtype,
             "must be auto, float32 or bfloat16")
        need(self.request_timeout_s > 0, "request_timeout_s", self.request_timeout_s, "must be > 0")
        need(isinstance(self.max_grammar_rules, int) and 1 <= self.max_grammar_rules <= 1 << 20,
             "max_grammar_rules", self.max_grammar_rules,
             "must be a whole number of rules from 1 to 1048576")
        need(isinstance(self.max_grammar_depth, int) and 1 <= self.max_grammar_depth <= 16384,
             "max_grammar_depth", self.max_grammar_depth, "must be a whole number from 1 to 16384 "
             "(the compile threads' stack has room for that)")
        need(isinstance(self.devices, int) and 1 <= self.devices <= 64, "devices", self.devices,
             "must be a whole number of devices from 1 to 64")
        need(self.split in SPLITS, "split", self.split, f"must be one of {', '.join(SPLITS)}")
        if self.micro_batches != "auto":
            try:
                self.micro_batches = int(self.micro_batches)
            except (TypeError, ValueError):
                raise ConfigError(f"micro_batches = {self.micro_batches!r}: must be auto or a "
                                  "number of parts") from None
            need(1 <= self.micro_batches <= 64, "micro_batches", self.micro_batches,
                 "must be auto or 1 to 64 parts")
        need(isinstance(self.num_processes, int) and 1 <= self.num_processes <= 1024,
             "num_processes", self.num_processes,
             "must be a whole number of processes from 1 to 1024")
        need(isinstance(self.process_id, int) and 0 <= self.process_id < self.num_processes,
             "process_id", self.process_id,
             f"must be from 0 to num_processes - 1 = {self.num_processes - 1}")
        need((self.coordinator is not None) == (self.num_processes > 1), "coordinator",
             self.coordinator,
             "is needed with num_processes > 1 (process 0's HOST:PORT), and only then")
        if self.coordinator is not None:
            host, _, port = self.coordinator.rpartition(":")
            need(bool(host) and port.isdigit() and 1 <= int(port) <= 65534, "coordinator",
                 self.coordinator, "must be HOST:PORT with a port from 1 to 65534 (process 0 also "
                                   "listens on PORT + 1)")
            # process 0's channel and coordinator listen on HOST: off loopback, a stranger could
            # reach them, so the followers must prove a key (engine/distributed/group_channel.py)
            need(self.group_key_file is not None or _loopback(host), "coordinator",
                 self.coordinator,
                 "is not a loopback address, so the group needs a shared key: give every process "
                 "--group-key-file FILE, the same key on every host (e.g. made by: openssl rand "
                 "-hex 32 > FILE)")

    def attention_chunk(self) -> int:
        """Keys an attention step reads; KV lengths are multiples of it, and so is kv_resident."""
        if self.attn_chunk != "auto":
            return int(self.attn_chunk)
        p = 16
        while p < min(self.max_context, 256):
            p *= 2
        return p

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ConfigError(f"unknown engine settings: {', '.join(unknown)}")
        return cls(**d)


@dataclass
class ServerConfig:
    model: str | None = None             # GGUF path (None: the default SmolLM2)
    # an address, or several: "127.0.0.1,::1" (serve/__init__.py listen_sockets)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    # the id /v1/models reports (default: the file's name); a comma list: aliases
    model_name: str | None = None
    # a comma list /v1/models shows as the model's tags (llama.cpp's --tags)
    model_tags: str | None = None
    max_body_bytes: int = 8 << 20
    # requests waiting for a slot; beyond it: 503 + Retry-After at once
    max_queue: int = 256
    # text /tokenize reads and /detokenize answers; beyond it: 413
    max_tokenize_bytes: int = 1 << 20
    # ids /detokenize reads and /tokenize answers; beyond it: 413
    max_tokenize_ids: int = 1 << 18
    # an engine with work and no progress this long is killed and restarted
    engine_stall_s: float = 60.0
    # a request's headers and body must come whole this soon (0: no bound) where POST
    # /expert-profile writes (None: <cache>/expert-profiles)
    read_timeout_s: float = 30.0
    expert_profile_dir: str | None = None
    # let chat_template_kwargs replace the template or its inputs
    trust_request_chat_template: bool = False
    # llama.cpp's conventions (serve/llama/native.py, serve/llama/llama_routes.py)
    # origins a browser may call from: "*" (llama.cpp's default) or a comma list
    cors_origins: str = "*"
    # an unknown `model` is a 404 (vLLM's way) instead of the one model
    strict_model_name: bool = False
    slots_endpoint: bool = True          # GET /slots (llama.cpp's --slots / --no-slots)
    # GET /metrics (off: 501, as llama-server without --metrics) where POST
    # /slots/N?action=save|restore keeps its named files
    metrics_endpoint: bool = True
    slot_save_path: str | None = None
    props_writable: bool = False         # POST /props (llama.cpp's --props)
    chat_template_file: str | None = None   # a Jinja chat template to use instead of the model's
    # llama.cpp's --chat-template: a built-in name (gguf/named_templates.py) or Jinja
    chat_template: str | None = None
    # llama.cpp's --reasoning: the templates' enable_thinking (on/auto: true, off: false); None: not
    # passed, as transformers renders (a request's chat_template_kwargs override it either way)
    reasoning: str | None = None
    # llama.cpp's --reasoning-budget: the most tokens a reasoning section takes when a request sets
    # no budget (-1: no limit; 0: no reasoning): serve/prompts.py, engine/schedule/thinking.py
    reasoning_budget: int = -1
    # every answer carries llama.cpp's "__verbose" (the prompt text, ...)
    verbose_responses: bool = False
    # a chat ending in the assistant's message continues it (llama.cpp's default)
    prefill_assistant: bool = False
    # llama.cpp's answers where they differ from OpenAI's and vLLM's (serve/app.py)
    llama_conventions: bool = False
    # the chat page at / (serve/http/webui.py; llama.cpp's --no-webui turns it off)
    webui: bool = True
    # embeddings: auto (the file's, else last) | last | mean | cls | none
    pooling: str = "auto"
    # GET/POST /cors-proxy?url= (serve/http/cors_proxy.py; llama.cpp's --ui-mcp-proxy)
    cors_proxy: bool = False
    # a /cors-proxy answer's body: longer is cut (declared longer: 502)
    cors_proxy_max_bytes: int = 16 << 20
    # OpenAI Responses kept for previous_response_id and GET (serve/http/responses_store.py): at
    # most this many, and this many MiB of their JSON; the least recently used go first
    responses_max: int = 1000
    responses_max_mib: int = 64
    # server-wide sampling defaults a request overrides (llama.cpp's --temp, --top-k, ..., -n);
    # None: the built-in
    sampling: dict = field(default_factory=dict)

    SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty", "repeat_last_n",
                     "presence_penalty", "frequency_penalty", "n_predict")

    def __post_init__(self) -> None:
        if not (0 <= self.port <= 65535):
            raise ConfigError(f"port = {self.port!r}: must be 0 to 65535")
        if not (isinstance(self.max_queue, int) and 0 <= self.max_queue <= 1 << 20):
            raise ConfigError(f"max_queue = {self.max_queue!r}: must be a whole number from 0 to "
                              "1048576")
        for name in ("max_tokenize_bytes", "max_tokenize_ids"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool)
                    and 1 <= value <= 1 << 30):
                raise ConfigError(f"{name} = {value!r}: must be a whole number from 1 to {1 << 30}")
        if not (isinstance(self.cors_proxy_max_bytes, int)
                and 1 <= self.cors_proxy_max_bytes <= 1 << 40):
            raise ConfigError(f"cors_proxy_max_bytes = {self.cors_proxy_max_bytes!r}: must be a "
                              "whole number of bytes from 1 to 2**40 (--cors-proxy-max-bytes)")
        for name, top in (("responses_max", 1 << 20), ("responses_max_mib", 1 << 20)):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= top):
                raise ConfigError(f"{name} = {value!r}: must be a whole number from 0 to {top} "
                                  f"(--{name.replace('_', '-')}; 0: keep none)")
        if not (self.engine_stall_s > 0):
            raise ConfigError(f"engine_stall_s = {self.engine_stall_s!r}: must be > 0 seconds")
        if not (isinstance(self.read_timeout_s, (int, float))
                and 0 <= self.read_timeout_s <= 86400):
            raise ConfigError(f"read_timeout_s = {self.read_timeout_s!r}: must be 0 (no bound) to "
                              "86400 seconds")
        unknown = sorted(set(self.sampling) - set(self.SAMPLING_KEYS))
        if unknown:
            raise ConfigError(f"sampling: unknown default {unknown[0]!r}; the defaults are "
                              f"{', '.join(self.SAMPLING_KEYS)}")
        self.check_sampling()
        if self.reasoning not in (None, "on", "off", "auto"):
            raise ConfigError(f"reasoning = {self.reasoning!r}: must be on, off or auto")
        if (isinstance(self.reasoning_budget, bool) or not isinstance(self.reasoning_budget, int)
                or not -1 <= self.reasoning_budget < 2**31):
            raise ConfigError(f"--reasoning-budget {self.reasoning_budget!r}: must be a whole "
                              "number >= -1 (-1: no limit, 0: no reasoning, N: at most N tokens)")
        if not self.cors_origins.strip():
            raise ConfigError("cors_origins is empty: give '*' or a comma-separated list of "
                              "origins")

    def check_sampling(self, vocab_size: int | None = None) -> None:
        """The sampling defaults (--temp, ..., -n) judged as a request's own values are
        (config.default_problem); with the model's vocab_size, top_k within it (the CLI checks again
        once it has opened the model)."""
        for key, value in self.sampling.items():
            what = default_problem(key, value, vocab_size)
            if what:
                flag = ("-n/--n-predict" if key == "n_predict"
                        else "--" + key.replace("_", "-").replace("temperature", "temp"))
                raise ConfigError(f"{flag} {value!r}: {what}")
