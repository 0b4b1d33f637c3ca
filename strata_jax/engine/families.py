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

gpt-oss runs as the attention families do (its windowed layers keep full-length KV, the window in
the mask), with --kv-resident and several devices refused (_gpt_oss_config).
"""

from __future__ import annotations

import logging
from dataclasses import replace

from ..config import ConfigError, EngineConfig

log = logging.getLogger("strata_jax.engine")


def is_hybrid(spec) -> bool:
    return spec.deltanet is not None


def family_config(cfg: EngineConfig, spec) -> EngineConfig:
    """cfg as the engine runs spec's family: unchanged for the attention families; for a hybrid one,
    prefix reuse off; and a ConfigError for a setting the family cannot run with yet (_refuse).
    deepseek2 (MLA: model/mla.py) runs as the attention families but for --kv-resident (its host
    blocks would hold values its cache does not store)."""
    if getattr(spec, "mla", None) is not None:
        _refuse(cfg, spec, "its latent KV cache keeps every position on the device", devices=False)
        return cfg
    if spec.attn_sinks:
        return _gpt_oss_config(cfg, spec)
    if not is_hybrid(spec):
        return cfg
    arch = spec.architecture
    _refuse(cfg, spec, "its Gated DeltaNet state cannot be cut back or split; issue 34")
    if cfg.conversation_cache_mib:
        log.info("%s: --conversation-cache-mib is off (it keeps KV without the recurrent state it "
                 "goes with); prefix reuse resumes from state checkpoints "
                 "(--ctx-checkpoints)", arch)
    return replace(cfg, conversation_cache_mib=0)


def _refuse(cfg: EngineConfig, spec, why: str, devices: bool = True) -> None:
    """A ConfigError naming the setting for --kv-resident and (devices) several devices or
    processes, which the family does not run with yet (why)."""
    refused = [(cfg.kv_resident is not None, f"--kv-resident {cfg.kv_resident}")]
    if devices:
        refused += [(cfg.devices > 1, f"--devices {cfg.devices}"),
                    (cfg.num_processes > 1, f"--num-processes {cfg.num_processes}")]
    for on, what in refused:
        if on:
            raise ConfigError(f"{what}: not supported yet for {spec.architecture!r} ({why})")


def _gpt_oss_config(cfg: EngineConfig, spec) -> EngineConfig:
    """gpt-oss (model/gpt_oss.py) runs as the attention families do, its sliding-window layers'
    KV full-length (the window is in the attention mask), so prefix reuse, forks and the
    conversation cache need nothing of their own. Refused, with a ConfigError that names the
    setting: --kv-resident (the cpu kernel's host-block parts have no sinks or window yet) and
    several devices or processes (the experts' biases are not split with them yet). The expert
    tiers run it: its expert biases stay resident and go to the stages with the shared expert
    (model/params.ExpertSide; a copy on the host device for --host-experts' remote programs)."""
    _refuse(cfg, spec, "its attention sinks, sliding window and expert biases are not carried "
                       "there yet")
    return cfg
