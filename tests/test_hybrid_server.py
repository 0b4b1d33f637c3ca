"""The real `strata-jax serve` on a made qwen3next model (issue 34's server test): streamed chat
with reasoning, a forced tool call in the family's Hermes format, a second turn that resumes from
the first turn's state, slot save / erase / restore of a slot's KV and Gated DeltaNet state, and the
seed's ladder (1, 2, 4 users, 3 waves) with no failure and no engine restart; and qwen35moe with
Qwen3.5's own template: a forced call in its Qwen3-Coder XML while the template has opened the
reasoning, with the NextN block drafting (--drafter mtp). The weights are random: outputs are
checked for their plumbing, not their sense. The model is Q8_0 with the default int8 cpu math, as a
user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
from tool_data import TIME, WEATHER

from strata_jax.serve.launch import ServerProcess
from strata_jax.testing.edit_gguf import rewrite_gguf
from strata_jax.testing.templates import QWEN3_TOOLS_TEMPLATE

HYBRID = {"arch": "qwen3next", "layers": 4, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 8,
          "experts_used": 2, "expert_ffn": 32, "shared_ffn": 64}
SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
HI = [{"role": "user", "content": "Hi there, what is new?"}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-serve")
    path = rewrite_gguf(tiny_model(**HYBRID), root / "qwen3next.gguf",
                        set_metadata={"tokenizer.chat_template": QWEN3_TOOLS_TEMPLATE})
    saves = root / "slots"
    saves.mkdir(mode=0o700)
    args = [str(path), "--parallel", "4", "--max-context", "1024", "--model-name", "tiny",
            "--slot-save-path", str(saves)]
    with ServerProcess(args) as srv:
        srv.wait_up().wait_ready()
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=300)


def test_streamed_chat_with_reasoning(client):
    whole = client.chat.completions.create(model="tiny", messages=HI, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=12,
                                                 temperature=0,
                                                 stream=True,
                                                 stream_options={"include_usage": True}))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or ""
                        for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # the template opened <think>
    assert whole.choices[0].message.model_extra.get("reasoning_content") is not None
    assert (reasoning, content) == (whole.choices[0].message.model_extra["reasoning_content"] or "",
                                    whole.choices[0].message.content or "")
    assert chunks[-1].usage.completion_tokens == 12


def test_a_forced_tool_call_whole_and_streamed(client):
    kw = {"model": "tiny", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
          "max_tokens": 80, "temperature": 1.0, "parallel_tool_calls": False,
          "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    r = client.chat.completions.create(seed=1, **kw)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    chunks = list(client.chat.completions.create(seed=1, stream=True, **kw))
    pieces = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == call.function.name
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments


def test_a_second_turn_resumes_from_the_first_turns_state(client):
    """The second turn's prompt starts with the first turn's messages, rendered as they were (its
    answer after them is not: the template writes no empty <think> block for history): it resumes
    from the state kept at the first turn's end, before its generation prompt (EngineCore.turn_end),
    reading only the rest (timings' cache_n), and answers as a cold read (another cache_salt:
    nothing to resume from) does."""
    first = client.chat.completions.create(model="tiny", messages=HI, max_tokens=8, temperature=0,
                                           extra_body={
                                               "chat_template_kwargs": {"enable_thinking": False}})
    turn2 = HI + [{"role": "assistant", "content": first.choices[0].message.content or ""},
                  {"role": "user", "content": "And tomorrow?"}]
    kw = {"model": "tiny", "messages": turn2, "max_tokens": 8, "temperature": 0,
          "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    warm = client.chat.completions.create(**kw)
    timings = warm.model_extra["timings"]
    # resumed at the first turn's end: past its user message, before its generation prompt (which
    # the second turn's prompt does not repeat)
    assert 10 < timings["cache_n"] < first.usage.prompt_tokens
    assert timings["prompt_n"] + timings["cache_n"] == warm.usage.prompt_tokens
    cold = client.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"],
                                                                  "cache_salt": "cold"}})
    assert cold.model_extra["timings"]["cache_n"] == 0
    assert cold.choices[0].message.content == warm.choices[0].message.content


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=120)


def test_slot_save_erase_restore_round_trips_the_state(server):
    """The slot of a finished request (its tokens, KV and DeltaNet state) saved and erased, the file
    restored into another slot (whose own state was another conversation's): a prompt that goes on
    from the saved tokens resumes at all of them there (the restored live state: cache_n) and gives
    a cold read's text (another cache_salt). The same prompt twice resumes a token before its end
    (the checkpoint kept there)."""
    ids = httpx.post(server.url + "/tokenize",
                     json={"content": "Tell me a story about a cat. " * 3}).json()["tokens"]
    body = {"prompt": ids, "n_predict": 6, "temperature": 0, "return_tokens": True}
    first = httpx.post(server.url + "/completion", json=body, timeout=120).json()
    again = httpx.post(server.url + "/completion", json=body, timeout=120).json()
    assert again["tokens"] == first["tokens"] and again["timings"]["cache_n"] == len(ids) - 1
    # the engine's slot that holds them (the answers' id_slot is the server's seat, not the engine's
    # slot)
    saves = [_post(server, f"/slots/{i}?action=save", {"filename": f"hybrid{i}.bin"})
             for i in range(4)]
    assert all(r.status_code == 200 for r in saves), [r.text for r in saves]
    # the prompt and the answer but its last token (never read)
    saved = len(ids) + 5
    slot = next(i for i, r in enumerate(saves) if r.json()["n_saved"] == saved)
    assert _post(server, f"/slots/{slot}?action=erase", {}).status_code == 200
    other = (slot + 1) % 4
    r = _post(server, f"/slots/{other}?action=restore", {"filename": f"hybrid{slot}.bin"})
    assert r.status_code == 200 and r.json()["n_restored"] == saved, r.text
    more = {"model": "tiny", "prompt": ids + again["tokens"] + ids[:7], "max_tokens": 6,
            "temperature": 0}
    warm = httpx.post(server.url + "/v1/completions", json=more, timeout=120).json()
    cold = httpx.post(server.url + "/v1/completions", json={**more, "cache_salt": "cold"},
                      timeout=120).json()
    assert warm["timings"]["cache_n"] == saved and cold["timings"]["cache_n"] == 0
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"]


def test_the_seeds_ladder_without_a_failure_or_a_restart(server, tmp_path):
    out = tmp_path / "ladder.json"
    proc = subprocess.run([sys.executable, str(SCRIPTS / "ladder.py"), "--json", str(out), "--url",
                           server.url, "--levels", "1,2,4", "--waves", "3", "--prompt-tokens", "64",
                           "--max-tokens", "8"],
                          check=False, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "COLUMNS": "160"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert [lv["level"] for lv in report["levels"]] == [1, 2, 4]
    assert (report["requests"] == 3 * (1 + 2 + 4) and report["failed"] == 0
            and report["engine_restarts"] == 0)


@pytest.fixture(scope="module")
def qwen35(tiny_model, tmp_path_factory):
    """qwen35moe with its NextN block, Qwen3.5's own template (Qwen3-Coder XML calls), served with
    MTP drafts."""
    from strata_jax.testing.templates import QWEN35_TEMPLATE

    made = tiny_model(**{**HYBRID, "arch": "qwen35moe", "nextn": 1})
    path = rewrite_gguf(made, tmp_path_factory.mktemp("qwen35") / "qwen35moe.gguf",
                        set_metadata={"tokenizer.chat_template": QWEN35_TEMPLATE})
    args = [str(path), "--parallel", "2", "--max-context", "2048", "--model-name", "tiny",
            "--spec", "2",
            # (a random block's drafts are never sure)
            "--drafter", "mtp", "--spec-min-p", "0"]
    with ServerProcess(args) as srv:
        srv.wait_up().wait_ready()
        yield srv


def test_qwen35_calls_in_its_xml_format_while_thinking_with_mtp_drafts(qwen35):
    """A forced call with the reasoning left open by the template (<think>): the call ends the
    reasoning (as llama.cpp's Qwen3.5 parser ends it at <tool_call>) and comes back as an OpenAI
    tool call, whole and streamed; the engine drafts with the model's NextN block meanwhile
    (/metrics' draft counters)."""
    client = openai.OpenAI(base_url=qwen35.url + "/v1", api_key="none", max_retries=0, timeout=300)
    kw = {"model": "tiny", "messages": ASK, "tools": [WEATHER, TIME], "tool_choice": "required",
          "max_tokens": 80, "temperature": 1.0, "parallel_tool_calls": False}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    r = client.chat.completions.create(seed=2, **kw)
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    (call,) = r.choices[0].message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    assert not r.choices[0].message.model_extra.get("reasoning_content")
    chunks = list(client.chat.completions.create(seed=2, stream=True, **kw))
    pieces = [d for c in chunks if c.choices for d in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == call.function.name
    assert "".join(p.function.arguments or "" for p in pieces) == call.function.arguments
    plain = client.chat.completions.create(model="tiny", messages=HI, max_tokens=24, temperature=0)
    assert plain.usage.completion_tokens == 24
    metrics = httpx.get(qwen35.url + "/metrics", timeout=30).text
    drafted = [line for line in metrics.splitlines()
               if line.startswith("strata_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0, drafted
