"""What the engine does differently for a model family: one place that says it.

The hybrid families (qwen3next, qwen35moe) keep a fixed-size Gated DeltaNet state a slot
(model/hybrid.py) that, unlike KV, cannot be cut back to an earlier token. So the engine runs them:
- with prefix reuse only where a state exists (state_checkpoints.py: the slot's live state, or a
  checkpoint kept in host RAM), no KV forks between slots and no conversation cache (KV without its
  state);
- without packed windows (a packed window gives each prompt token a row of its own: a recurrence
  needs a row a slot);
- speculative decoding keeps each verify window's state after every token and takes the one after
  the accepted drafts (model/hybrid.py, KVCache.keep_steps; a hybrid draft model is refused: its own
  state could not drop rejected drafts);
and refuses, with a ConfigError that names the setting, what is not built for them yet:
--kv-resident, several devices or processes. The MTP drafter runs as for glm4moe: its block is gated
attention with KV of its own (KV layer spec.kv_layer(n_layers)), no recurrent state. The expert
tiers run them as any MoE family (model/stages.py's attention stage is a DeltaNet layer's mixing for
those layers).

gpt-oss keeps its sliding-window layers' keys and values in a ring a slot (the window and the most
tokens a slot reads in one window: model/transformer.py's ring_shapes), a slot's state as the hybrid
families' DeltaNet state is: so prefix reuse resumes only at the slot's live state or a state
checkpoint, with no forks and no conversation cache, as theirs (keeps_state); its verify windows
need nothing more (a rejected draft's ring entry is never read: transformer._ring_attention), and
its packed windows run (a token's keys are gathered for it alone). Several devices run it
(--devices N, both splits: _gpt_oss_config); --kv-resident and several processes are refused.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ..config import ConfigError, EngineConfig

log = logging.getLogger("strata_jax.engine")


def is_hybrid(spec) -> bool:
    return spec.deltanet is not None


def keeps_state(spec) -> bool:
    """Whether the family keeps a state a slot beside its positional KV (a hybrid family's DeltaNet
    state, gpt-oss's sliding-window rings): one that exists only at the tokens where it was taken,
    so prefix reuse resumes only there (engine/schedule/state_checkpoints.py)."""
    return is_hybrid(spec) or bool(spec.ring_layers)


def family_config(cfg: EngineConfig, spec) -> EngineConfig:
    """cfg as the engine runs spec's family: unchanged for the attention families; for a hybrid one
    (and gpt-oss: keeps_state), prefix reuse from state checkpoints only; and a ConfigError for a
    setting the family cannot run with yet (_refuse). deepseek2 (MLA: model/mla.py) runs as the
    attention families but for --kv-resident (its host blocks would hold values its cache does not
    store)."""
    if getattr(spec, "mla", None) is not None:
        _refuse(cfg, spec, "its latent KV cache keeps every position on the device", devices=False)
        return cfg
    if spec.attn_sinks:
        cfg = _gpt_oss_config(cfg, spec)
        return (_no_conversation_cache(cfg, spec, "the sliding-window layers' rings")
                if keeps_state(spec) else cfg)
    if not is_hybrid(spec):
        return cfg
    _refuse(cfg, spec, "its Gated DeltaNet state cannot be cut back or split; issue 34")
    return _no_conversation_cache(cfg, spec, "the recurrent state")


def _no_conversation_cache(cfg: EngineConfig, spec, state: str) -> EngineConfig:
    """cfg with the conversation cache off (keeps_state: it would keep KV without `state`, which
    goes with it)."""
    if cfg.conversation_cache_mib:
        log.info("%s: --conversation-cache-mib is off (it keeps KV without %s it goes with); "
                 "prefix reuse resumes from state checkpoints (--ctx-checkpoints)",
                 spec.architecture, state)
    return replace(cfg, conversation_cache_mib=0)


def _refuse(cfg: EngineConfig, spec, why: str, devices: bool = True,
            processes: bool | None = None) -> None:
    """A ConfigError naming the setting for --kv-resident, (devices) several devices and
    (processes: as devices unless given) several processes, which the family does not run with yet
    (why)."""
    refused = [(cfg.kv_resident is not None, f"--kv-resident {cfg.kv_resident}")]
    if devices:
        refused.append((cfg.devices > 1, f"--devices {cfg.devices}"))
    if devices if processes is None else processes:
        refused.append((cfg.num_processes > 1, f"--num-processes {cfg.num_processes}"))
    for on, what in refused:
        if on:
            raise ConfigError(f"{what}: not supported yet for {spec.architecture!r} ({why})")


def _gpt_oss_config(cfg: EngineConfig, spec) -> EngineConfig:
    """gpt-oss (model/gpt_oss.py) runs as the attention families do but for its sliding-window
    layers' rings, a slot's state (keeps_state: prefix reuse from state checkpoints, no forks, no
    conversation cache). The expert tiers run it: its expert biases stay resident and go to the
    stages with the shared expert (model/params.ExpertSide; a copy on the host device for
    --host-experts' remote programs). --devices N runs it with either split: --split experts keeps
    the expert biases, sinks and windows replicated with the other non-expert weights (a row's
    biases are read by its true expert id on the device that holds the expert:
    layers.sharded_expert_rows); --split layers gives each stage its own layers' rings
    (distributed/pipeline.stage_spec: the sliding-window layers renumbered in the stage, KVCache's
    per-stage arrays, whose read_state / write_state join and split them for state checkpoints).
    Refused, with a ConfigError that names the setting: --kv-resident (the cpu kernel's host-block
    parts have no sinks or window yet) and --num-processes N (a state checkpoint's rings written
    into a slot on process 0 would not reach the others' replicas: LockstepKV sends the positional
    KV's read, write and copy only)."""
    if cfg.kv_resident is not None:
        _refuse(cfg, spec, "the cpu kernel's host-block parts have no attention sinks or sliding "
                           "window yet", devices=False)
    _refuse(cfg, spec, "its sliding-window rings, a slot's state, are not sent to the other "
                       "processes (the positional KV alone is); --devices N runs it",
            devices=False, processes=True)
    return cfg
