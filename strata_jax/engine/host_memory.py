"""The host memory this engine may use, and the check at start that what the flags ask it to
allocate there fits.

The limit is the smallest of the machine's RAM (/proc/meminfo's MemTotal) and every memory cgroup
limit over this process (cgroup v2 `memory.max` from its own cgroup up to the root; v1
`memory.limit_in_bytes`): in a container that is the container's limit, which the kernel's OOM
killer enforces, not the host's RAM. `--memory-limit-gib` sets a lower one (room for other
processes). The check counts the private memory the flags size — the KV cache and the device expert
cache (both RAM on a CPU device; the KV's host-RAM part with --kv-resident on any), copies of the
weights (packed or dequantized), the host expert tier's --resident-budget-gib, the conversation
cache — plus a reserve for the runtime;
the GGUF file's own pages are not counted (the kernel can drop them: a model larger than RAM runs
from its file), except the tensors off XLA's 64-byte boundary, which the runtime copies
(GGUF aligns to 32; model/weights.py in_place). A start that cannot fit is a ConfigError with
every figure, before any is allocated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..config import ConfigError

GiB = 1 << 30
# JAX's runtime, the compiled programs and Python: what the ledger does not itemize
RUNTIME_RESERVE = 1 * GiB


@dataclass(frozen=True)
class MemoryLimit:
    bytes: int
    source: str          # where the figure comes from, for messages


def memory_limit(cfg_gib: float | None = None, root: Path = Path("/"),
                 ) -> MemoryLimit | None:
    """The memory this process may use (the smallest limit found), or None where none can be
    read. `root` lets tests give a fake /proc and /sys."""
    found: list[MemoryLimit] = []
    total = _mem_total(root)
    if total is not None:
        found.append(MemoryLimit(total, "the machine's RAM (MemTotal)"))
    found += _cgroup_limits(root)
    if cfg_gib is not None:
        found.append(MemoryLimit(int(cfg_gib * GiB), f"--memory-limit-gib {cfg_gib:g}"))
    return min(found, key=lambda m: m.bytes) if found else None


def cgroup_available(root: Path = Path("/")) -> int | None:
    """Bytes the tightest memory cgroup over this process has left (its limit less its usage), or
    None outside a limited cgroup: MemAvailable alone would promise a container the host's RAM."""
    left = []
    for d in _cgroup_dirs(root):
        limit, usage = _read_int(d / "memory.max"), _read_int(d / "memory.current")
        if limit is None:                                          # v1
            limit, usage = (_read_int(d / "memory.limit_in_bytes"),
                            _read_int(d / "memory.usage_in_bytes"))
        if limit is not None and usage is not None and limit < (1 << 60):
            left.append(max(0, limit - usage))
    return min(left) if left else None


@dataclass(frozen=True)
class HostNeeds:
    """What the flags ask the engine to allocate in host RAM, item by item (bytes)."""

    items: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.items.values()) + RUNTIME_RESERVE

    def check(self, limit: MemoryLimit | None) -> None:
        """ConfigError naming every figure when they cannot fit in `limit`."""
        if limit is None or self.total <= limit.bytes:
            return
        shown = ", ".join(f"{what}: {n / GiB:.2f} GiB" for what, n in self.items.items() if n)
        raise ConfigError(
            f"the engine would need {self.total / GiB:.2f} GiB of host memory ({shown}, the "
            f"runtime's reserve: {RUNTIME_RESERVE / GiB:.2f} GiB) and may use "
            f"{limit.bytes / GiB:.2f} GiB ({limit.source}): lower --parallel, --max-context, "
            "--resident-budget-gib, --conversation-cache-mib or --expert-cache, or use --kv int8")


def budget_items(cfg, is_moe: bool) -> dict[str, int]:
    """The host memory the flags give as figures: the host expert tier's budget and the
    conversation cache (the engine adds what depends on its device: runner.py _host_needs)."""
    items = {}
    if is_moe and cfg.resident_budget_gib:
        items[f"--resident-budget-gib {cfg.resident_budget_gib:g}"] = int(
            cfg.resident_budget_gib * GiB)
    if cfg.conversation_cache_mib:
        items[f"--conversation-cache-mib {cfg.conversation_cache_mib}"] = (
            int(cfg.conversation_cache_mib * 2**20))
    return items


def check_flags(cfg, is_moe: bool) -> None:
    """The server's check before it starts an engine (cli.py: refused at once, not in an engine that
    restarts forever): the figures the flags give directly."""
    HostNeeds(budget_items(cfg, is_moe)).check(memory_limit(cfg.memory_limit_gib))


def meminfo(key: str, root: Path = Path("/")) -> int | None:
    """/proc/meminfo's `key` (MemTotal, MemAvailable) in bytes, or None where it cannot be read."""
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _mem_total(root: Path) -> int | None:
    total = meminfo("MemTotal", root)
    if total is not None:
        return total
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_dirs(root: Path) -> list[Path]:
    """This process's memory cgroup folders, its own first, then each parent up to the root (a
    parent's limit binds its children)."""
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return []
    dirs = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers == "":                                    # v2: "0::/path"
            base = root / "sys/fs/cgroup"
            if not (base / "cgroup.controllers").exists() and (base / "unified").is_dir():
                base = base / "unified"                        # v1 and v2 side by side
        elif "memory" in controllers.split(","):                 # v1: "N:memory:/path"
            base = root / "sys/fs/cgroup/memory"
        else:
            continue
        path = base / rel.lstrip("/")
        while True:
            dirs.append(path)
            if path == base:
                break
            path = path.parent
    return dirs


def _cgroup_limits(root: Path) -> list[MemoryLimit]:
    out = []
    for d in _cgroup_dirs(root):
        for name in ("memory.max", "memory.limit_in_bytes"):
            n = _read_int(d / name)
            # v1 writes "no limit" as a huge number (PAGE_COUNTER_MAX pages)
            if n is not None and n < (1 << 60):
                out.append(MemoryLimit(n, f"the memory cgroup's limit ({d / name})"))
    return out


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None               # "max": no limit
