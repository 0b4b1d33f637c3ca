"""llama.cpp's slot files (POST /slots/N?action=save|restore|erase): a slot's kept KV and its
tokens, in a file.

    save     slot N's kept KV (the whole prefix-cache blocks of its last request) -> FILE: tokens +
             KV arrays
    restore  FILE -> slot N (a free slot): its KV and tokens, so a request whose prompt starts with
             those tokens reuses them (the prefix cache matches it like any kept KV)
    erase    slot N forgets its kept KV

The file is our own (numpy's .npz: `tokens`, and each KV array as raw bytes with its dtype and
shape), not llama.cpp's state format; a file made for another model or KV type is refused, naming
what differs. The slot's arrays are read and written on the engine thread between windows
(Engine.between_windows); the file is read and written in the caller's thread. Only whole blocks are
kept (prefix_cache.block_tokens), as the prefix cache keeps them; a hybrid family's slot (qwen3next,
qwen35moe) keeps all its tokens and, beside their KV, its Gated DeltaNet state, which exists at
their end only (state_checkpoints.py).

Files are handled as an attacker could have planted them: the folder must be the server user's and
writable by no one else (`folder`, checked at start and at each request); save writes a random
temporary name opened O_CREAT|O_EXCL|O_NOFOLLOW, mode 0600, renamed into place (a planted link is
never written through); restore opens the file O_NOFOLLOW and reads the zip's directory first: every
member's inflated size must be what this model's KV needs for the file's tokens before a byte of KV
is inflated (a small file cannot inflate to GBs), and arrays are read as raw bytes of the expected
type (never pickles).
"""

from __future__ import annotations

import math
import os
import secrets
import stat
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..model.transformer import POSITIONAL, STATE

if TYPE_CHECKING:
    from .core import EngineCore

HEADER = 4096               # the most an .npy member's header may take (numpy writes ~128 bytes)


class SlotFileError(ValueError):
    """A request the slot files cannot serve: the message says why, for the client."""


def run(engine: EngineCore, action: str, slot: int, path: str | None) -> dict[str, Any]:
    """Engine.slot_action: the file is read or written in the caller's thread, the slot on the
    engine's."""
    if not 0 <= slot < len(engine.slots):
        raise SlotFileError(f"slot {slot}: this server has slots 0..{len(engine.slots) - 1}")
    if action == "save":
        return save(engine, slot, path)
    if action == "restore":
        return restore(engine, slot, path)
    if action == "erase":
        return {"id_slot": slot, "n_erased": engine.between_windows(lambda: _erase(engine, slot))}
    raise SlotFileError(f"action = {action!r}: give save, restore or erase")


def folder(path: str) -> Path:
    """--slot-save-path, made (private: 0700) if missing. An existing one that is not the server
    user's, or that its group or others may write to, is refused: whoever can write there could
    plant a file or a link for the server to read, or to write through."""
    p = Path(path).expanduser()
    try:
        p.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = p.stat()
    except OSError as e:
        raise SlotFileError(f"--slot-save-path {p}: cannot make or read the folder "
                            f"({e.strerror or e})") from None
    if not stat.S_ISDIR(st.st_mode):
        raise SlotFileError(f"--slot-save-path {p}: not a folder")
    if st.st_uid != os.geteuid():
        raise SlotFileError(f"--slot-save-path {p}: the folder is user {st.st_uid}'s, not this "
                            f"server's ({os.geteuid()}): give a folder of the server's own user")
    if st.st_mode & 0o022:
        raise SlotFileError(f"--slot-save-path {p}: the folder's mode {stat.S_IMODE(st.st_mode):o} "
                            "lets others write there (they could plant files or links): give a "
                            "folder only its owner writes to (chmod go-w, or a new one: the server "
                            "makes it 700)")
    return p


def save(engine: EngineCore, slot: int, path: str) -> dict[str, Any]:
    tokens, kv = engine.between_windows(lambda: _read(engine, slot))
    arrays = {"tokens": np.asarray(tokens, np.int32)}
    for name, a in kv.items():
        arrays[f"kv.{name}"] = np.ascontiguousarray(a).view(np.uint8).reshape(-1)
        arrays[f"shape.{name}"] = np.asarray(a.shape, np.int64)
        arrays[f"dtype.{name}"] = np.asarray(str(a.dtype))
    where = Path(path)
    # a fresh random name beside the file ('.' first: never a slot file's name), made here and
    # nowhere else
    tmp = where.with_name(f".{where.name}.{secrets.token_hex(8)}.tmp")
    try:
        fd = os.open(tmp,
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                np.savez(f, **arrays)
                written = f.tell()
            os.replace(tmp, where)          # a link planted at the name is replaced, not followed
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
    except OSError as e:
        raise SlotFileError(f"filename {where.name!r}: cannot write it "
                            f"({e.strerror or e})") from None
    return {"id_slot": slot, "filename": where.name, "n_saved": len(tokens), "n_written": written}


def restore(engine: EngineCore, slot: int, path: str) -> dict[str, Any]:
    name = Path(path).name
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SlotFileError(f"filename {name!r}: no such slot file in the server's "
                            "--slot-save-path") from None
    except OSError as e:        # a link (ELOOP), ...: a slot file is a plain file of the folder
        raise SlotFileError(f"filename {name!r}: not a slot file this server reads "
                            f"({e.strerror or e}): a slot file is a plain file in "
                            "--slot-save-path, not a link") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise SlotFileError(f"filename {name!r}: not a plain file")
        size = os.fstat(f.fileno()).st_size
        try:
            tokens, kv = _read_file(f, _layout(engine), engine.runner.cache_len)
        except (ValueError, KeyError, OSError, TypeError, EOFError, zipfile.BadZipFile) as e:
            raise SlotFileError(f"filename {name!r}: not a slot file of this server "
                                f"({e})") from None
    n = engine.between_windows(lambda: _write(engine, slot, tokens, kv))
    return {"id_slot": slot, "filename": name, "n_restored": n, "n_read": size}


def _layout(engine: EngineCore) -> dict[str, tuple[np.dtype, tuple[int, ...]]]:
    """This model's KV arrays as a slot file holds them: {name: (dtype, shape of one position:
    [layers, ...])}, from the cache's arrays ([layers, slots, positions, ...], per pipeline stage:
    layers add up)."""
    arrays = engine.runner.kv.arrays
    parts = list(arrays) if isinstance(arrays, tuple) else [arrays]
    out = {}
    for name, a in parts[0].items():
        layers = sum(part[name].shape[0] for part in parts)
        if name in POSITIONAL:
            out[name] = (np.dtype(a.dtype), (layers, *a.shape[3:]), True)
        # a hybrid family's DeltaNet state: [layers, slots + 1, ...], one a slot
        elif name in STATE:
            out[name] = (np.dtype(a.dtype), (layers, *a.shape[2:]), False)
    return out


def _read_file(f: Any, layout: dict, cache_len: int) -> tuple[list[int], dict[str, np.ndarray]]:
    """A slot file's tokens and KV, every member's size judged from the zip's directory before it is
    inflated."""
    with zipfile.ZipFile(f) as zf:
        infos = {i.filename: i for i in zf.infolist()}
        want = {"tokens.npy"} | {f"{k}.{n}.npy" for n in layout for k in ("kv", "shape", "dtype")}
        extra = sorted(set(infos) - want)
        if extra or "tokens.npy" not in infos:
            raise ValueError(f"it holds {', '.join(extra[:3]) or 'no tokens'}; a slot file holds "
                             f"tokens and this model's KV arrays ({', '.join(sorted(layout))})")
        tokens = _member(zf, infos["tokens.npy"], 4 * cache_len)
        if tokens.dtype != np.int32 or tokens.ndim != 1:
            raise ValueError(f"its tokens are {tokens.dtype}{list(tokens.shape)}, not a list of "
                             "int32 ids")
        n = len(tokens)
        if n == 0:
            return [], {}
        missing = sorted(want - set(infos))
        if missing:
            raise ValueError(f"it has no {missing[0]}: a slot file restores on the model and KV "
                             "type that saved it")
        kv = {}
        for name, (dtype, per_pos, positional) in layout.items():
            shape = (per_pos[0], n, *per_pos[1:]) if positional else per_pos
            given = (str(_member(zf, infos[f"dtype.{name}.npy"], 64)),
                     _member(zf, infos[f"shape.{name}.npy"], 64))
            if given[0] != str(dtype) or tuple(int(x) for x in given[1]) != shape:
                raise ValueError(f"its KV {name!r} is {given[0]}{given[1].tolist()}, this "
                                 f"model's is {dtype}{list(shape)}: a slot file restores on the "
                                 "model and KV type that saved it")
            need = math.prod(shape) * dtype.itemsize
            raw = _member(zf, infos[f"kv.{name}.npy"], need, exact=True)
            kv[name] = raw.view(dtype).reshape(shape)
        return [int(t) for t in tokens], kv


def _member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int,
            exact: bool = False) -> np.ndarray:
    """One .npy member of at most `limit` data bytes (exactly `limit`, raw uint8, if exact). Its
    size is the zip directory's, checked before inflating (and zipfile stops at it); its header is
    checked before its data."""
    if info.file_size > limit + HEADER or (exact and info.file_size < limit):
        raise ValueError(f"{info.filename} inflates to {info.file_size} bytes, where this model's "
                         f"slot file holds {'exactly' if exact else 'at most'} {limit} bytes of "
                         "data")
    with zf.open(info) as g:
        version = np.lib.format.read_magic(g)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, fortran, dtype = read(g)
        if dtype.hasobject:
            raise ValueError(f"{info.filename} holds Python objects, which a slot file never does")
        nbytes = math.prod(shape) * dtype.itemsize
        if (nbytes != info.file_size - g.tell()
                or (exact and (dtype != np.uint8 or nbytes != limit))):
            raise ValueError(f"{info.filename}'s header says {dtype}{list(shape)}, not what the "
                             "member holds")
        data = g.read(nbytes)
    return np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C")


def _free(engine: EngineCore, slot: int):
    s = engine.slots[slot]
    if not s.free:
        raise SlotFileError(f"slot {slot} is running a request; try again when it is idle")
    return s


def _read(engine: EngineCore, slot: int) -> tuple[list[int], dict[str, np.ndarray]]:
    s = _free(engine, slot)
    block = engine.prefix.block
    hybrid = engine.prefix.states is not None
    # a hybrid family's state exists at the kept tokens' end only (state_checkpoints.py): all of
    # them, with it
    n = len(s.kept) if hybrid else len(s.kept) // block * block
    if n == 0:
        return [], {}
    kv = engine.runner.kv.read(s.index, 0, n)
    return list(s.kept[:n]), kv | engine.runner.kv.read_state(s.index) if hybrid else kv


def _write(engine: EngineCore, slot: int, tokens: list[int], kv: dict[str, np.ndarray]) -> int:
    s = _free(engine, slot)
    if not tokens:
        s.forget()
        return 0
    want = (engine.runner.kv.read(s.index, 0, len(tokens)) if len(tokens) <= engine.runner.cache_len
            else None)
    if want is None:
        raise SlotFileError(f"the file holds {len(tokens)} tokens; a slot holds "
                            f"{engine.runner.cache_len}")
    # a hybrid family's DeltaNet state ({} for the others)
    state = engine.runner.kv.read_state(s.index)
    want |= state
    for name, a in want.items():
        got = kv.get(name)
        if got is None or got.shape != a.shape or got.dtype != a.dtype:
            shown = "missing" if got is None else f"{got.dtype}{list(got.shape)}"
            raise SlotFileError(f"the file's KV {name!r} is {shown}, this model's is "
                                f"{a.dtype}{list(a.shape)}: a slot file restores on the model and "
                                "KV type that saved it")
    if any(not 0 <= t < engine.spec.vocab_size for t in tokens):
        raise SlotFileError("the file's tokens are outside this model's vocabulary")
    # while its KV is replaced, the slot matches nothing; after, no cache_salt's
    s.forget()
    engine.runner.kv.write(s.index, 0, {k: kv[k] for k in want if k not in state})
    if state:
        engine.runner.kv.write_state(s.index, {k: kv[k] for k in state})
    s.load(tokens, len(tokens))
    return len(tokens)


def _erase(engine: EngineCore, slot: int) -> int:
    s = _free(engine, slot)
    n = len(s.kept)
    s.forget()
    return n
