"""The device-memory ledger: what the engine put on the device, in bytes, against a budget.

On a GPU the budget is the device's own memory (its allocator's limit); with `--device-memory-mib M`
it is M MiB on any machine, which is how tests on a CPU make device memory run out. A reservation
that would leave less than `--vram-reserve-mib` free raises the same RESOURCE_EXHAUSTED error the
device raises, so one recovery path serves both.
"""

from __future__ import annotations

import threading

import jax

from ..faults import resource_exhausted

MiB = 1 << 20


class MemoryLedger:
    def __init__(self, budget_mib: float | None, reserve_mib: float):
        self.lock = threading.Lock()
        self.used: dict[str, int] = {"weights": 0, "kv": 0, "experts": 0, "programs": 0}
        self.budget = int(budget_mib * MiB) if budget_mib else _device_limit()
        # The reserve is for what the ledger does not see (XLA's own buffers, other processes); it
        # applies to an explicit budget too, so a budget of M MiB behaves like a device of M MiB.
        self.reserve = int(reserve_mib * MiB) if self.budget else 0

    @property
    def total(self) -> int:
        return sum(self.used.values())

    @property
    def free(self) -> int | None:
        return None if self.budget is None else self.budget - self.reserve - self.total

    def reserve_bytes(self, kind: str, n: int, what: str) -> None:
        with self.lock:
            if self.budget is not None and self.total + n > self.budget - self.reserve:
                raise resource_exhausted(
                    f"{what} needs {n / MiB:.1f} MiB of device memory; "
                    f"{max(0, self.free) / MiB:.1f} MiB free of {self.budget / MiB:.0f} MiB "
                    f"(weights {self.used['weights'] / MiB:.1f}, kv {self.used['kv'] / MiB:.1f}, "
                    f"experts {self.used['experts'] / MiB:.1f}, programs "
                    f"{self.used['programs'] / MiB:.1f}, reserve {self.reserve / MiB:.0f})")
            self.used[kind] += n

    def release(self, kind: str, n: int) -> None:
        with self.lock:
            self.used[kind] = max(0, self.used[kind] - n)

    def snapshot(self) -> dict[str, int | None]:
        with self.lock:
            return {**{f"{k}_bytes": v for k, v in self.used.items()}, "budget_bytes": self.budget,
                    "reserve_bytes": self.reserve, "free_bytes": self.free}


def _device_limit() -> int | None:
    """The device's memory limit where it reports one (GPUs); None (no limit) on a CPU."""
    dev = jax.devices()[0]
    if dev.platform == "cpu":
        return None
    try:
        stats = dev.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats
        return None
    return stats.get("bytes_limit")


def is_resource_exhausted(e: BaseException) -> bool:
    return isinstance(e, jax.errors.JaxRuntimeError) and "RESOURCE_EXHAUSTED" in str(e)
