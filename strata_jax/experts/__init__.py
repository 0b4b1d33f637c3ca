"""Expert tiers: the device cache (an arena of expert slots per MoE layer), the host tier (experts
in host RAM), the file tier (the GGUF memory map), the eviction policy, and counters."""

from .arena import ExpertArena, slot_bytes
from .host import EXPERT_TENSORS, HostTier, expert_tensors
from .policy import POLICIES, make_policy
from .stats import ExpertCounters, resident_line

__all__ = ["EXPERT_TENSORS", "POLICIES", "ExpertArena", "ExpertCounters", "HostTier",
           "expert_tensors", "make_policy", "resident_line", "slot_bytes"]
