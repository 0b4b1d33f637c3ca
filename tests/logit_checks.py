"""Checks of logits against a reference (transformers), shared by the model tests: the int8 cpu
math's tolerance (tests/test_model_logits.py's docstring says where it comes from)."""

from __future__ import annotations

import numpy as np


def mean_kl(ref: np.ndarray, ours: np.ndarray) -> float:
    """Mean over positions of KL(softmax(ref) || softmax(ours)), natural log, in float64."""
    def log_softmax(z):
        z = z.astype(np.float64) - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))
    lp, lq = log_softmax(ref), log_softmax(ours)
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def assert_int8_close(ref: np.ndarray, int8: np.ndarray, exact: np.ndarray, what: str) -> None:
    """The int8 math's logits: not the exact math's (it ran), mean KL from the reference at most
    0.05 nats, and the reference's top-1 token wherever that token leads its second by more than 2%
    of the largest logit (random tiny models have near ties)."""
    assert np.abs(int8 - exact).max() > 0, f"{what}: the int8 logits are the exact ones"
    kl = mean_kl(ref, int8)
    top2 = np.sort(ref, -1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 0.02 * np.abs(ref).max()
    same = int8.argmax(-1) == ref.argmax(-1)
    assert kl <= 0.05, f"{what}: mean KL {kl:.4f}"
    assert clear.sum() >= len(ref) // 2, (f"{what}: only {clear.sum()} positions with a clear "
                                          "first token")
    assert same[clear].all(), (f"{what}: top-1 {same[clear].mean():.0%} of {clear.sum()} clear "
                               "positions")
