"""`strata-jax bench --moe-twin E:K`: bench a MoE twin of a dense model instead of the model itself.

The twin is `strata-jax upcycle`'s output (makers/upcycle.py): each FFN copied into E experts with a
random top-K router, so it computes what the dense model does and reads the same quant blocks,
through the expert paths. It is made once and kept in the cache folder:

    <cache folder>/twins/<model stem>-<E>x<K>.gguf          ($STRATA_JAX_CACHE, else
                                                            ~/.cache/strata-jax)
    <cache folder>/twins/<model stem>-<E>x<K>.gguf.json     the source it was made from: path, size,
                                                            mtime

and made again when the source's path, size or modification time differ from the ones recorded.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from strata_jax.gguf import GGUFModel

_VALUE = re.compile(r"\s*(\d+)\s*:\s*(\d+)\s*")


def parse_moe_twin(value: str) -> tuple[int, int]:
    """'8:2' -> (8, 2): E experts, top-K; a ValueError naming the value otherwise."""
    m = _VALUE.fullmatch(value or "")
    if not m:
        raise ValueError(f"--moe-twin {value!r}: must be EXPERTS:TOP_K, e.g. 8:2")
    return check_moe_twin((int(m[1]), int(m[2])), value)


def check_moe_twin(twin: tuple[int, int], shown: str | None = None) -> tuple[int, int]:
    experts, top_k = twin
    shown = shown if shown is not None else f"{experts}:{top_k}"
    if experts < 2:
        raise ValueError(f"--moe-twin {shown!r}: a twin needs at least 2 experts")
    if not 1 <= top_k <= experts:
        raise ValueError(f"--moe-twin {shown!r}: top-k must be 1 to the number of experts "
                         f"({experts})")
    return experts, top_k


def twin_path(src: str | Path, experts: int, top_k: int, cache: str | Path | None = None) -> Path:
    if cache is None:
        from strata_jax.fetch import cache_dir

        cache = cache_dir()
    return Path(cache) / "twins" / f"{Path(src).stem}-{experts}x{top_k}.gguf"


def _source_key(src: Path) -> dict:
    st = src.stat()
    return {"source": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def make_twin(src: str | Path, experts: int, top_k: int, cache: str | Path | None = None,
              seed: int = 0, progress=print) -> tuple[Path, bool]:
    """The twin of dense model `src` (E experts, top-K): (its path, whether it was reused from the
    cache).

    ValueError (naming the --moe-twin value) if `src` already has experts or is not a model upcycle
    takes."""
    from strata_jax.makers.upcycle import upcycle

    shown = f"{experts}:{top_k}"
    check_moe_twin((experts, top_k))
    src = Path(src)
    spec = GGUFModel.open(src).spec
    if spec.is_moe:
        raise ValueError(f"--moe-twin {shown}: {src} is already a MoE model ({spec.n_experts} "
                         f"experts, top-{spec.n_experts_used}); bench it as it is, without "
                         "--moe-twin")
    if spec.architecture != "llama":
        raise ValueError(f"--moe-twin {shown}: {src} is a dense {spec.architecture} model; the "
                         "twin is made by `strata-jax upcycle`, which takes dense "
                         "llama-architecture models only")
    dst = twin_path(src, experts, top_k, cache)
    meta = dst.with_name(dst.name + ".json")
    key = {**_source_key(src), "experts": experts, "top_k": top_k, "seed": seed}
    try:
        if (dst.is_file()
                and json.loads(meta.read_text()) == {**key, "size_written": dst.stat().st_size}):
            progress(f"moe twin: reusing {dst} ({experts} experts, top-{top_k}, made from {src})")
            return dst, True
    except (OSError, ValueError):
        pass                                   # no record, or a broken one: make it again
    progress(f"moe twin: upcycling {src} into {dst} ({experts} experts, top-{top_k})")
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    try:
        upcycle(src, tmp, experts, top_k, seed)
        os.replace(tmp, dst)                   # a half-written twin is never at the cached name
    finally:
        tmp.unlink(missing_ok=True)
    meta.write_text(json.dumps({**key, "size_written": dst.stat().st_size}) + "\n")
    return dst, False
