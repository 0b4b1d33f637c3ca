"""Give a made MoE file's routers a skewed popularity in place, or put them back (issue 36: cache
figures for uniform and skewed routing without writing a second 37 GB file).

    python scripts/skew_router.py FIRST-PART.gguf --skew 0.5 --backup routers.npy   # skew
    python scripts/skew_router.py FIRST-PART.gguf --restore routers.npy             # put back

Every part of a split file is visited. Each float32 `blk.N.ffn_gate_inp.weight` ([experts, hidden])
has its expert rows scaled by make-model's `router_row_scales` (expert i by (rank+1)^-skew in a
random order a layer, mean square 1): the same rule `make-model --router-skew` writes, applied to
the uniform router the file already has. The original rows are saved first (to --backup) and
`--restore` writes them back bit for bit. Neither routing is a real model's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from strata_jax.gguf import GGUFModel
from strata_jax.makers.make_model import router_row_scales


def routers(first: Path):
    """(path, name, offset, shape) of every float32 router tensor, over every part."""
    for name, t in GGUFModel.open(first).tensors.items():
        if name.endswith("ffn_gate_inp.weight"):
            if t.qtype.name != "F32":
                sys.exit(f"{t.path}: {name} is {t.qtype.name}, not F32: not a made file")
            yield t.path, name, t.offset, t.shape


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path)
    p.add_argument("--skew", type=float)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--backup", type=Path, help="where the original rows go (with --skew)")
    p.add_argument("--restore", type=Path, help="write these saved rows back")
    a = p.parse_args()
    found = list(routers(a.model))
    if not found:
        sys.exit(f"{a.model}: no ffn_gate_inp.weight tensors (not a MoE file?)")
    if a.restore is not None:
        saved = np.load(a.restore, allow_pickle=False)
        if saved.shape[0] != len(found):
            sys.exit(f"{a.restore}: {saved.shape[0]} routers saved, the file has {len(found)}")
        for (path, _, off, shape), rows in zip(found, saved):
            np.memmap(path, np.float32, "r+", off, shape)[:] = rows
        print(f"restored {len(found)} routers")
        return
    if a.skew is None or a.backup is None:
        sys.exit("give --skew and --backup, or --restore")
    if a.backup.exists():
        sys.exit(f"{a.backup} exists: restore it first (or remove it), so that the uniform rows "
                 "are not lost")
    maps = [np.memmap(path, np.float32, "r+", off, shape) for path, _, off, shape in found]
    np.save(a.backup, np.stack([np.array(m) for m in maps]))
    rng = np.random.default_rng(a.seed)
    for m in maps:
        m *= router_row_scales(m.shape[0], a.skew, rng)[:, None]
        m.flush()
    print(f"skewed {len(found)} routers ({maps[0].shape[0]} experts each) by --skew {a.skew}; "
          f"originals in {a.backup}")


if __name__ == "__main__":
    main()
