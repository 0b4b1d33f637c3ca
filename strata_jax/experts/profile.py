"""Expert hotness: how often live traffic routed to each (MoE layer, expert), saved to a file on
request and read back at start (`--expert-profile FILE`) to preload and pin the hottest experts in
the device arena.

The file is JSON (small: layers x experts counts), written by `Engine.save_expert_profile(path)` or
the server's `POST /expert-profile {"name": NAME}` (NAME.json in the server's --expert-profile-dir):

    {"format": "strata-jax expert profile", "version": 1, "model": "<general.name>",
     "architecture": "qwen3moe", "n_layers": 48, "n_experts": 128, "n_experts_used": 8,
     "routed": 123456, "counts": {"0": [c_0, ..., c_127], "1": [...], ...}}

`counts[layer][e]` is the number of token-to-expert assignments (real tokens only, prompt and
decode) that layer routed to expert e since the engine started. A file made on another model (other
expert count or MoE layers) is refused with an error that names the file and what differs.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from pathlib import Path

import numpy as np

FORMAT = "strata-jax expert profile"
VERSION = 1
# Of a layer's device slots, pin at most this fraction to the profile's hottest experts: the rest
# stay free for the experts the live traffic needs beyond the profile (at least one slot always
# stays free).
PIN_FRACTION = 0.75


class ExpertProfileError(ValueError):
    """A profile file that cannot be used: the message names the file and the problem."""


class ExpertProfile:
    def __init__(self, spec, layers: list[int] | None = None):
        self.spec = spec
        self.layers = list(layers if layers is not None else spec.moe_layers)
        # [MoE layers, experts]
        self.counts = np.zeros((len(self.layers), spec.n_experts), np.int64)
        self._row = {layer: r for r, layer in enumerate(self.layers)}

    def add(self, layer: int, ids: np.ndarray) -> None:
        """Count the expert ids (any shape, real tokens only) that `layer` routed to."""
        self.counts[self._row[layer]] += np.bincount(np.asarray(ids).reshape(-1),
                                                     minlength=self.spec.n_experts)

    def add_moe(self, counts: np.ndarray) -> None:
        """counts [MoE layers, E], in self.layers' order (the one-program expert-tier window)."""
        self.counts += counts

    def add_all(self, counts: np.ndarray) -> None:
        """counts [n_layers, E] (every layer, dense ones zero), e.g. from the one-program window."""
        self.counts += np.asarray(counts, np.int64)[self.layers]

    def hottest(self, layer: int, n: int) -> list[int]:
        """Up to n experts of `layer` that traffic routed to, most routed first (ties: lower id)."""
        c = self.counts[self._row[layer]]
        order = sorted(range(len(c)), key=lambda e: (-c[e], e))
        return [e for e in order[:n] if c[e] > 0]

    def to_json(self) -> dict:
        s = self.spec
        return {"format": FORMAT, "version": VERSION, "model": s.name,
                "architecture": s.architecture, "n_layers": s.n_layers, "n_experts": s.n_experts,
                "n_experts_used": s.n_experts_used, "routed": int(self.counts.sum()),
                "counts": {str(layer): [int(x) for x in self.counts[r]]
                           for r, layer in enumerate(self.layers)}}

    def copy(self) -> ExpertProfile:
        """A snapshot of the counts, for another thread to write while the engine counts on."""
        out = ExpertProfile(self.spec, self.layers)
        out.counts[:] = self.counts
        return out

    def save(self, path: str | os.PathLike, private_dir: bool = False) -> Path:
        """Write the profile atomically (a reader never sees half a file) and privately: through a
        temporary file made in the same directory with mode 0o600, then renamed over `path`.
        private_dir: create the directory (0o700) if it is missing, as the server does for its
        --expert-profile-dir. -> the path."""
        path = Path(path)
        if private_dir:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.to_json(), f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path

    @classmethod
    def load(cls, path: str | os.PathLike, spec, layers: list[int] | None = None) -> ExpertProfile:
        """Read a profile made on this model's shape; any problem is an ExpertProfileError naming
        the file."""
        prof = cls(spec, layers)

        def bad(what: str) -> ExpertProfileError:
            return ExpertProfileError(f"expert profile {path}: {what}")

        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise bad(f"cannot be read ({e.strerror or e})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise bad(f"is not valid JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise bad(f"is not an expert profile (no \"format\": \"{FORMAT}\")")
        if data.get("version") != VERSION:
            raise bad(f"has version {data.get('version')!r}; this engine reads version {VERSION}")
        if data.get("n_experts") != spec.n_experts:
            raise bad(f"was made on a model with {data.get('n_experts')} experts a layer; this "
                      f"model ({spec.architecture}, {spec.name or 'unnamed'}) has {spec.n_experts}")
        counts = data.get("counts")
        if not isinstance(counts, dict):
            raise bad("has no \"counts\" map of layer -> expert counts")
        want = {str(layer) for layer in prof.layers}
        if set(counts) != want:
            raise bad(f"counts MoE layers {_span(counts)}; this model's MoE layers are "
                      f"{_span(want)}")
        for r, layer in enumerate(prof.layers):
            row = counts[str(layer)]
            if (not isinstance(row, list) or len(row) != spec.n_experts
                    or not all(isinstance(x, int) and x >= 0 for x in row)):
                raise bad(f"layer {layer}'s counts must be {spec.n_experts} whole numbers >= 0")
            prof.counts[r] = row
        return prof


def pins_for(n_slots: int) -> int:
    """How many of a layer's n_slots device slots the profile may pin (at least one stays free)."""
    return max(0, min(math.floor(PIN_FRACTION * n_slots), n_slots - 1))


def _span(layers) -> str:
    nums = sorted(int(x) if str(x).isdigit() else -1 for x in layers)
    if not nums:
        return "none"
    if nums == list(range(nums[0], nums[-1] + 1)) and len(nums) > 2:
        return f"{nums[0]}..{nums[-1]} ({len(nums)})"
    return ", ".join(map(str, nums))
