"""Embeddings (engine/execute/embeddings.py, serve/http/embeddings.py): the pooled last hidden
states against transformers' on the same GGUF, read in chunks as one piece, beside a request in
flight; then the real server's /v1/embeddings (the openai client, base64, usage, errors) and
llama.cpp's /embeddings."""

from __future__ import annotations

import base64
import struct

import httpx
import numpy as np
import openai
import pytest
import torch

from strata_jax import Engine, EngineConfig
from strata_jax.serve.launch import ServerProcess
from strata_jax.testing.hf import load_hf_model

SIZES = {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "ffn": 256}


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(arch="llama", quant="Q8_0", **SIZES)


@pytest.fixture(scope="module")
def hf_hidden(model):
    hf = load_hf_model(model)

    def hidden(ids: list[int]) -> np.ndarray:
        # transformers' last hidden state is after the final norm, as ours
        with torch.no_grad():
            out = hf(torch.tensor([ids], dtype=torch.long), output_hidden_states=True)
        return out.hidden_states[-1][0].float().numpy()

    return hidden


def _ids(n: int, seed: int = 0) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 512, n)]


def test_pooled_hidden_states_match_transformers(model, hf_hidden):
    """last, mean, cls and none against transformers' hidden states, unnormalized and
    Euclidean-normalized; a 40-token text read in chunks of 16 (--prefill 16) is the same as whole;
    two requests' texts give their own vectors; a request decoding meanwhile keeps its greedy
    tokens."""
    # the exact cpu math: the pooling is what is checked here, to the float32 tolerance (the int8
    # path's own accuracy against transformers: tests/test_model_logits.py)
    eng = Engine.from_gguf(model, EngineConfig(max_context=64, prefill=16, batch_tokens=16,
                                               cpu_math="exact"))
    try:
        alone = eng.generate(_ids(8, 3), max_tokens=12, temperature=0).tokens
        h = eng.submit(_ids(8, 3), max_tokens=12, temperature=0)
        a, b = _ids(40, 1), _ids(7, 2)
        ref_a, ref_b = hf_hidden(a), hf_hidden(b)

        # the project's logits tolerance (tests/test_model_logits.py)
        def close(ours, ref):
            np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-4 * np.abs(ref).max())

        last_a, last_b = eng.embed([a, b], "last", normalize=-1)
        close(last_a, ref_a[-1])
        close(last_b, ref_b[-1])
        (mean,) = eng.embed([a], "mean", normalize=-1)
        close(mean, ref_a.mean(axis=0))
        (cls,) = eng.embed([a], "cls", normalize=-1)
        close(cls, ref_a[0])
        (every,) = eng.embed([b], "none", normalize=2)          # none: never normalized
        close(every, ref_b)
        (unit,) = eng.embed([a], "last")
        close(unit, ref_a[-1] / np.linalg.norm(ref_a[-1]))
        assert abs(np.linalg.norm(unit) - 1) < 1e-5
        assert [ev.token for ev in h if ev.token is not None] == alone
        with pytest.raises(ValueError, match="pooling = 'max'"):
            eng.embed([a], "max")
    finally:
        eng.close()


@pytest.fixture(scope="module")
def server(model):
    with ServerProcess([str(model), "--max-context", "64", "--model-name", "tiny", "--pooling",
                        "mean"]) as srv:
        srv.wait_ready()
        yield srv


def test_openai_embeddings_route(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    res = client.embeddings.create(model="tiny",
                                   input=["hello world", "hello world", "another text"])
    vectors = [np.array(d.embedding) for d in res.data]
    assert [d.index for d in res.data] == [0, 1, 2] and len(vectors[0]) == SIZES["hidden"]
    assert all(abs(np.linalg.norm(v) - 1) < 1e-5 for v in vectors)
    np.testing.assert_allclose(vectors[0], vectors[1], rtol=0, atol=1e-6)
    assert not np.allclose(vectors[0], vectors[2])
    assert res.usage.prompt_tokens == res.usage.total_tokens > 3

    body = httpx.post(server.url + "/v1/embeddings",
                      json={"input": "hello world", "encoding_format": "base64"}, timeout=60).json()
    packed = base64.b64decode(body["data"][0]["embedding"])
    np.testing.assert_allclose(struct.unpack(f"<{len(packed) // 4}f", packed), vectors[0], rtol=0,
                               atol=1e-6)
    parts = httpx.post(server.url + "/v1/embeddings", json={"input": [
        {"content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}]},
        {"prompt_string": "hello world"}]}, timeout=60).json()
    for d in parts["data"]:
        np.testing.assert_allclose(d["embedding"], vectors[0], rtol=0, atol=1e-6)
    ids = httpx.post(server.url + "/tokenize",
                     json={"content": "hello world", "add_special": True}).json()["tokens"]
    both = httpx.post(server.url + "/v1/embeddings", json={"input": ["hello world", ids]},
                      timeout=60).json()
    for d in both["data"]:                        # a text and its token ids: the same prompt
        np.testing.assert_allclose(d["embedding"], vectors[0], rtol=0, atol=1e-6)
    x = httpx.post(server.url + "/tokenize", json={"content": "x"}).json()["tokens"]
    mixed = httpx.post(server.url + "/v1/embeddings", json={"input": [ids[0], "x"]},
                       timeout=60).json()
    # llama.cpp's mix: one
    assert len(mixed["data"]) == 1 and mixed["usage"]["prompt_tokens"] == 1 + len(x)


def test_llama_embeddings_route_and_errors(server):
    got = httpx.post(server.url + "/embeddings", json={"content": "hello world"}, timeout=60).json()
    assert len(got) == 1 and got[0]["index"] == 0 and len(got[0]["embedding"][0]) == SIZES["hidden"]
    raw = httpx.post(server.url + "/embeddings",
                     json={"input": "hello world", "embd_normalize": -1},
                     timeout=60).json()[0]["embedding"][0]
    assert abs(np.linalg.norm(raw) - 1) > 1e-3

    def error(body):
        r = httpx.post(server.url + "/v1/embeddings", json=body, timeout=60)
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]

    assert ("too large" in error({"input": "hello " * 200})
            and "64" in error({"input": "hello " * 200}))
    assert "give a text" in error({"input": []})
    assert ("text only" in error({"input": {"content": [{"type": "image_url",
                                                         "image_url": {"url": "x"}}]}}))
    assert "dimensions = 3" in error({"input": "hi", "dimensions": 3})
    assert "encoding_format" in error({"input": "hi", "encoding_format": "int8"})
    metrics = httpx.get(server.url + "/metrics").text
    # no generation: still counted
    for name in ("llamacpp:prompt_tokens_total", "llamacpp:n_decode_total"):
        line = next(x for x in metrics.splitlines() if x.startswith(name + " "))
        assert float(line.split()[-1]) > 0, name
