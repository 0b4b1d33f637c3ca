"""The engine's life (issue 32, findings 6 and 7): speculative decoding drafts from the first
request after the default warm-up, and a program that makes Engines of every mode and exits without
close() exits 0.

6: a real server with `--spec 4 --drafter ngram` and the default warm-up (no --no-warmup): the first
   request after /health turns 200, a repetitive prompt whose n-grams always continue the same way,
   drafts (its `timings.draft_n` > 0). Before the fix the verify layouts were not among the
   warm-up's programs on the cpu backend, so every window was narrowed to plain decode while they
   waited behind the warm-up's other builds: 0 drafts.
7: scripts/exit_without_close.py as a child process, twice (a cold and a warm compile cache): exit
   status 0 and no terminate handler's words on stderr (before the fix: SIGABRT, exit 134,
   "terminate called after throwing an instance of '' / FATAL: exception not rethrown": a daemon
   builder thread inside jaxlib's C++ when the interpreter finalized).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np
import pytest

from strata_jax.serve.launch import ServerProcess

TINY = {"arch": "llama", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2}
SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "exit_without_close.py"


def _repetitive_prompt() -> list[int]:
    """Twelve ids four times over: every n-gram of the last ones was followed by one token only (p =
    1)."""
    rng = np.random.default_rng(0)
    a = [int(t) for t in rng.integers(3, 500, 12)]
    return a * 4


@pytest.fixture(scope="module")
def spec_server(tiny_model):
    args = [str(tiny_model(**TINY)), "--parallel", "2", "--max-context", "128", "--prefill", "16",
            "--spec", "4", "--drafter", "ngram", "--spec-min-p", "0"]
    with ServerProcess(args) as srv:                # the default warm-up: the subject of the test
        srv.wait_ready(timeout=300)
        yield srv


def test_spec_drafts_on_the_first_request_after_the_default_warmup(spec_server):
    r = httpx.post(spec_server.url + "/completion", timeout=300,
                   json={"prompt": _repetitive_prompt(), "n_predict": 24, "ignore_eos": True,
                         "temperature": 0})
    assert r.status_code == 200, r.text
    t = r.json()["timings"]
    assert t["predicted_n"] == 24, t
    assert t["draft_n"] > 0, f"the first request after the warm-up drafted nothing: {t}"


def test_engines_of_every_mode_exit_without_close(tmp_path):
    """Twice in one folder: first with a fresh compile cache (the builder threads are compiling at
    exit), then with the cache the first run filled (they are loading programs from it: where the
    abort was seen, in jaxlib's PyClient::DeserializeExecutable)."""
    words = ("terminate called", "exception not rethrown", "Fatal Python error", "Aborted",
             "core dumped")
    for run in ("cold", "warm"):
        p = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True,
                           text=True, timeout=900, check=False)
        told = [w for w in words if w in p.stderr]
        assert p.returncode == 0 and not told, (f"{run}: exit status {p.returncode}, "
                                                f"{told}:\n{p.stderr[-4000:]}")
        # every engine answered before the exit
        assert "answers: " in p.stdout, p.stdout
