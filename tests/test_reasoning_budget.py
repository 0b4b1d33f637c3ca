"""A budget on reasoning tokens (issue 38, item 3): the engine follows a request's
<think>...</think> section (engine/schedule/thinking.py), counts its tokens, and once a budget is
spent commits the close mark in place of what the model sampled, then lets the answer follow.
Checked three ways: the tracker's rules on token sequences; the real engine, whose budgeted greedy
output is the unbudgeted one up to the budget, the close mark, then the model's greedy continuation
of that prefix, with and without speculative decoding (a verify window's drafts after a forced
token are dropped); and the real server with --reasoning-budget, the per-request
thinking_token_budget and usage's reasoning_tokens."""

from __future__ import annotations

import httpx
import openai
import pytest

from strata_jax import Engine, EngineConfig
from strata_jax.engine.schedule.thinking import Thinking
from strata_jax.gguf import GGUFModel, load_tokenizer
from strata_jax.serve.launch import ServerProcess
from strata_jax.testing.requests import run_all

OPEN, CLOSE = 7, 8


def _follow(t: Thinking, sampled: list[int]) -> list[int]:
    """The tokens committed when the model samples `sampled`, one by one."""
    out = []
    for tok in sampled:
        chosen = t.choose(tok)
        t.commit(chosen)
        out.append(chosen)
    return out


# ---- the tracker's rules ------------------------------------------------------------------------

def test_budget_forces_the_close_mark_after_n_tokens():
    t = Thinking((OPEN,), (CLOSE,), inside=True, budget=3)
    assert _follow(t, [1, 2, 3, 4, 5, 6]) == [1, 2, 3, CLOSE, 5, 6]
    assert (t.tokens, t.inside) == (3, False)


def test_the_model_closing_first_stops_the_count():
    t = Thinking((OPEN,), (CLOSE,), inside=True, budget=5)
    assert _follow(t, [1, CLOSE, 2, 3, 4, 5, 6, 9]) == [1, CLOSE, 2, 3, 4, 5, 6, 9]
    assert (t.tokens, t.inside) == (1, False)


def test_no_budget_counts_only():
    t = Thinking((OPEN,), (CLOSE,), inside=True)
    assert _follow(t, [1, 2, 3, CLOSE, 4]) == [1, 2, 3, CLOSE, 4]
    assert t.tokens == 3


def test_a_closed_section_does_not_open_again():
    t = Thinking((OPEN,), (CLOSE,), inside=True, budget=1)
    assert _follow(t, [1, 2, OPEN, 3, 4]) == [1, CLOSE, OPEN, 3, 4]
    assert (t.tokens, t.inside) == (1, False)


def test_budget_zero_closes_at_once():
    t = Thinking((OPEN,), (CLOSE,), inside=True, budget=0)
    assert _follow(t, [1, 2]) == [CLOSE, 2] and t.tokens == 0


def test_a_section_the_answer_opens_itself():
    t = Thinking((OPEN,), (CLOSE,), inside=False, budget=2)
    assert _follow(t, [OPEN, 1, 2, 3, 4]) == [OPEN, 1, 2, CLOSE, 4]
    assert t.tokens == 2
    # a later open mark is answer text, not a section
    t = Thinking((OPEN,), (CLOSE,), inside=False, budget=1)
    assert _follow(t, [5, OPEN, 1, 2, 3]) == [5, OPEN, 1, 2, 3] and t.tokens == 0


def test_a_call_mark_ends_the_section_uncounted():
    """A tool call's mark (<tool_call>) ends the reasoning, as the server's parser reads it: no
    budget forces </think> into a call."""
    t = Thinking((OPEN,), (CLOSE,), inside=True, budget=3, ends=(40,))
    assert _follow(t, [1, 40, 2, 3, 4, 5]) == [1, 40, 2, 3, 4, 5]
    assert (t.tokens, t.inside) == (1, False)


def test_marks_of_several_tokens():
    """A close mark begun by the model when the budget runs out is finished, not restarted; a
    false start of it counts as thinking."""
    t = Thinking((20, 21), (30, 31), inside=False, budget=4)
    assert _follow(t, [20, 21, 1, 30, 2, 3, 30, 9, 9]) == [20, 21, 1, 30, 2, 3, 30, 31, 9]
    assert (t.tokens, t.inside) == (4, False)
    t = Thinking((20, 21), (30, 31), inside=True, budget=2)
    assert _follow(t, [1, 2, 5, 5, 5]) == [1, 2, 30, 31, 5] and t.tokens == 2


def test_a_mark_outside_the_vocabulary_is_refused():
    from strata_jax.engine.request import RequestError, make_params

    with pytest.raises(RequestError, match="reasoning_close"):
        make_params(8, reasoning_close=[10**6], reasoning_budget=3).validate(1000)
    with pytest.raises(RequestError, match="reasoning_budget"):
        make_params(8, reasoning_budget=3).validate(1000)
    with pytest.raises(RequestError, match="reasoning_budget"):
        make_params(8, reasoning_close=[5], reasoning_budget=-2).validate(1000)


# ---- the real engine -----------------------------------------------------------------------------

BASE = {"parallel": 2, "max_context": 128, "prefill": 16, "warmup": False}
PROMPTS = [[5, 17, 33, 2, 90, 41, 12], [3, 3, 8, 200, 11, 64, 64, 9, 150, 6, 77]]
BUDGET, N = 5, 14


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model(arch="llama", layers=2, hidden=64, heads=4, kv_heads=2)


def _close_id(path) -> int:
    return load_tokenizer(GGUFModel.open(path).metadata).token_to_id("</think>")


def _budgeted(eng, close: int, budget: int):
    return run_all(eng, PROMPTS, max_tokens=N, ignore_eos=True, reasoning_open=[close - 1],
                   reasoning_close=[close], reasoning_inside=True, reasoning_budget=budget)


@pytest.mark.parametrize("drafter", [None, "self"])
def test_engine_output_is_greedy_up_to_the_budget_then_the_close_mark(tiny, drafter):
    close = _close_id(tiny)
    spec = {} if drafter is None else {"spec": 4, "drafter": f"draft:{tiny}", "spec_min_p": 0.0}
    with Engine.from_gguf(tiny, EngineConfig(**BASE, **spec)) as eng:
        free = [t for t, _ in run_all(eng, PROMPTS, max_tokens=N, ignore_eos=True)]
        got = _budgeted(eng, close, BUDGET)
        zero = _budgeted(eng, close, 0)
        if drafter is not None:       # the self-drafted engine accepted drafts past the budget
            assert eng.stats()["spec"]["draft_n_accepted"] > 0
        # the model's own continuation of the forced prefix
        after = [eng.generate(p + t[:BUDGET + 1], max_tokens=N - BUDGET - 1,
                              ignore_eos=True).tokens for p, (t, _) in zip(PROMPTS, got)]
    assert all(close not in t[:BUDGET] for t in free), "the model closed by itself: pick prompts"
    for (tokens, stats), alone, rest in zip(got, free, after):
        assert tokens[:BUDGET] == alone[:BUDGET]
        assert tokens[BUDGET] == close
        assert tokens[BUDGET + 1:] == rest
        assert stats["reasoning_tokens"] == BUDGET
    for tokens, stats in zero:
        assert tokens[0] == close and stats["reasoning_tokens"] == 0


# ---- the real server -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(think_model):
    with ServerProcess([str(think_model), "--parallel", "2", "--max-context", "512",
                        "--reasoning-budget", "16", "--model-name", "tiny"]) as srv:
        srv.wait_up().wait_ready()
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


HI = [{"role": "user", "content": "Why is the sky blue?"}]


def _tokens_of(choice) -> list[str]:
    return [e.token for e in choice.logprobs.content]


def test_server_budget_bounds_every_answers_reasoning(client, think_model):
    """--reasoning-budget 16: with </think> banned the model cannot close by itself, so the engine
    closes after exactly 16 tokens and the answer follows; sampled freely, no answer thinks more
    than 16."""
    ban = {str(_close_id(think_model)): -100}
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=40, seed=seed,
                                           temperature=1.0, logprobs=True, logit_bias=ban,
                                           extra_body={"ignore_eos": True})
        choice = r.choices[0]
        assert r.usage.completion_tokens_details.reasoning_tokens == 16
        assert _tokens_of(choice).index("</think>") == 16
        assert choice.message.content, "the answer after the reasoning is present"
        assert choice.message.model_extra["reasoning_content"]
    for seed in range(3):
        r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=40, seed=seed,
                                           temperature=1.0, logprobs=True)
        tokens = _tokens_of(r.choices[0])
        thought = tokens.index("</think>") if "</think>" in tokens else len(tokens)
        assert thought <= 16 and r.usage.completion_tokens_details.reasoning_tokens == thought


def test_request_budget_over_the_servers_and_streamed(client, think_model):
    ban = {str(_close_id(think_model)): -100}
    kw = {"model": "tiny", "messages": HI, "max_tokens": 30, "seed": 1, "temperature": 1.0,
          "logit_bias": ban, "extra_body": {"thinking_token_budget": 4, "ignore_eos": True}}
    whole = client.chat.completions.create(**kw)
    assert whole.usage.completion_tokens_details.reasoning_tokens == 4
    chunks = list(client.chat.completions.create(**kw, stream=True,
                                                 stream_options={"include_usage": True}))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                        for c in chunks if c.choices)
    assert reasoning == whole.choices[0].message.model_extra["reasoning_content"]
    assert chunks[-1].usage.completion_tokens_details.reasoning_tokens == 4


def test_budget_zero_gives_no_reasoning_section(client):
    r = client.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=0,
                                       extra_body={"thinking_token_budget": 0})
    assert r.choices[0].message.model_extra.get("reasoning_content") is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_text_completions_count_reasoning_too(server, client, think_model):
    """A prompt that ends inside the section (its text opens <think>) is budgeted on
    /v1/completions as well."""
    ban = {str(_close_id(think_model)): -100}
    r = client.completions.create(model="tiny", prompt="<|im_start|>user\nHi<|im_end|>\n"
                                  "<|im_start|>assistant\n<think>", max_tokens=20, seed=0,
                                  temperature=1.0, logit_bias=ban,
                                  extra_body={"thinking_token_budget": 6, "ignore_eos": True})
    assert r.usage.completion_tokens_details.reasoning_tokens == 6
    assert "</think>" in r.choices[0].text


def test_a_bad_budget_is_a_400_naming_it(server):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": HI, "max_tokens": 4, "thinking_token_budget": -2})
    assert r.status_code == 400 and "thinking_token_budget" in r.text, r.text
