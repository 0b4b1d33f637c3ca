"""Logprobs, logit_bias, presence / frequency penalties, llama.cpp's repeat penalty and n choices
(issue 16, items 3 and 4), against the real server (a process) with the official openai client.
References come from the Engine API in-process on the same tiny model: logprobs are a log-softmax of
`eng.logits` at those positions, and each control's tokens are the argmax of `eng.logits` changed by
hand as the control says."""

from __future__ import annotations

import json
import re
import threading

import httpx
import numpy as np
import openai
import pytest

from strata_jax import Engine, EngineConfig
from strata_jax.serve.launch import ServerProcess

N_CTX = 256
HI = [{"role": "user", "content": "Hi there, tell me a story"}]
PROMPT = "Once upon a time, in a land far away, there lived"


@pytest.fixture(scope="module")
def model(tiny_model):
    return tiny_model(arch="qwen3", layers=2, hidden=64)


@pytest.fixture(scope="module")
def eng(model):
    with Engine.from_gguf(model, EngineConfig(parallel=2, max_context=N_CTX, warmup=False)) as e:
        yield e


@pytest.fixture(scope="module")
def server(model):
    with ServerProcess([str(model), "--parallel", "4", "--max-context", str(N_CTX), "--model-name",
                        "tiny"]) as srv:
        srv.wait_up().wait_ready()
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def log_softmax(lg: np.ndarray) -> np.ndarray:
    lg = lg.astype(np.float64)
    m = lg.max(-1, keepdims=True)
    return lg - m - np.log(np.exp(lg - m).sum(-1, keepdims=True))


def step_logits(eng, prompt: list[int], tokens: list[int]) -> np.ndarray:
    """The logits each generated token was drawn from: [len(tokens), V]."""
    return eng.logits(prompt + tokens[:-1])[len(prompt) - 1:]


def text_of(eng, tokens):
    return eng.tokenizer.decode(tokens)


# ---- logprobs ------------------------------------------------------------------------------------


def test_chat_logprobs_are_the_raw_log_softmax_whole_and_streamed(eng, client):
    ids = eng.prompt_ids(HI)
    want = eng.generate(HI, max_tokens=6, temperature=0, ignore_eos=True).tokens
    ref = log_softmax(step_logits(eng, ids, want))
    kw = {"model": "tiny", "messages": HI, "max_tokens": 6, "temperature": 0, "logprobs": True,
          "top_logprobs": 5, "extra_body": {"ignore_eos": True}}
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for k, (entry, tok) in enumerate(zip(content, want)):
        assert entry.bytes == list(eng.tokenizer.token_bytes(tok))
        assert abs(entry.logprob - ref[k, tok]) < 1e-4, (k, entry.logprob, ref[k, tok])
        tops = [t.logprob for t in entry.top_logprobs]
        assert len(tops) == 5 and tops == sorted(tops, reverse=True)
        np.testing.assert_allclose(tops, np.sort(ref[k])[::-1][:5], atol=1e-4)
        # greedy: the top token is the one chosen
        assert entry.top_logprobs[0].bytes == entry.bytes
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert ([(e.bytes, round(e.logprob, 5)) for e in streamed]
            == [(e.bytes, round(e.logprob, 5)) for e in content])
    plain = client.chat.completions.create(model="tiny", messages=HI, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_shape_and_values(eng, client):
    ids = eng.tokenizer.encode(PROMPT)
    want = eng.generate(ids, max_tokens=5, temperature=0, ignore_eos=True).tokens
    ref = log_softmax(step_logits(eng, ids, want))
    kw = {"model": "tiny", "prompt": ids, "max_tokens": 5, "temperature": 0, "logprobs": 3,
          "extra_body": {"ignore_eos": True}}
    lp = client.completions.create(**kw).choices[0].logprobs
    assert lp.tokens == [eng.tokenizer.token_bytes(t).decode("utf-8", "replace") for t in want]
    np.testing.assert_allclose(lp.token_logprobs, [ref[k, t] for k, t in enumerate(want)],
                               atol=1e-4)
    for k, top in enumerate(lp.top_logprobs):
        assert 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(ref[k].max(), abs=1e-4)
    assert lp.text_offset == list(np.cumsum([0] + [len(t) for t in lp.tokens[:-1]]))
    chunks = list(client.completions.create(**kw, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.token_logprobs]
    np.testing.assert_allclose(streamed, lp.token_logprobs, atol=1e-6)


def test_logprobs_are_of_the_model_not_of_the_biased_logits(eng, client):
    """vLLM's default (raw_logprobs): a +100 bias makes a token chosen, its logprob stays the
    model's."""
    ids = eng.tokenizer.encode(PROMPT)
    ref = log_softmax(eng.logits(ids)[-1])
    forced = int(np.argsort(ref)[len(ref) // 2])              # a token of middling probability
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, logprobs=0,
                                  logit_bias={str(forced): 100})
    assert r.choices[0].logprobs.token_logprobs[0] == pytest.approx(ref[forced], abs=1e-4)


# ---- logit_bias and penalties --------------------------------------------------------------------


def _completion_text(client, ids, n=8, **extra):
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=n, temperature=0,
                                  extra_body={"ignore_eos": True, **extra})
    return r.choices[0].text


def test_logit_bias_forces_and_bans(eng, client):
    ids = eng.tokenizer.encode(PROMPT)
    greedy = eng.generate(ids, max_tokens=8, temperature=0, ignore_eos=True).tokens
    forced = next(t for t in range(300, 400) if t not in greedy)
    assert (_completion_text(client, ids, logit_bias={str(forced): 100})
            == text_of(eng, [forced] * 8))
    banned = eng.generate(ids, max_tokens=8, temperature=0, ignore_eos=True,
                          logit_bias={greedy[0]: -100}).tokens
    lg = eng.logits(ids)[-1]
    assert banned[0] != greedy[0] and banned[0] == int(np.argsort(lg)[-2])      # the runner-up
    assert greedy[0] not in banned
    assert _completion_text(client, ids, logit_bias={str(greedy[0]): -100}) == text_of(eng, banned)


def _by_hand(eng, ids, tokens, change) -> list[int]:
    """The greedy tokens with `change(logits row, history, generated)` applied before each argmax,
    checked against `tokens` one step at a time (the logits of each step are those of `tokens`' own
    prefix)."""
    rows = step_logits(eng, ids, tokens)
    out = []
    for k, row in enumerate(rows):
        out.append(int(np.argmax(change(row.astype(np.float32).copy(), ids + tokens[:k],
                                        tokens[:k]))))
    return out


@pytest.mark.parametrize("controls", [
    {"presence_penalty": 2.0},
    {"frequency_penalty": 1.5},
    {"presence_penalty": -1.0, "frequency_penalty": 0.7},
    {"repeat_penalty": 1.8, "repeat_last_n": 8},
    {"repeat_penalty": 0.5, "repeat_last_n": -1},
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_penalties_change_exactly_what_they_should(eng, client, controls):
    ids = eng.tokenizer.encode(PROMPT)
    n = 12
    greedy = eng.generate(ids, max_tokens=n, temperature=0, ignore_eos=True).tokens
    got = eng.generate(ids, max_tokens=n, temperature=0, ignore_eos=True, **controls).tokens

    def change(row, history, generated):
        if "repeat_penalty" in controls:
            p, last = controls["repeat_penalty"], controls["repeat_last_n"]
            seen = sorted(set(history if last < 0 else history[-last:]))
            row[seen] = np.where(row[seen] > 0, row[seen] / np.float32(p),
                                 row[seen] * np.float32(p))
        counts = (np.bincount(generated, minlength=len(row))[:len(row)] if generated
                  else np.zeros(len(row)))
        return row - (np.float32(controls.get("frequency_penalty", 0.0)) * counts.astype(np.float32)
                      + np.float32(controls.get("presence_penalty", 0.0)) * (counts > 0))

    assert got == _by_hand(eng, ids, got, change)
    assert got != greedy, "the control changed nothing: the check above could not fail"
    assert _completion_text(client, ids, n, **controls) == text_of(eng, got)
    if controls.get("repeat_last_n") == -1:             # vLLM's name for it
        assert (_completion_text(client, ids, n, repetition_penalty=controls["repeat_penalty"])
                == text_of(eng, got))


def _sampled_text(client, ids, n=16, **extra):
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=n, temperature=1.0, seed=7,
                                  extra_body={"ignore_eos": True, "top_k": 0, "min_p": 0.0,
                                              **extra})
    return r.choices[0].text


def test_controlled_rows_leave_other_rows_unchanged(eng, client):
    """Requests without controls (greedy, and seeded sampling) give the same tokens beside requests
    with every control, greedy and sampled, in the same windows."""
    ids = eng.tokenizer.encode(PROMPT)
    alone, alone_sampled = _completion_text(client, ids, 16), _sampled_text(client, ids)
    out: dict[int, str] = {}
    controls = {"presence_penalty": 1.0, "logit_bias": {"7": 5}, "repeat_penalty": 1.3,
                "logprobs": 2}

    def controlled(i):
        out[i] = (_completion_text if i == 0 else _sampled_text)(client, ids, 16, **controls)

    threads = [threading.Thread(target=controlled, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    together = _completion_text(client, ids, 16)
    together_sampled = _sampled_text(client, ids)
    for t in threads:
        t.join()
    assert together == alone and together_sampled == alone_sampled
    # sampled with controls: seeded too
    assert out[1] == _sampled_text(client, ids, **controls)


def test_a_sampled_row_obeys_logit_bias(eng, client):
    ids = eng.tokenizer.encode(PROMPT)
    assert _sampled_text(client, ids, 6, logit_bias={"300": 100}) == text_of(eng, [300] * 6)


def test_controls_compile_per_row_bucket_not_per_request(eng):
    ids = eng.tokenizer.encode(PROMPT)
    eng.generate(ids, max_tokens=2, temperature=0, logit_bias={3: 1.0})
    before = eng.runner.answers._controlled._cache_size()
    for controls in ({"logit_bias": {i: 2.0 for i in range(40)}},
                     {"repeat_penalty": 1.2, "repeat_last_n": 3},
                     {"presence_penalty": 0.3, "logprobs": 20},
                     {"frequency_penalty": -0.5, "logprobs": 0}):
        eng.generate(ids + [1] * len(controls), max_tokens=5, temperature=0, ignore_eos=True,
                     **controls)
    # the same one-row program every time
    assert eng.runner.answers._controlled._cache_size() == before


def test_controlled_rows_take_no_drafts_with_spec(model):
    """--spec: a window with a controlled row runs without drafts (the verify rule knows no
    controls), so the controls hold; rows without controls still draft."""
    with Engine.from_gguf(model, EngineConfig(parallel=2, max_context=N_CTX, warmup=False,
                                              spec=2)) as spec_eng:
        ids = spec_eng.tokenizer.encode(PROMPT)
        forced = spec_eng.generate(ids, max_tokens=8, temperature=0, ignore_eos=True,
                                   logit_bias={300: 100})
        assert forced.tokens == [300] * 8 and forced.stats["draft_n"] == 0
        plain = spec_eng.generate(ids + ids, max_tokens=24, temperature=0, ignore_eos=True)
        assert plain.stats["draft_n"] > 0


# ---- n choices -----------------------------------------------------------------------------------


def test_n_choices_share_the_prompt(server, client):
    kw = {"model": "tiny", "messages": HI, "max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 3,
          "extra_body": {"ignore_eos": True}}
    r = client.chat.completions.create(**kw)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert r.usage.completion_tokens == 18                  # every choice's tokens, the prompt once
    assert len({c.message.content for c in r.choices}) > 1  # seed + k: the choices differ
    again = client.chat.completions.create(**kw)
    # seeded
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]
    long_prompt = [{"role": "user", "content": "word " * 60}]
    greedy = client.chat.completions.create(model="tiny", messages=long_prompt, max_tokens=40,
                                            temperature=0, n=3, extra_body={"ignore_eos": True})
    texts = [c.message.content for c in greedy.choices]
    # copied KV: the same greedy tokens
    assert len(texts) == 3 and texts[1] == texts[0] and texts[2] == texts[0]
    assert greedy.usage.completion_tokens == 120
    metrics = httpx.get(server.url + "/metrics").text
    forks = re.search(r"^strata_prefix_cache_forks(?:\{[^}]*\})? (\S+)$", metrics, re.MULTILINE)
    assert forks and float(forks.group(1)) >= 1, "no later choice took choice 0's KV"
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4,
                                            temperature=0.9, seed=1,
                                            n=2, stream=True,
                                            stream_options={"include_usage": True}))
    ends = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert ends == [0, 1] and chunks[-1].usage.completion_tokens == 8


def test_a_request_takes_a_busy_slots_prompt_kv(eng):
    """The engine's side of n: a request whose prompt a running request has read copies that KV (a
    fork) and gives the tokens it would give reading the prompt itself."""
    ids = eng.tokenizer.encode("word " * 40)
    alone = eng.generate(ids, max_tokens=6, temperature=0, ignore_eos=True)
    first = eng.submit(ids + [5], max_tokens=60, temperature=0, ignore_eos=True)
    assert next(iter(first)).kind == "token"                  # its prompt is read
    forks = eng.stats()["prefix_cache"]["forks"]
    second = eng.generate(ids, max_tokens=6, temperature=0, ignore_eos=True)
    first.cancel()
    assert eng.stats()["prefix_cache"]["forks"] == forks + 1
    assert second.stats["reused_tokens"] >= len(ids) - 16 and second.tokens == alone.tokens


# ---- out of range --------------------------------------------------------------------------------

CHAT, TEXT = "/v1/chat/completions", "/v1/completions"
BAD = [
    (CHAT, {"presence_penalty": 2.5}, "presence_penalty", "2.5"),
    (TEXT, {"frequency_penalty": -3}, "frequency_penalty", "-3"),
    (TEXT, {"repeat_penalty": 0}, "repeat_penalty", "0"),
    (CHAT, {"repeat_penalty": 11}, "repeat_penalty", "11"),
    (TEXT, {"repeat_last_n": -2}, "repeat_last_n", "-2"),
    (CHAT, {"repetition_penalty": -1}, "repetition_penalty", "-1"),
    (CHAT, {"logit_bias": {"5": 101}}, "logit_bias", "101"),
    (TEXT, {"logit_bias": {"abc": 1}}, "logit_bias", "abc"),
    (CHAT, {"logit_bias": {"999999": 1}}, "logit_bias", "999999"),
    (CHAT, {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "21"),
    (CHAT, {"top_logprobs": 3}, "top_logprobs", "3"),
    (TEXT, {"logprobs": 21}, "logprobs", "21"),
    (CHAT, {"n": 9}, "n", "9"),
    (TEXT, {"n": 0}, "n", "0"),
]


@pytest.mark.parametrize(("path", "extra", "field", "shown"), BAD,
                         ids=[f"{f}={s}" for _, _, f, s in BAD])
def test_out_of_range_controls_are_400_naming_the_field(server, path, extra, field, shown):
    body = {"messages": HI} if path == CHAT else {"prompt": "Hi"}
    r = httpx.post(server.url + path, content=json.dumps({**body, "max_tokens": 2, **extra}),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert field in err["message"] and shown in err["message"], err
    assert (err.get("param") or "").split("[")[0] == field, err
