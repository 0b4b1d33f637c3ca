"""scripts/accuracy_int8.py's paired comparison (issue 33 item 5): int8 against llama.cpp position
by position, the KL ratio's 95% interval over blocks of positions. The script itself needs
llama.cpp and minutes; its arithmetic is checked here on arrays whose answer is known."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "accuracy_int8.py"


@pytest.fixture(scope="module")
def paired():
    spec = importlib.util.spec_from_file_location("accuracy_int8", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.paired


def _side(kl, agree):
    return {"kl": np.asarray(kl, np.float64), "agree": np.asarray(agree, bool)}


def test_the_same_positions_give_a_ratio_of_one_and_no_spread(paired):
    kl = np.random.default_rng(0).exponential(3e-3, 1024)
    agree = np.arange(1024) % 7 != 0
    out = paired(_side(kl, agree), _side(kl, agree), 64)
    assert out["blocks"] == 16 and out["kl_ratio"] == 1.0
    assert out["kl_ratio_95"] == [1.0, 1.0]
    assert out["agree_diff"] == 0.0 and out["agree_diff_se"] == 0.0


def test_a_uniform_tenth_more_kl_is_a_ratio_of_1_1_with_no_spread(paired):
    n = 640
    ones = np.ones(n, bool)
    out = paired(_side(np.full(n, 0.011), ones), _side(np.full(n, 0.010), ones), 64)
    assert out["kl_ratio"] == pytest.approx(1.1)
    assert out["kl_ratio_95"] == pytest.approx([1.1, 1.1])


def test_noise_gives_an_interval_around_the_true_ratio_and_a_top1_difference(paired):
    rng = np.random.default_rng(1)
    n = 8192
    b = rng.exponential(3e-3, n)
    a = b * 1.05 * rng.lognormal(0.0, 0.3, n) / np.exp(0.3 ** 2 / 2)      # mean ratio 1.05
    agree_b = rng.random(n) < 0.96
    agree_a = agree_b.copy()
    agree_a[:82] = ~agree_a[:82]        # 82 positions flipped: the difference is their net count
    out = paired(_side(a, agree_a), _side(b, agree_b), 64)
    lo, hi = out["kl_ratio_95"]
    assert lo < out["kl_ratio"] < hi and lo < 1.05 < hi and hi - lo < 0.1
    net = int(agree_a.sum()) - int(agree_b.sum())
    assert out["agree_diff"] == pytest.approx(net / n) and out["agree_diff_se"] > 0


def test_positions_past_the_last_whole_block_are_left_out(paired):
    kl = np.concatenate([np.full(128, 1e-3), np.full(5, 1.0)])
    out = paired(_side(kl * 2, np.ones(133, bool)), _side(kl, np.ones(133, bool)), 64)
    assert out["blocks"] == 2 and out["kl_ratio"] == pytest.approx(2.0)
