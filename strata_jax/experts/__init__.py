"""Expert tiers: the device cache (an arena of expert slots per MoE layer), the host tier (experts in host
RAM), the file tier (the GGUF memory map), the eviction policy, and counters."""

from .arena import ExpertArena
from .host import EXPERT_TENSORS, HostTier
from .policy import POLICIES, make_policy
from .stats import ExpertCounters, resident_line

__all__ = ["EXPERT_TENSORS", "POLICIES", "ExpertArena", "ExpertCounters", "HostTier", "make_policy", "resident_line"]
