"""The host tier and the file tier: where an expert's GGUF blocks come from when the device needs
them.

Host tier: experts copied into host RAM (numpy) up to `--resident-budget-gib` (default: all of
them), layer by layer. File tier: the rest, read from the GGUF file when needed, by a pool of
`--pool-workers` reader threads (a read is a few MiB: the threads overlap the disk's latency). File
reads are pread(2) on the part's own descriptor, not loads from the memory map: a file part
truncated or failing under the engine is then a short read or an OSError, which ends the requests
of that window with an ExpertReadError naming the file, layer and expert, instead of a SIGBUS that
kills the engine. Experts stay in their GGUF quant blocks in both tiers. Layers may differ in quant
types (a Q4_K_M file gives some layers' ffn_down_exps Q6_K), so an expert's size is per layer.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from ..model.params import EXPERT_TENSORS
from ..model.weights import release_file_pages

_GGUF_NAMES = {"exp_gate": "ffn_gate_exps", "exp_up": "ffn_up_exps", "exp_down": "ffn_down_exps"}


def expert_tensors(model, layer: int) -> dict:
    """A MoE layer's three expert tensors: name -> GGUF TensorInfo ([E, rows, row_bytes] blocks, its
    qtype)."""
    return {n: model.tensors[f"blk.{layer}.{_GGUF_NAMES[n]}.weight"] for n in EXPERT_TENSORS}


def _pread_into(fd: int, view: memoryview, at: int) -> int:
    """Bytes read into `view` from offset `at` (0 at the end of the file): preadv where the OS has
    it (no copy), else pread and a copy."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [view], at)
    data = os.pread(fd, len(view), at)
    view[:len(data)] = data
    return len(data)


class ExpertReadError(RuntimeError):
    """An expert's blocks could not be read from its GGUF file part (truncated, or an I/O error)."""


def aligned_empty(n_bytes: int) -> np.ndarray:
    """uint8 [n_bytes] starting on a 64-byte boundary (see aligned_copy)."""
    buf = np.empty(n_bytes + 64, np.uint8)
    off = -buf.ctypes.data % 64
    return buf[off:off + n_bytes]


def aligned_copy(a: np.ndarray) -> np.ndarray:
    """A copy of `a` starting on a 64-byte boundary: on a CPU jax.device_put then uses it in place
    (XLA's alignment), so copying an expert into the device cache is one copy, not two."""
    out = aligned_empty(a.nbytes).view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


class HostTier:
    def __init__(self, model, layers: list[int], budget_bytes: int | None, workers: int,
                 in_ram: dict[int, dict[str, np.ndarray]] | None = None):
        """in_ram: layers whose experts are in RAM already (layer -> name -> [E, n, row_bytes]: the
        packed host experts, or with a budget the layers it holds whole; see
        engine/execute/placement.py): the tier hands out views of them instead of copying the
        file's blocks."""
        self.layers = layers
        self.tensors = {i: expert_tensors(model, i) for i in layers}
        self.n_experts = self.tensors[layers[0]]["exp_gate"].shape[0]
        # quant types and widths may differ by layer; the count may not
        for i, ts in self.tensors.items():
            for n, t in ts.items():
                if t.shape[0] != self.n_experts:
                    raise ValueError(f"blk.{i}.{_GGUF_NAMES[n]}.weight holds {t.shape[0]} experts, "
                                     f"but layer {layers[0]}'s hold {self.n_experts}: the expert "
                                     "tiers need the same number of experts in every MoE layer")
        self.qtypes = {i: {n: t.qtype for n, t in ts.items()} for i, ts in self.tensors.items()}
        # layer -> bytes of one expert (its gate, up and down blocks)
        self.expert_bytes = {i: sum(int(t.data[0].nbytes) for t in ts.values())
                             for i, ts in self.tensors.items()}
        self.total_bytes = sum(self.expert_bytes.values()) * self.n_experts
        self.resident: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        budget = self.total_bytes if budget_bytes is None else budget_bytes
        self.resident_bytes = 0
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        for i in layers:                                 # layer by layer, as far as the budget goes
            copied = 0
            ram = None if in_ram is None else in_ram.get(i)
            for e in range(self.n_experts):
                if self.resident_bytes + self.expert_bytes[i] > budget:
                    break
                self.resident[(i, e)] = ({n: a[e] for n, a in ram.items()} if ram is not None else
                                         {n: aligned_copy(t.data[e])
                                          for n, t in self.tensors[i].items()})
                self.resident_bytes += self.expert_bytes[i]
                copied += 1
            if ram is None and copied:
                self.forget_file_pages(i, copied)
        self.file_reads = 0
        self.file_bytes = 0                                # read from the file tier
        self._pool = ThreadPoolExecutor(max_workers=workers,
                                        thread_name_prefix="strata-expert-read")

    def forget_file_pages(self, layer: int, n: int) -> None:
        """RAM holds experts 0..n-1 of `layer` now: their pages of the file leave this process's
        resident set and the page cache, so the machine holds them once. (Kept, the kernel would
        hold both copies until memory ran short, and a memory cgroup counts its page cache against
        the limit.) The file tier's reads stay cached: the kernel's cache is a free extra tier for
        experts RAM does not hold."""
        for t in self.tensors[layer].values():
            release_file_pages(t.data[:n])
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self._fd(t.path), t.offset, n * t.data[0].nbytes,
                                 os.POSIX_FADV_DONTNEED)

    def tier_of(self, layer: int, expert: int) -> str:
        return "host" if (layer, expert) in self.resident else "file"

    def get(self, layer: int, experts: list[int]) -> list[dict[str, np.ndarray]]:
        """The blocks of `experts` of `layer`: from RAM, or read from the file by the pool's
        threads."""
        futures = {e: self._pool.submit(self._read, layer, e) for e in experts
                   if (layer, e) not in self.resident}
        return [self.resident[(layer, e)] if e not in futures else futures[e].result()
                for e in experts]

    def _read(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        out = {n: self._pread(t, layer, expert) for n, t in self.tensors[layer].items()}
        with self._lock:
            self.file_reads += 1
            self.file_bytes += self.expert_bytes[layer]
        return out

    def _pread(self, t, layer: int, expert: int) -> np.ndarray:
        """Expert `expert`'s blocks of tensor `t` ([rows, row_bytes]), read from its file part."""
        row = t.data[expert]
        at = t.offset + expert * row.nbytes         # the tensor's experts lie one after another
        out = aligned_empty(row.nbytes)
        view, got = memoryview(out), 0
        try:
            fd = self._fd(t.path)
            while got < row.nbytes:
                n = _pread_into(fd, view[got:], at + got)
                if n == 0:
                    raise ExpertReadError(
                        f"{t.path}: expert {expert} of layer {layer} ({t.name}) ends at byte "
                        f"{at + row.nbytes:,}, but the file ends at {at + got:,}: it was truncated "
                        "or replaced while the engine read it")
                got += n
        except OSError as e:
            raise ExpertReadError(f"{t.path}: reading expert {expert} of layer {layer} ({t.name}) "
                                  f"at byte {at + got:,} failed: {e}") from None
        return out.view(row.dtype).reshape(row.shape)

    def _fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()
