"""The host part of the slots' KV (`--kv-resident N`): positions N.. of each slot, in host RAM.

The device cache holds a slot's first N positions; this store holds the rest, in numpy pages of
`page` positions a slot ({name: [layers, page, ...]}, layer-major so that one layer's block is one
slice), allocated when a position is first written. Window programs call `fetch` (which first stores
the window's new entries) as a host callback (model/kv_offload.py), from XLA's thread while the
engine thread waits for the window: only one window runs at a time, so the store needs no lock.

int8 KV keeps its int8 values and float32 scales here too: the program dequantizes what it fetches.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ...gguf import ModelSpec

# A fetch brings at most about this many bytes (every entry of a block, all the window's rows): a
# few callbacks a layer (each ~65 us on a CPU), and a small temporary on the device.
FETCH_BYTES = 8 << 20
PAGE_CHUNKS = 16              # attention chunks a page holds


class KVHostStore:
    def __init__(self, spec: ModelSpec, resident: int, cache_len: int, chunk: int, kv_dtype):
        if resident % chunk:
            raise ValueError(f"kv_resident = {resident}: must be a multiple of the attention chunk "
                             f"({chunk})")
        self.resident = resident                       # positions a slot keeps on the device
        self.capacity = cache_len - resident           # positions a slot may keep here
        self.page = chunk * PAGE_CHUNKS
        # as new_kv_cache: MTP layers too
        self.n_layers = spec.n_layers + getattr(spec, "n_nextn", 0)
        K = spec.n_kv_heads
        self.entries: dict[str, tuple[tuple[int, ...], np.dtype]] = {
            "k": ((K, spec.head_dim), np.dtype(kv_dtype)),
            "v": ((K, spec.value_dim), np.dtype(kv_dtype))}
        if np.dtype(kv_dtype) == np.int8:
            self.entries |= {"k_scale": ((K,), np.dtype(np.float32)),
                             "v_scale": ((K,), np.dtype(np.float32))}
        self.names = tuple(self.entries)
        # bytes of one position of one layer, every entry
        self.position_bytes = sum(int(np.prod(s)) * d.itemsize for s, d in self.entries.values())
        # slot -> page index -> entries
        self.pages: dict[int, dict[int, dict[str, np.ndarray]]] = {}
        self.fetches = 0
        self.fetched_bytes = 0

    # ---- host callbacks (called from inside window programs) -------------------------------------

    def write(self, layer, slots, pos, *arrays) -> None:
        """Store layer `layer`'s new entries ([R, L, ...] by name, as the cache keeps them) at their
        positions pos [R, L] that are >= resident; others (device positions, padding) are
        skipped."""
        layer = int(layer)
        for r, slot in enumerate(np.asarray(slots)):
            p = np.asarray(pos[r])
            sel = p >= self.resident
            if not sel.any():
                continue
            page_of, at = np.divmod(p[sel] - self.resident, self.page)
            for pg in np.unique(page_of):
                here = page_of == pg
                dst = self._page(int(slot), int(pg))
                for name, a in zip(self.names, arrays):
                    dst[name][layer, at[here]] = np.asarray(a[r])[sel][here]

    def fetch(self, length: int, layer, slots, ends, start, pos, *new) -> tuple[np.ndarray, ...]:
        """Store the window's new entries of layer `layer` (`write(layer, slots, pos, *new)`: every
        fetch of the layer gets them; storing twice stores the same), then -> the entries at
        positions start..start+length of each row's slot ([R, length, ...] by name). Positions at or
        past the row's end (ends [R]: its last query position + 1) and those never written are
        zeros: no query of the row sees them."""
        self.write(layer, slots, pos, *new)
        out, copied = self._copy(length, int(layer), slots, ends, int(start))
        self.fetches += 1
        self.fetched_bytes += copied * self.position_bytes
        return out

    def _copy(self, length: int, layer: int, slots, ends,
              start: int) -> tuple[tuple[np.ndarray, ...], int]:
        off = start - self.resident
        R = len(slots)
        out = {n: np.zeros((R, length, *s), d) for n, (s, d) in self.entries.items()}
        copied = 0
        for r, slot in enumerate(np.asarray(slots)):
            pages = self.pages.get(int(slot), {})
            a, stop = off, min(off + length, int(ends[r]) - self.resident)
            copied += max(0, stop - a)
            while a < stop:
                pg, at = divmod(a, self.page)
                n = min(self.page - at, stop - a)
                src = pages.get(pg)
                if src is not None:
                    for name in self.names:
                        out[name][r, a - off:a - off + n] = src[name][layer, at:at + n]
                a += n
        return tuple(out[n] for n in self.names), copied

    def block(self, rows: int, n_positions: int, chunk: int) -> int:
        """Positions a fetch brings: a whole number of chunks that divides n_positions, at most
        FETCH_BYTES for the window's rows (never less than one chunk)."""
        n_chunks = n_positions // chunk
        most = max(1, FETCH_BYTES // max(1, rows * chunk * self.position_bytes))
        best = max(d for d in range(1, min(n_chunks, most) + 1) if n_chunks % d == 0)
        return best * chunk

    # ---- the engine's side -----------------------------------------------------------------------

    def read(self, slot: int, start: int, end: int) -> dict[str, np.ndarray]:
        """Positions [start, end) (all >= resident) of a slot: {name: [layers, end - start,
        ...]}."""
        out = {}
        for layer in range(self.n_layers):
            got, _ = self._copy(end - start, layer, np.array([slot]), np.array([end]), start)
            for name, a in zip(self.names, got):
                out.setdefault(name, []).append(a[0])
        return {n: np.stack(v) for n, v in out.items()}

    def put(self, slot: int, start: int, entries: dict[str, np.ndarray]) -> None:
        """Write {name: [layers, n, ...]} at positions start.. (all >= resident) of a slot: the
        inverse of read (restoring a slot's KV from elsewhere, e.g. a conversation cache)."""
        n = next(iter(entries.values())).shape[1]
        pos = np.arange(start, start + n, dtype=np.int32)[None]                       # [1, n]
        for layer in range(self.n_layers):
            self.write(layer, np.array([slot]), pos,
                       *(entries[name][layer][None] for name in self.names))

    @contextmanager
    def scratch(self, kept: dict | None = None):
        """A blank store for the duration (eng.logits runs on a scratch cache: the slots' KV stays);
        kept: carries it from use to use (KVCache.scratch)."""
        saved, self.pages = self.pages, (kept.pop("pages", {}) if kept is not None else {})
        try:
            yield
            if kept is not None:
                kept["pages"] = self.pages
        finally:
            self.pages = saved

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for pages in self.pages.values() for p in pages.values()
                   for a in p.values())

    def stats(self) -> dict:
        return {"kv_resident": self.resident, "host_kv_bytes": self.nbytes,
                "host_kv_fetches": self.fetches, "host_kv_fetched_bytes": self.fetched_bytes}

    def _page(self, slot: int, pg: int) -> dict[str, np.ndarray]:
        pages = self.pages.setdefault(slot, {})
        if pg not in pages:
            if pg * self.page >= self.capacity:
                raise IndexError(f"position {self.resident + pg * self.page} is past the slot's "
                                 "context")
            pages[pg] = {n: np.zeros((self.n_layers, self.page, *s), d)
                         for n, (s, d) in self.entries.items()}
        return pages[pg]
