"""llama.cpp's slot files (POST /slots/N?action=save|restore|erase): a slot's kept KV and its tokens, in a file.

    save     slot N's kept KV (the whole prefix-cache blocks of its last request) -> FILE: tokens + KV arrays
    restore  FILE -> slot N (a free slot): its KV and tokens, so a request whose prompt starts with those
             tokens reuses them (the prefix cache matches it like any kept KV)
    erase    slot N forgets its kept KV

The file is our own (numpy's .npz: `tokens`, and each KV array as raw bytes with its dtype and shape), not
llama.cpp's state format; a file made for another model or KV type is refused, naming what differs. The
slot's arrays are read and written on the engine thread between windows (Engine.between_windows); the file
is read and written in the caller's thread. Only whole blocks are kept (prefix_cache.block_tokens), as the
prefix cache keeps them.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np


class SlotFileError(ValueError):
    """A request the slot files cannot serve: the message says why, for the client."""


def run(engine: Any, action: str, slot: int, path: str | None) -> dict[str, Any]:
    if not 0 <= slot < len(engine.slots):
        raise SlotFileError(f"slot {slot}: this server has slots 0..{len(engine.slots) - 1}")
    if action == "save":
        return save(engine, slot, path)
    if action == "restore":
        return restore(engine, slot, path)
    if action == "erase":
        return {"id_slot": slot, "n_erased": engine.between_windows(lambda: _erase(engine, slot))}
    raise SlotFileError(f"action = {action!r}: give save, restore or erase")


def save(engine: Any, slot: int, path: str) -> dict[str, Any]:
    tokens, kv = engine.between_windows(lambda: _read(engine, slot))
    arrays = {"tokens": np.asarray(tokens, np.int32)}
    for name, a in kv.items():
        arrays[f"kv.{name}"] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        arrays[f"shape.{name}"] = np.asarray(a.shape, np.int64)
        arrays[f"dtype.{name}"] = np.asarray(str(a.dtype))
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)
    return {"id_slot": slot, "filename": Path(path).name, "n_saved": len(tokens),
            "n_written": Path(path).stat().st_size}


def restore(engine: Any, slot: int, path: str) -> dict[str, Any]:
    if not Path(path).is_file():
        raise SlotFileError(f"filename {Path(path).name!r}: no such slot file in the server's --slot-save-path")
    try:
        with np.load(path, allow_pickle=False) as f:
            tokens = [int(t) for t in f["tokens"]]
            names = [k[3:] for k in f.files if k.startswith("kv.")]
            kv = {n: f[f"kv.{n}"].view(_dtype(str(f[f"dtype.{n}"]))).reshape(tuple(f[f"shape.{n}"])) for n in names}
    except (ValueError, KeyError, OSError, TypeError) as e:
        raise SlotFileError(f"filename {Path(path).name!r}: not a slot file of this server ({e})") from None
    n = engine.between_windows(lambda: _write(engine, slot, tokens, kv))
    return {"id_slot": slot, "filename": Path(path).name, "n_restored": n, "n_read": Path(path).stat().st_size}


def _dtype(name: str) -> np.dtype:
    return np.dtype(getattr(ml_dtypes, name, name))


def _free(engine: Any, slot: int):
    s = engine.slots[slot]
    if not s.free:
        raise SlotFileError(f"slot {slot} is running a request; try again when it is idle")
    return s


def _read(engine: Any, slot: int) -> tuple[list[int], dict[str, np.ndarray]]:
    s = _free(engine, slot)
    block = engine.prefix.block
    n = len(s.kept) // block * block
    if n == 0:
        return [], {}
    return list(s.kept[:n]), engine.prefix._read_kv(s.index, 0, n)


def _write(engine: Any, slot: int, tokens: list[int], kv: dict[str, np.ndarray]) -> int:
    s = _free(engine, slot)
    if not tokens:
        s.tokens, s.n_past = [], 0
        return 0
    want = engine.prefix._read_kv(s.index, 0, len(tokens)) if len(tokens) <= engine.runner.cache_len else None
    if want is None:
        raise SlotFileError(f"the file holds {len(tokens)} tokens; a slot holds {engine.runner.cache_len}")
    for name, a in want.items():
        got = kv.get(name)
        if got is None or got.shape != a.shape or got.dtype != a.dtype:
            shown = "missing" if got is None else f"{got.dtype}{list(got.shape)}"
            raise SlotFileError(f"the file's KV {name!r} is {shown}, this model's is {a.dtype}{list(a.shape)}: "
                                "a slot file restores on the model and KV type that saved it")
    if any(not 0 <= t < engine.spec.vocab_size for t in tokens):
        raise SlotFileError("the file's tokens are outside this model's vocabulary")
    s.forget()                          # while its KV is replaced, the slot matches nothing; after, no cache_salt's
    engine.prefix._write_kv(s.index, 0, {k: kv[k] for k in want})
    s.tokens, s.n_past = list(tokens), len(tokens)
    return len(tokens)


def _erase(engine: Any, slot: int) -> int:
    s = _free(engine, slot)
    n = len(s.kept)
    s.tokens, s.n_past = [], 0
    return n
