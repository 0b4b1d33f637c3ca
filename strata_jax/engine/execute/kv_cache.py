"""The slots' KV cache and its one owner.

`arrays` is the device part, {name: [layers, slots, positions, ...]} (model.new_kv_cache): every
program that writes it takes it donated and gives it back, and `through` puts what came back in its
place, so the window program, the layer-stepped stages, the MTP drafter and the prefix cache's
copies all go through here and nothing else assigns it. `host` is the part past the device's
positions in host RAM (--kv-resident: kv_host.py), or None. Where a position lies (device below
`device_len`, host above) is known here alone: `read`, `write` and `copy` move runs of a slot's
positions wherever they lie (the prefix cache's forks and the conversation cache's blocks, slot
files).

Not owned here: the conversation cache's blocks (conversation_cache.py, held by the prefix cache).
They are copies of KV that left the slots, keyed by token prefix, not the slots' KV: they outlive a
lost or reset cache and a scratch one (Engine.logits), the programs never read them, and they come
back into a slot only by `write`. So the conversation cache owns its blocks, and this object owns
every array a program reads.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ...model import new_kv_cache
from ...model.transformer import POSITIONAL, STATE, ring_shapes, state_shapes
from .kv_host import KVHostStore


def kv_bytes(spec, dtype, parallel: int, device_len: int, steps: int = 0, ring: int = 0) -> int:
    """Device bytes of the cache of `parallel` slots of `device_len` positions (what the ledger
    reserves): the full-length layers' KV, gpt-oss's sliding-window layers' rings of `ring`
    entries a slot (model.transformer.ring_shapes) and a hybrid family's DeltaNet state."""
    # new_kv_cache: MTP layers too; not gpt-oss's ring layers
    layers = spec.n_kv_layers
    # MLA: the latent and rope key alone (its values are a view of them)
    per_pos = (layers * spec.n_kv_heads * (spec.head_dim + spec.cached_value_dim)
               * jnp.dtype(dtype).itemsize)
    if dtype == jnp.int8:
        # a float32 scale a token and head
        per_pos += layers * spec.n_kv_heads * 2 * 4
    # DeltaNet state, f32
    state = sum(4 * int(np.prod(s)) for s in state_shapes(spec, parallel, steps).values())
    rings = sum(int(np.prod(s)) * dt.itemsize
                for s, dt in ring_shapes(spec, parallel, device_len, dtype, ring).values())
    return per_pos * parallel * (device_len + 1) + state + rings


class KVCache:
    def __init__(self, spec, parallel: int, device_len: int, dtype, host: KVHostStore | None = None,
                 place: Callable[[dict], dict] | None = None, stages: list | None = None,
                 steps: int = 0, ring: int = 0):
        """place: where the arrays live when not on the default device (--split experts: on every
        device). stages (--split layers): [(a stage's spec, its device)]: the arrays are then a
        tuple of per-stage dicts, each [its layers, slots, ...] on its device (layer i of the model
        is layer i - start of its stage's), and read, write, copy and slot join or split them on the
        layer axis. steps: a hybrid family's verify windows' tokens a row
        (model.transformer.state_shapes; keep_steps). ring: gpt-oss's sliding-window layers' ring
        entries a slot (model.transformer.ring_size)."""
        make = lambda: new_kv_cache(spec, parallel, device_len, dtype, steps, ring)
        if stages is not None:
            # each stage's rings hold its own ring layers (pipeline.stage_spec), of `ring` entries
            make = lambda: tuple(jax.device_put(new_kv_cache(s, parallel, device_len, dtype, steps,
                                                             ring), d)
                                 for s, d in stages)
        self._new = make if place is None else (lambda: place(make()))
        self._arrays: dict[str, jax.Array] = self._new()
        # bumped whenever the arrays are replaced: a window run ahead is taken only if nothing else
        # ran on the cache after it (run_ahead.py)
        self._version = 0
        self.device_len = device_len
        self.ring = ring
        self.host = host
        self._read = jax.jit(_read_block, static_argnames=("size",))
        self._write = jax.jit(_write_block, donate_argnums=(0,))
        self._copy = jax.jit(_copy_blocks, donate_argnums=(0,), static_argnames=("size",))
        self._keep_steps = jax.jit(_keep_steps, donate_argnums=(0,))
        self._write_state = jax.jit(lambda c, state, slot: c
                                    | {k: c[k].at[:, slot].set(v) for k, v in state.items()},
                                    donate_argnums=(0,))

    @property
    def arrays(self) -> dict[str, jax.Array]:
        return self._arrays

    @property
    def version(self) -> int:
        """How many times the arrays were replaced (a program's run, a reset, a scratch cache)."""
        return self._version

    def _parts(self) -> list[dict]:
        """The per-stage dicts (one: the whole cache)."""
        return list(self._arrays) if isinstance(self._arrays, tuple) else [self._arrays]

    def _whole(self, parts: list[dict]):
        return tuple(parts) if isinstance(self._arrays, tuple) else parts[0]

    def through(self, run: Callable[[dict], Any]) -> Any:
        """run(arrays) -> (..., the new arrays): a program run on the cache that returns it last.
        The arrays become the new ones; the rest is returned (one value alone, several as a
        tuple)."""
        *out, self._arrays = run(self._arrays)
        self._version += 1
        return out[0] if len(out) == 1 else tuple(out)

    def lost(self) -> bool:
        """A failed run may have consumed the donated arrays: then they must be made anew
        (reset)."""
        return any(a.is_deleted() for a in jax.tree_util.tree_leaves(self._arrays))

    def reset(self) -> None:
        self._arrays = self._new()
        self._version += 1

    def wait(self) -> None:
        jax.block_until_ready(self._arrays)

    @contextmanager
    def scratch(self, kept: dict | None = None):
        """A blank cache (device and host parts) for the duration; the slots' own is put back after.
        kept: a dict that carries one scratch cache from use to use (embeddings, read a piece a step
        between windows): made on its first use, left in it after each one that succeeds."""
        saved = self._arrays
        self._arrays = kept.pop("arrays") if kept and "arrays" in kept else self._new()
        self._version += 1
        try:
            with self.host.scratch(kept) if self.host is not None else nullcontext():
                yield
            if kept is not None:
                kept["arrays"] = self._arrays
        finally:
            self._arrays = saved

    def slot(self, slot: int, n: int) -> dict[str, np.ndarray]:
        """A slot's first n positions, from the device and host parts: {name: [layers, n, ...]}."""
        d = min(n, self.device_len)
        out = _join([{name: np.asarray(a[:, slot, :d]) for name, a in _positional(part).items()}
                     for part in self._parts()])
        if n > d:
            host = self.host.read(slot, d, n)
            out = {name: np.concatenate([out[name], host[name]], axis=1) for name in out}
        return out

    def read(self, slot: int, start: int, size: int) -> dict[str, np.ndarray]:
        """Positions start..start+size of a slot, on the device and past device_len in host RAM ->
        {name: [layers, size, ...]} (k, v, int8 scales). One small program a size."""
        on_dev = max(0, min(start + size, self.device_len) - start)
        parts = []
        if on_dev:
            outs = [self._read(c, jnp.int32(slot), jnp.int32(start), size=on_dev)
                    for c in self._parts()]
            parts.append(_join([{k: np.asarray(v) for k, v in out.items()} for out in outs]))
        if on_dev < size:
            parts.append(self.host.read(slot, start + on_dev, start + size))
        return (parts[0] if len(parts) == 1
                else {k: np.concatenate([p[k] for p in parts], axis=1) for k in parts[0]})

    def write(self, slot: int, start: int, block: dict[str, np.ndarray]) -> None:
        """The inverse of read: the device part in place (a donated program), the rest to host
        RAM."""
        size = next(iter(block.values())).shape[1]
        on_dev = max(0, min(start + size, self.device_len) - start)
        if on_dev:
            part = block if on_dev == size else {k: v[:, :on_dev] for k, v in block.items()}
            # stages' first layers
            at = np.cumsum([0] + [next(iter(c.values())).shape[0] for c in self._parts()])
            self.through(lambda cs: (self._whole([
                self._write(c, {k: v[a:b] for k, v in part.items()}, jnp.int32(slot),
                            jnp.int32(start))
                for c, a, b in zip(self._parts(), at[:-1], at[1:])]),))
        if on_dev < size:
            self.host.put(slot, start + on_dev, {k: v[:, on_dev:] for k, v in block.items()})

    def read_state(self, slot: int) -> dict[str, np.ndarray]:
        """A slot's whole fixed-size state (a hybrid family's DeltaNet conv and delta-rule state,
        gpt-oss's rings): {name: [layers, ...]}, {} for the other families. With stages, their
        layers joined in order (a stage without ring layers has none: its rings are [0, ...])."""
        return _join([{name: np.asarray(a[:, slot]) for name, a in part.items() if name in STATE}
                      for part in self._parts()])

    def write_state(self, slot: int, state: dict[str, np.ndarray]) -> None:
        """The inverse of read_state, in place (a donated program; one a stage, each its own
        layers of the state)."""
        parts = self._parts()
        # each state array's first layer in each stage (a stage without ring layers has no rings)
        at = {k: np.cumsum([0] + [p[k].shape[0] if k in p else 0 for p in parts]) for k in state}
        self.through(lambda cs: (self._whole([
            self._write_state(c, {k: jnp.asarray(v[at[k][n]:at[k][n + 1]])
                                  for k, v in state.items() if k in c}, jnp.int32(slot))
            for n, c in enumerate(parts)]),))

    def keep_steps(self, slots: np.ndarray, steps: np.ndarray) -> None:
        """After a verify window: each slot's DeltaNet state becomes the one after step steps[i] of
        its row (its accepted tokens, the last one emitted included, less one), in place."""
        self.through(lambda c: (self._keep_steps(c, jnp.asarray(slots, jnp.int32),
                                                 jnp.asarray(steps, jnp.int32)),))

    def copy(self, src: int, dst: int, n_blocks: int, block: int) -> None:
        """Slot src's first n_blocks * block device positions into slot dst, a block at a time, in
        place."""
        self.through(lambda cs: (self._whole([self._copy(c, jnp.int32(src), jnp.int32(dst),
                                                         jnp.int32(n_blocks),
                                                         size=block) for c in self._parts()]),))


def _keep_steps(cache: dict, slots, steps) -> dict:
    conv, ssm = cache["conv_steps"][:, slots, steps], cache["ssm_steps"][:, slots, steps]
    return (cache | {"conv": cache["conv"].at[:, slots].set(conv),
                     "ssm": cache["ssm"].at[:, slots].set(ssm)})


def _positional(cache: dict) -> dict:
    """The arrays with a positions axis (KV and its scales): the ones read, written and copied by
    position. A hybrid family's DeltaNet state (model.transformer.state_shapes) has none: it is a
    slot's whole."""
    return {name: a for name, a in cache.items() if name in POSITIONAL}


def _join(parts: list[dict]) -> dict[str, np.ndarray]:
    """Per-stage {name: [its layers, ...]} -> one {name: [layers, ...]} (a name some stages lack,
    gpt-oss's rings in a stage without ring layers: the others' layers)."""
    names = dict.fromkeys(k for p in parts for k in p)
    return (parts[0] if len(parts) == 1
            else {k: np.concatenate([p[k] for p in parts if k in p]) for k in names})


def _read_block(cache: dict, slot, start, *, size: int) -> dict:
    """Positions start..start+size of one slot -> {name: [layers, size, ...]} (k, v, int8
    scales)."""
    out = {}
    # a [layers, slots, positions, kv_heads(, head_dim)]
    for name, a in _positional(cache).items():
        at = (0, slot, start) + (0,) * (a.ndim - 3)
        out[name] = lax.dynamic_slice(a, at, (a.shape[0], 1, size) + a.shape[3:])[:, 0]
    return out


def _write_block(cache: dict, block: dict, slot, start) -> dict:
    out = dict(cache)
    for name, a in _positional(cache).items():
        at = (0, slot, start) + (0,) * (a.ndim - 3)
        out[name] = lax.dynamic_update_slice(a, block[name][:, None].astype(a.dtype), at)
    return out


def _copy_blocks(cache: dict, src, dst, n_blocks, *, size: int) -> dict:
    """Positions 0..n_blocks*size of slot src copied into slot dst, a block at a time (a fork: n
    choices of one prompt, or requests sharing a system prompt, read it once)."""
    def body(i, c):
        out = dict(c)
        for name, a in _positional(c).items():
            rest = (0,) * (a.ndim - 3)
            blk = lax.dynamic_slice(a, (0, src, i * size) + rest,
                                    (a.shape[0], 1, size) + a.shape[3:])
            out[name] = lax.dynamic_update_slice(a, blk, (0, dst, i * size) + rest)
        return out
    return lax.fori_loop(0, n_blocks, body, cache)
