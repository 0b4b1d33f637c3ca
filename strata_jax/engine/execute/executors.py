"""How a window's programs run: one implementation a mode, chosen once when the runner starts
(runner.py).

    WholeWindows    one program a window, on one device or over --split experts' mesh (the shards
                    are in the program's weights and inputs; nothing else differs)
    SteppedWindows  the expert tiers: a window layer by layer, the experts fed from host RAM and the
                    file (stepped.py's LayerStepper)
    Pipeline        --split layers: a chain of stage programs, one a device
                    (distributed/pipeline.py)
    GroupWindows    --num-processes N: WholeWindows on the leader, each window sent to the followers
                    first (distributed/lockstep.py)

Each answers the runner's questions in its own way, with no branch on the mode anywhere else: which
programs a window of a layout runs (`layouts`), run it (`forward` -> the groups' logits and, for the
MTP drafter, their last hidden states), whether a decode window may be dispatched before its turn
(`runs_ahead`; then `forward_ahead` -> its logits and what to do when it is taken: run_ahead.py),
and the routing of live traffic (`expert_profile`, `expert_stats`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from ...experts.profile import ExpertProfile
from .layouts import GroupInput
from .programs import Layout
from .window_program import build_window, cache_last, flat_weights

log = logging.getLogger("strata_jax.engine")

# logits a group; hidden states a group, or None
Forward = tuple[list[jax.Array], list[jax.Array] | None]
# a window run ahead: logits a group; what to call once if a planned window takes them, or None
Ahead = tuple[list[jax.Array], Callable[[], None] | None]


class Executor(Protocol):
    # ProgramCache, or StagePrograms over one a device (pipeline.py)
    programs: Any

    def layouts(self, layout: Layout) -> list[Layout]: ...

    def forward(self, groups: list[GroupInput], layout: Layout) -> Forward: ...

    # whether a decode window may be dispatched before its turn (forward_ahead)
    runs_ahead: bool

    def expert_profile(self) -> ExpertProfile: ...

    def expert_stats(self) -> dict: ...

    def close(self) -> None: ...


def all_on_device(spec) -> dict:
    """expert_stats of a mode that holds every expert on its devices."""
    if not spec.is_moe:
        return {}
    return {"device_slots": spec.n_experts, "experts_total": spec.n_experts * len(spec.moe_layers),
            "all_on_device": 1}


class WholeWindows:
    """A window as one program over the whole model (window_program.py), its KV cache donated and
    updated in place. With every expert on the device it counts their routing in the program (the
    expert profile)."""

    # its program writes only the KV at each row's next position (and adds to the counts)
    runs_ahead = True

    def __init__(self, spec, opts, params: dict, kv, programs, shards=None,
                 with_hidden: bool = False):
        self.spec, self.opts, self.params, self.kv, self.programs = spec, opts, params, kv, programs
        self.shards, self.with_hidden = shards, with_hidden
        # what each window program call is handed (build_window's flat form), flattened once
        self.weights = flat_weights(params)
        # int32 [n_layers, E]: live traffic's routing
        self.counts = self._new_counts() if spec.is_moe else None
        programs.register("window", self.build)

    def layouts(self, layout: Layout) -> list[Layout]:
        return [layout]

    def forward(self, groups: list[GroupInput], layout: Layout) -> Forward:
        return self.window(layout, [a for g in groups for a in g.arrays()])

    def forward_ahead(self, groups: list[GroupInput], layout: Layout) -> Ahead:
        """A decode window run ahead (run_ahead.py): the whole-window program, no hidden states;
        its routing is counted in the program, taken or not."""
        return self.forward(groups, layout)[0], None

    def window(self, layout: Layout, args: list[np.ndarray]) -> Forward:
        """The program of `layout` on its inputs (after the weights, the KV and the counts); a
        follower of a process group replays the leader's windows through here (lockstep.py)."""
        if self.counts is not None and self.counts.is_deleted():
            log.warning("the expert profile's counts were lost in a failed window: counting anew")
            # a failed run consumed it: the profile starts again
            self.counts = self._new_counts()
        counts = [] if self.counts is None else [self.counts]
        res = self.kv.through(lambda c: cache_last(self.programs.run(layout, self.weights, c,
                                                                     *counts, *args)))
        if counts:
            self.counts = res.counts
        return res.logits, res.hiddens

    def build(self, layout: Layout):
        """The program cache's builder of whole windows."""
        return build_window(layout, self.params, self.spec, self.opts, self.kv, self.with_hidden,
                            self.counts, self.shards)

    def expert_profile(self) -> ExpertProfile:
        if self.counts is None:
            raise ValueError("this model has no experts: there is no expert profile to write")
        prof = ExpertProfile(self.spec)
        prof.add_all(np.asarray(self.counts))
        return prof

    def expert_stats(self) -> dict:
        return all_on_device(self.spec)

    def close(self) -> None:
        pass

    def _new_counts(self):
        counts = jnp.zeros((self.spec.n_layers, self.spec.n_experts), jnp.int32)
        return counts if self.shards is None else self.shards.replicate(counts)


class SteppedWindows:
    """The expert tiers: LayerStepper runs a window's stages (stepped.py) and counts the routing
    itself."""

    def __init__(self, stepper, programs, with_hidden: bool):
        self.stepper, self.programs, self.with_hidden = stepper, programs, with_hidden

    def layouts(self, layout: Layout) -> list[Layout]:
        return self.stepper.stage_layouts(layout)

    @property
    def runs_ahead(self) -> bool:
        """Where every window is one program (--layer-step auto with the host tier's blocks read in
        it): that program writes only the KV at each row's next position, and the routing it
        returns is counted when the window is taken. Layer-stepped windows move experts between
        layers: they never run ahead."""
        return self.stepper.always_one_program and not self.with_hidden

    def forward(self, groups: list[GroupInput], layout: Layout) -> Forward:
        out = self.stepper.run(groups, layout)
        return out if self.with_hidden else (out, None)

    def forward_ahead(self, groups: list[GroupInput], layout: Layout) -> Ahead:
        """A decode window run ahead (run_ahead.py): the one-program window, its routing counted
        only if it is taken."""
        return self.stepper.run_ahead(groups, layout)

    def expert_profile(self) -> ExpertProfile:
        return self.stepper.profile

    def expert_stats(self) -> dict:
        return self.stepper.stats()

    def close(self) -> None:
        self.stepper.close()
