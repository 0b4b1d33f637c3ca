"""Anthropic's Messages API (issue 38, item 1) against the real server, with the official
anthropic client: a whole answer and its stream (the SDK's accumulator) agree, a forced tool call
validates and its tool_result comes back to an answer, thinking with a budget is a thinking block, a
stop sequence is named, count_tokens is what the stream's message_start says, and every bad value is
a 400 in Anthropic's error shape naming its field. One server (a tiny qwen3 whose Hermes template
renders tools and opens <think>, as Qwen3's does) behind an API key, which the client sends as
x-api-key. Its weights are random: the plumbing is checked, not the sense."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest
from tool_data import TIME, WEATHER

from strata_jax.serve.http.messages_stream import Events
from strata_jax.serve.launch import ServerProcess
from strata_jax.testing.edit_gguf import rewrite_gguf
from strata_jax.testing.templates import QWEN3_TOOLS_TEMPLATE

KEY = "messages-test-key"
HI = [{"role": "user", "content": "Hi there, what is new?"}]
ASK = [{"role": "user", "content": [{"type": "text", "text": "What is the weather in Paris?"}]}]
TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
          "input_schema": t["function"]["parameters"]} for t in (WEATHER, TIME)]
SCHEMAS = {t["name"]: t["input_schema"] for t in TOOLS}
NO_THINKING = {"type": "disabled"}
# (this SDK's create() has no temperature argument: the body's field, as Anthropic's API reads it)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    path = rewrite_gguf(tiny_model(arch="qwen3", layers=2, hidden=64),
                        tmp_path_factory.mktemp("messages") / "model.gguf",
                        set_metadata={"tokenizer.chat_template": QWEN3_TOOLS_TEMPLATE})
    with ServerProcess([str(path), "--parallel", "2", "--max-context", "1024", "--model-name",
                        "tiny"], api_key=KEY) as srv:
        srv.wait_up().wait_ready()
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def _post(server, path: str, body, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.url + path, content=json.dumps(body), timeout=120,
                      headers={"Content-Type": "application/json", "x-api-key": KEY,
                               "anthropic-version": "2023-06-01", **(headers or {})})


def _events(text: str) -> list[tuple[str, dict]]:
    """An SSE body as (event name, data) pairs."""
    out = []
    for part in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in part.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def _blocks(message) -> list[dict]:
    """Content blocks without tool_use ids (each answer draws its own)."""
    return [{k: v for k, v in b.model_dump(exclude_none=True).items() if k != "id"}
            for b in message.content]


def test_create_and_its_stream_agree(client):
    kw = {"model": "tiny", "max_tokens": 16, "messages": HI, "extra_body": GREEDY,
          "system": [{"type": "text", "text": "Be brief."}], "metadata": {"user_id": "u-1"}}
    whole = client.messages.create(**kw)
    assert (whole.type, whole.role, whole.model) == ("message", "assistant", "tiny")
    assert whole.id.startswith("msg_")
    # the template opened <think>: the answer starts as thinking
    assert whole.content and whole.content[0].type == "thinking"
    assert {b.type for b in whole.content} <= {"thinking", "text"}
    assert whole.stop_reason in ("max_tokens", "end_turn") and whole.stop_sequence is None
    if whole.stop_reason == "max_tokens":
        assert whole.usage.output_tokens == 16
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens > 5
    assert whole.usage.cache_creation_input_tokens == 0
    with client.messages.stream(**kw, extra_headers={"anthropic-beta": "anything"}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "thinking" in kinds and "content_block_stop" in kinds
    assert _blocks(final) == _blocks(whole)
    assert (final.stop_reason, final.usage.output_tokens) == (whole.stop_reason,
                                                             whole.usage.output_tokens)


def test_max_tokens_is_a_ceiling_cut_to_the_slots_room(client):
    """Claude Code asks max_tokens 32000 whatever the context: on this route it is cut to what the
    prompt leaves of a slot (1024 here), not refused as the chat route refuses it; an answer that
    fills the slot ends with max_tokens."""
    r = client.messages.create(model="tiny", max_tokens=32000, messages=HI, extra_body=GREEDY)
    room = 1024 - (r.usage.input_tokens + r.usage.cache_read_input_tokens)
    assert r.stop_reason in ("max_tokens", "end_turn") and 0 < r.usage.output_tokens <= room
    assert (r.stop_reason == "max_tokens") == (r.usage.output_tokens == room)


def test_raw_events_and_count_tokens(server, client):
    body = {"model": "tiny", "max_tokens": 8, "messages": HI, "tools": TOOLS, "temperature": 0,
            "system": "You answer in French.", "stream": True}
    r = _post(server, "/v1/messages", body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _events(r.text)
    names = [name for name, _ in events]
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta",
                                                                     "message_stop"]
    assert all(data["type"] == name for name, data in events)
    # blocks: start, deltas, stop, each in turn, their indexes 0, 1, ...
    starts = [d["index"] for n, d in events if n == "content_block_start"]
    assert starts == list(range(len(starts))) and starts
    assert [d["index"] for n, d in events if n == "content_block_stop"] == starts
    start = events[0][1]["message"]
    assert start["content"] == [] and start["usage"]["output_tokens"] == 0
    counted = client.messages.count_tokens(model="tiny", messages=HI, tools=TOOLS,
                                           system="You answer in French.")
    assert counted.input_tokens == start["usage"]["input_tokens"]
    final = events[-2][1]["usage"]
    assert final["input_tokens"] + final["cache_read_input_tokens"] == counted.input_tokens
    assert final["output_tokens"] == 8 or events[-2][1]["delta"]["stop_reason"] == "end_turn"
    # the tools and the system prompt are part of the prompt
    bare = client.messages.count_tokens(model="tiny", messages=HI)
    assert bare.input_tokens < counted.input_tokens


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_time"}, {"type": "any"}])
def test_forced_tool_round_trip(client, choice):
    kw = {"model": "tiny", "max_tokens": 120, "messages": ASK, "tools": TOOLS,
          "extra_body": GREEDY,
          "tool_choice": {**choice, "disable_parallel_tool_use": True}}
    r = client.messages.create(**kw)
    assert r.stop_reason == "tool_use", r
    (call,) = [b for b in r.content if b.type == "tool_use"]
    assert call.id.startswith("toolu_")
    assert call.name == choice.get("name", call.name) and call.name in SCHEMAS
    jsonschema.validate(call.input, SCHEMAS[call.name])
    # streamed: input_json_delta pieces the accumulator puts together into the same input
    with client.messages.stream(**kw) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and _blocks(final) == _blocks(r)
    # the call's result comes back, and the model answers
    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                       for b in r.content]},
               {"role": "user", "content": [
                   {"type": "tool_result", "tool_use_id": call.id,
                    "content": [{"type": "text", "text": '{"temperature": 21}'}]},
                   {"type": "text", "text": "And tomorrow?"}]}]
    answer = client.messages.create(model="tiny", max_tokens=12, messages=history, tools=TOOLS,
                                    tool_choice={"type": "none"}, extra_body=GREEDY,
                                    thinking=NO_THINKING)
    assert answer.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in answer.content] == ["text"]


def test_thinking_with_a_budget_and_without(client):
    r = client.messages.create(model="tiny", max_tokens=40, messages=HI,
                               thinking={"type": "enabled", "budget_tokens": 16})
    assert r.content[0].type == "thinking" and r.content[0].signature == ""
    # the engine's reasoning count: within the budget
    details = r.usage.output_tokens_details
    assert details is not None and 0 < details.thinking_tokens <= 16, r.usage
    off = client.messages.create(model="tiny", max_tokens=8, messages=HI, thinking=NO_THINKING)
    assert "thinking" not in [b.type for b in off.content]
    # a thinking block sent back is the assistant's reasoning, not an error
    back = [*HI, {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                   for b in r.content]},
            {"role": "user", "content": "Go on."}]
    assert client.messages.create(model="tiny", max_tokens=4, messages=back,
                                  thinking=NO_THINKING).usage.output_tokens > 0


def test_prefill_and_a_failed_tool_result(client):
    """A final assistant message is continued (no new turn: no thinking opened); a tool_result with
    is_error and string content renders."""
    r = client.messages.create(model="tiny", max_tokens=4, extra_body=GREEDY,
                               messages=[*HI, {"role": "assistant", "content": "Sure, here"}])
    assert [b.type for b in r.content] == ["text"] and r.stop_reason == "max_tokens"
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {"zone": 1}}
    history = [*ASK, {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                                       call]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                             "content": "no network", "is_error": True}]}]
    plain = client.messages.count_tokens(model="tiny", messages=history, tools=TOOLS)
    history[-1]["content"][0]["is_error"] = False
    assert client.messages.count_tokens(model="tiny", messages=history,
                                        tools=TOOLS).input_tokens < plain.input_tokens


def test_a_stop_sequence_is_named(client):
    kw = {"model": "tiny", "max_tokens": 16, "messages": HI, "extra_body": GREEDY,
          "thinking": NO_THINKING}
    text = "".join(b.text for b in client.messages.create(**kw).content if b.type == "text")
    assert len(text) >= 8, text
    stop = text[3:6]
    r = client.messages.create(**kw, stop_sequences=["never-written-here", stop])
    assert (r.stop_reason, r.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(**kw, stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    assert _blocks(final) == _blocks(r)


BAD = [
    ({"max_tokens": None}, "max_tokens"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                  "input": {}}]}]},
     "messages[0].content[0].type"),
    ({"stop_sequences": [f"s{i}" for i in range(17)]}, "stop_sequences"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"thinking": {"type": "enabled", "budget_tokens": 32}}, "thinking.budget_tokens"),
    ({"temperature": 1000}, "temperature"),
    ({"metadata": {"user_id": 7}}, "metadata.user_id"),
    ({"tools": [{"name": "a b", "input_schema": {"type": "object"}}]}, "tools[0].name"),
    ({"mcp_servers": []}, "mcp_servers"),
    ({"messages": []}, "messages"),
]


@pytest.mark.parametrize("change,field", BAD, ids=[f for _, f in BAD])
def test_a_bad_value_is_a_400_naming_it(server, change, field):
    body = {"model": "tiny", "max_tokens": 32, "messages": HI, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = _post(server, "/v1/messages", body)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert field in err["error"]["message"], err


def test_errors_in_anthropic_shape(server, client):
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=4, messages=HI)
    assert e.value.status_code == 401 and e.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=4, messages=HI,
                               extra_body={"top_k": -7})
    assert "top_k" in e.value.message
    r = _post(server, "/v1/messages/nope", {})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(server.url + "/v1/messages", content="hi", timeout=30,
                   headers={"x-api-key": KEY, "Content-Type": "text/plain"})
    assert r.status_code == 415 and r.json()["type"] == "error"
    # the chat route keeps OpenAI's shape
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": []}, timeout=30,
                   headers={"x-api-key": KEY})
    assert r.status_code == 400 and "code" in r.json()["error"]
    metrics = httpx.get(server.url + "/metrics", headers={"x-api-key": KEY}, timeout=30).text
    assert 'strata_requests_total{endpoint="messages",outcome="ok"}' in metrics
    assert 'strata_requests_total{endpoint="messages",outcome="rejected"}' in metrics


def test_events_from_chunks_without_a_server():
    """A call's pieces and an engine error mid-stream, as events."""
    ev = Events("msg_1", "tiny", 10)
    out = ev.feed({"choices": [{"delta": {"content": "Let me look."}}]})
    out += ev.feed({"choices": [{"delta": {"tool_calls": [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "get_time", "arguments": ""}}]}}]})
    out += ev.feed({"choices": [{"delta": {"tool_calls": [
        {"index": 0, "function": {"arguments": '{"zone": 3}'}}]}}]})
    out += ev.feed({"choices": [{"delta": {}, "finish_reason": "tool_calls"}]})
    out += ev.feed({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 7}})
    out += ev.end("")
    events = _events(b"".join(out).decode())
    assert [n for n, _ in events] == [
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert events[3][1]["content_block"] == {"type": "tool_use", "id": "toolu_call_1",
                                             "name": "get_time", "input": {}}
    assert events[4][1]["delta"] == {"type": "input_json_delta", "partial_json": '{"zone": 3}'}
    assert events[6][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}
    assert events[6][1]["usage"]["output_tokens"] == 7
    (name, data), = _events(Events.error({"error": {"message": "boom", "code": 503}}).decode())
    assert name == "error" and data == {"type": "error", "error": {"type": "overloaded_error",
                                                                    "message": "boom"}}
