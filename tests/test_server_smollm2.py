"""`strata-jax serve` with no model serves the default SmolLM2-135M-Instruct, and answers the
capital of France through curl. (A real model: ~15 s a program to compile on a 2-core CPU, so one
small server.)"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from strata_jax.fetch import smollm2_path
from strata_jax.serve.launch import ServerProcess


@pytest.fixture(scope="session")
def smollm2_server():
    # fetched (once) before the server's clock starts
    smollm2_path()
    exe = shutil.which("strata-jax")
    command = [exe] if exe else [sys.executable, "-m", "strata_jax"]
    with ServerProcess(["--max-context", "512", "--parallel", "1"], command=command) as srv:
        srv.wait_ready(timeout=300)
        yield srv


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_default_model_answers_paris_through_curl(smollm2_server):
    # the default server: the int8 cpu math (tests/test_smollm2.py says why the question asks for
    # one word)
    body = {"messages": [{"role": "user",
                          "content": "What is the capital of France? Answer in one word."}],
            "max_tokens": 24, "temperature": 0}
    out = subprocess.run(["curl", "-sS", "--max-time", "240",
                          smollm2_server.url + "/v1/chat/completions",
                          "-H", "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, text=True, check=True)
    answer = json.loads(out.stdout)
    assert "Paris" in answer["choices"][0]["message"]["content"], answer
    assert answer["model"] == smollm2_path().name and answer["usage"]["completion_tokens"] >= 3
    models = subprocess.run(["curl", "-sS", smollm2_server.url + "/v1/models"], capture_output=True,
                            text=True, check=True)
    assert json.loads(models.stdout)["data"][0]["meta"]["architecture"] == "llama"
