"""OpenAI's Responses API (issue 38 item 2) against the real server, spoken to with the official
openai SDK's `client.responses`: whole and streamed answers (the SDK's stream helper accumulates the
events into the final response), a forced function call and its function_call_output round trip, a
3-turn previous_response_id chain whose later turns reuse the prefix cache, json_schema output, and
the store's bounds (an evicted id is a 404). One server for the module, on a tiny qwen3 whose
template renders tools (Hermes) and opens <think> unless enable_thinking is false; its weights are
random, so answers are checked for their plumbing, not their sense."""

from __future__ import annotations

import itertools
import json

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response

from strata_jax.serve.launch import ServerProcess
from strata_jax.testing.edit_gguf import rewrite_gguf
from strata_jax.testing.templates import QWEN3_TOOLS_TEMPLATE

KEPT = 3                                   # --responses-max: the eviction test stays short
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"enum": ["Paris", "Rome"]},
                                         "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False},
           "strict": True}
FORCED = {"tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
          "parallel_tool_calls": False}
NO_THINKING = {"effort": "none"}           # enable_thinking false: the answer is text at once
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tools_model(tiny_model, tmp_path_factory):
    plain = tiny_model(arch="qwen3", layers=2, hidden=64)
    return rewrite_gguf(plain, tmp_path_factory.mktemp("responses") / "tools.gguf",
                        set_metadata={"tokenizer.chat_template": QWEN3_TOOLS_TEMPLATE})


@pytest.fixture(scope="module")
def server(tools_model):
    args = [str(tools_model), "--parallel", "2", "--max-context", "1024", "--model-name", "tiny",
            "--responses-max", str(KEPT)]
    with ServerProcess(args) as srv:
        srv.wait_up().wait_ready()
        yield srv


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _post(server, body):
    return httpx.post(server.url + "/v1/responses", json=body, timeout=60)


def test_create_answers_a_response_object_that_get_shows(server, client):
    r = client.responses.create(model="tiny", input="Hi", instructions="Be brief.",
                                reasoning=NO_THINKING, max_output_tokens=8, temperature=0,
                                metadata={"run": "t1"})
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "tiny"
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    assert isinstance(r.output_text, str) and r.output_text == r.output[0].content[0].text
    if r.status == "incomplete":               # random weights: most likely cut at 8 tokens
        assert r.incomplete_details.reason == "max_output_tokens"
        assert r.output[0].status == "incomplete" and r.usage.output_tokens == 8
    else:
        assert r.status == "completed" and r.incomplete_details is None
    u = r.usage
    assert u.input_tokens > 5 and u.total_tokens == u.input_tokens + u.output_tokens
    assert (r.instructions, r.max_output_tokens, r.metadata, r.store) == ("Be brief.", 8,
                                                                         {"run": "t1"}, True)
    assert client.responses.retrieve(r.id).model_dump() == r.model_dump()
    # the SDK builds its models unchecked: the raw object validates as its Response too
    raw = httpx.get(f"{server.url}/v1/responses/{r.id}", timeout=30).json()
    assert Response.model_validate(raw).id == r.id


def test_stream_events_accumulate_to_the_whole_answer(server, client):
    kw = {"model": "tiny", "input": "Hi", "max_output_tokens": 12, "temperature": 0}
    whole = client.responses.create(**kw)
    assert whole.output[0].type == "reasoning", "the template opens <think>"
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert reasoning == whole.output[0].content[0].text and text == whole.output_text
    final = events[-1].response
    assert [i.type for i in final.output] == [i.type for i in whole.output]
    assert final.output_text == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    assert added == [e.item.id for e in events if e.type == "response.output_item.done"]
    assert added == [i.id for i in final.output]
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_stream_helper_forced_call_and_its_round_trip(server, client):
    with client.responses.stream(model="tiny", input="The weather in Paris?", **FORCED,
                                 max_output_tokens=120, temperature=0) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    [call] = streamed.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert call.parsed_arguments == json.loads(call.arguments)      # a strict tool: the SDK parses
    whole = client.responses.create(model="tiny", input="The weather in Paris?", **FORCED,
                                    max_output_tokens=120, temperature=0)
    assert whole.status == "completed" and whole.output[0].arguments == call.arguments
    # the result, by previous_response_id: the stored conversation and the call's result
    result = [{"type": "function_call_output", "call_id": whole.output[0].call_id,
               "output": '{"celsius": 21}'}]
    answer = client.responses.create(model="tiny", previous_response_id=whole.id, input=result,
                                     tools=[WEATHER], reasoning=NO_THINKING, max_output_tokens=8,
                                     temperature=0)
    assert [i.type for i in answer.output] == ["message"] and answer.output_text
    assert answer.usage.input_tokens_details.cached_tokens > 0
    # the same turn with the call sent back as an input item, as a client without the store does
    again = client.responses.create(model="tiny", input=[
        {"role": "user", "content": "The weather in Paris?"},
        whole.output[0].model_dump(exclude_none=True), *result], tools=[WEATHER],
        reasoning=NO_THINKING, max_output_tokens=8, temperature=0, store=False)
    assert again.output_text == answer.output_text


def test_previous_response_id_chain_reuses_the_prefix_cache(server, client):
    previous, seen = None, []
    for question in ("Hi", "And then?", "Why?"):
        r = client.responses.create(model="tiny", input=question, instructions="Be brief.",
                                    previous_response_id=previous, max_output_tokens=8,
                                    temperature=0)
        assert r.previous_response_id == previous
        seen.append(r.usage)
        previous = r.id
    assert seen[0].input_tokens < seen[1].input_tokens < seen[2].input_tokens
    # each later turn's prompt begins with the one before it: its prompt (but for the generation
    # prompt's <think>, which the answer's rendering has not) and answer
    for before, later in itertools.pairwise(seen):
        assert later.input_tokens_details.cached_tokens > before.input_tokens // 2


def test_json_schema_output_validates(server, client):
    r = client.responses.create(model="tiny", input="Give me JSON.", reasoning=NO_THINKING,
                                text={"format": {"type": "json_schema", "name": "thing",
                                                 "schema": SCHEMA, "strict": True}},
                                max_output_tokens=40, temperature=0)
    assert r.status == "completed", r.output_text
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


def test_store_is_bounded_and_ids_go_away(server, client):
    first = client.responses.create(model="tiny", input="Hi", max_output_tokens=1)
    for _ in range(KEPT):                       # the newest KEPT remain
        client.responses.create(model="tiny", input="Hi", max_output_tokens=1)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model="tiny", input="More", previous_response_id=first.id,
                                max_output_tokens=1)
    error = gone.value.body
    assert error["code"] == "previous_response_not_found"
    assert error["param"] == "previous_response_id" and "--responses-max" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unkept = client.responses.create(model="tiny", input="Hi", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unkept.id)
    kept = client.responses.create(model="tiny", input="Hi", max_output_tokens=1)
    deleted = httpx.delete(f"{server.url}/v1/responses/{kept.id}", timeout=30)
    assert deleted.json() == {"id": kept.id, "object": "response.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    assert httpx.delete(f"{server.url}/v1/responses/{kept.id}", timeout=30).status_code == 404


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[0]"),
    ({"input": [{"type": "function_call_output", "output": "21"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c9", "output": "21"}]},
     "input[0].call_id"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}},
     "text.format.schema"),
    ({"input": "Hi", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "Hi", "truncation": "auto"}, "truncation"),
    ({"input": 5}, "input"),
    ({"input": "Hi", "temperature": -1}, "temperature"),
])
def test_bad_values_are_a_400_naming_them(server, body, param):
    r = _post(server, {"model": "tiny", **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.split("[")[0].split(".")[0] in error["message"]


def test_requests_count_under_their_endpoint(server, client):
    client.responses.create(model="tiny", input="Hi", max_output_tokens=1)
    assert _post(server, {"input": "Hi", "max_output_tokens": 0}).status_code == 400
    text = httpx.get(server.url + "/metrics", timeout=30).text
    assert 'strata_requests_total{endpoint="responses",outcome="ok"}' in text
    assert 'strata_requests_total{endpoint="responses",outcome="rejected"}' in text


# ---- the event stream and the store, without a server ----------------------------------------


def _chunk(delta=None, finish=None, **extra):
    return {"choices": [{"index": 0, "delta": delta or {}, "finish_reason": finish}], **extra}


CHUNKS = [_chunk({"role": "assistant", "content": ""}), _chunk({"reasoning_content": "Hm"}),
          _chunk({"reasoning_content": "."}), _chunk({"content": "\n"}),
          _chunk({"content": "Sure"}),
          _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                  "function": {"name": "get_weather", "arguments": ""}}]}),
          _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"unit": '}}]}),
          _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"c"}'}}]}),
          _chunk(finish="tool_calls"),
          {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7,
                                    "prompt_tokens_details": {"cached_tokens": 4}}}]


async def _aiter(items):
    for item in items:
        yield item


def _events(chunks):
    import asyncio

    from strata_jax.serve.http.responses_stream import EventStream

    stream = EventStream("resp_1", "tiny", {"tools": [], "tool_choice": "auto",
                                             "parallel_tool_calls": True})

    async def run():
        return [e async for e in stream.events(_aiter(chunks))]

    return asyncio.run(run()), stream


def test_stream_events_are_the_sdk_types_in_order():
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    events, stream = _events(CHUNKS)
    typed = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in events]
    assert [e.type for e in typed] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta",                       # "\n" held, then sent with "Sure"
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    final = Response.model_validate(stream.final)
    assert [i.type for i in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "\nSure" and final.output[2].arguments == '{"unit": "c"}'
    assert [e.output_index for e in typed if e.type == "response.output_item.done"] == [0, 1, 2]
    assert final.usage.input_tokens_details.cached_tokens == 4 and final.usage.total_tokens == 16


def test_an_engine_error_is_response_failed():
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    error = {"error": {"message": "the engine stopped", "type": "server_error", "code": 500}}
    events, stream = _events([*CHUNKS[:3], error])
    last = TypeAdapter(ResponseStreamEvent).validate_python(events[-1])
    assert last.type == "response.failed" and last.response.status == "failed"
    assert last.response.error.message == "the engine stopped"
    assert events[-2]["type"] == "response.output_item.done" and stream.final is None


def test_store_evicts_the_least_recently_used_by_count_and_bytes():
    from strata_jax.serve.http.responses_store import ResponseStore

    store = ResponseStore(max_count=2, max_bytes=400)
    for n in "abc":
        store.put({"id": n}, [{"role": "user", "content": n}])
        if n == "b":
            assert store.get("a") is not None           # a used: b is the least recent
    assert store.get("b") is None and store.get("a") and store.get("c") and len(store) == 2
    assert not store.put({"id": "big"}, [{"role": "user", "content": "x" * 500}])
    store.put({"id": "d"}, [{"role": "user", "content": "x" * 320}])
    assert len(store) == 1 and store.get("d") and store.bytes < 400
    assert store.delete("d") and not store.delete("d") and store.bytes == 0
