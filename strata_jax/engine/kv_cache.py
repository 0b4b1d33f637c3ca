"""The slots' KV cache and its one owner.

`arrays` is the device part, {name: [layers, slots, positions, ...]} (model.new_kv_cache): every program
that writes it takes it donated and gives it back, and `through` puts what came back in its place, so the
window program, the layer-stepped stages, the MTP drafter and the prefix cache's copies all go through
here and nothing else assigns it. `host` is the part past the device's positions in host RAM
(--kv-resident: kv_host.py), or None.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..model import new_kv_cache
from .kv_host import KVHostStore


class KVCache:
    def __init__(self, spec, parallel: int, device_len: int, dtype, host: KVHostStore | None = None):
        self._new = lambda: new_kv_cache(spec, parallel, device_len, dtype)
        self._arrays: dict[str, jax.Array] = self._new()
        self.device_len = device_len
        self.host = host

    @property
    def arrays(self) -> dict[str, jax.Array]:
        return self._arrays

    def through(self, run: Callable[[dict], Any]) -> Any:
        """run(arrays) -> (..., the new arrays): a program run on the cache that returns it last. The
        arrays become the new ones; the rest is returned (one value alone, several as a tuple)."""
        *out, self._arrays = run(self._arrays)
        return out[0] if len(out) == 1 else tuple(out)

    def lost(self) -> bool:
        """A failed run may have consumed the donated arrays: then they must be made anew (reset)."""
        return any(a.is_deleted() for a in jax.tree_util.tree_leaves(self._arrays))

    def reset(self) -> None:
        self._arrays = self._new()

    def wait(self) -> None:
        jax.block_until_ready(self._arrays)

    @contextmanager
    def scratch(self):
        """A blank cache (device and host parts) for the duration; the slots' own is put back after."""
        saved = self._arrays
        self._arrays = {k: jnp.zeros_like(v) for k, v in saved.items()}
        try:
            with self.host.scratch() if self.host is not None else nullcontext():
                yield
        finally:
            self._arrays = saved

    def slot(self, slot: int, n: int) -> dict[str, np.ndarray]:
        """A slot's first n positions, from the device and host parts: {name: [layers, n, ...]}."""
        d = min(n, self.device_len)
        out = {name: np.asarray(a[:, slot, :d]) for name, a in self._arrays.items()}
        if n > d:
            host = self.host.read(slot, d, n)
            out = {name: np.concatenate([out[name], host[name]], axis=1) for name in out}
        return out
