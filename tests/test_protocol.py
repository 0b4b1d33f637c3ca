"""The frames between the server and its engine process (serve/protocol.py): every frame type round
trips through the wire, and a malformed frame is a FrameError naming the frame and the field where
it is read, in a decoder, in a stream, and from an engine process (which the supervisor then stops
and records)."""

from __future__ import annotations

import asyncio
import io
import struct
import sys
import typing

import msgspec
import numpy as np
import pytest

from strata_jax import EngineConfig
from strata_jax.engine.request import Event, SamplingParams, make_params
from strata_jax.serve.errors import ApiError
from strata_jax.serve.protocol import (
    MAX_FRAME,
    Answer,
    AnyCommand,
    AnyReply,
    Beat,
    Cancel,
    Detokenize,
    Embed,
    EventFrame,
    FrameError,
    GetStats,
    Progress,
    Ready,
    Rejected,
    Saved,
    SaveExpertProfile,
    Shutdown,
    SlotAction,
    Start,
    Stats,
    Submit,
    Tokenize,
    decode_command,
    decode_reply,
    decode_start,
    length,
    pack,
    read_frame,
)
from strata_jax.serve.supervisor.answers import expect
from strata_jax.serve.supervisor.supervisor import Supervisor

SAMPLING = make_params(7, temperature=0.5, stop=["\n"], logit_bias={3: -1.5}, seed=2**32 - 1,
                       grammar=["json_schema", '{"type": "object"}', "response_format"])

COMMANDS = [
    Submit("a", [1, 2, 3], SAMPLING, progress=True, cache_salt="é", checkpoint_at=2),
    Submit("b", [5], make_params(1)),
    Cancel("a"),
    GetStats("stats-1"),
    SaveExpertProfile("profile-1", "/srv/profiles/hot.json"),
    Shutdown(),
    Tokenize("tokenize-1", "hello", add_special=True, parse_special=False, with_pieces=True),
    Tokenize("tokenize-2", ["a", 7, "b"]),
    Detokenize("detokenize-1", [1, 2, 3]),
    SlotAction("slot-1", "save", 0, "/srv/slots/a.bin"),
    SlotAction("slot-2", "erase", 1),
    Embed("embed-1", ["hello", [1, 2, 3]], "last", -1),
]

EVENTS = [
    Event("token", text="w0 ", token=5, request=3),
    Event("token", text="", token=6, logprob=-0.25, top_logprobs=[(6, -0.25), (9, -2.0)], request=3,
          logprobs=[b"\xe2\x82", -0.25, [[b"\xe2\x82", -0.25], [b"x", -2.0]]],
          logprob_ids=[6, [6, 9]]),
    Event("progress", stats={"total": 12, "cache": 0, "processed": 8, "time_ms": 1.5}),
    Event("final", finish_reason="stop", stats={"prompt_tokens": 3, "log_line": "prompt 3 tokens"}),
    Event("error", error="the engine did not answer"),
]

REPLIES = [
    Progress("loading weights", 3, 10),
    Ready({"architecture": "qwen3moe", "n_ctx": 4096, "eos_ids": [2],
           "chat_template_source": None}),
    Beat(0.125, False, "alive"),
    Beat(0.0, True, "ended"),
    Rejected("a", "context", "too long", n_prompt_tokens=10, max_tokens=5, n_ctx=12),
    Rejected("b", "invalid", "top_k = -2: ...", param="top_k"),
    Rejected("c", "template", "no chat template"),
    *[EventFrame("a", ev) for ev in EVENTS],
    Stats("stats-1", {"programs": {"built": 3, "live": 2}, "queued": 0}),
    Saved("profile-1", "/srv/profiles/hot.json", 1234),
    Answer("tokenize-1", tokens=[1, 2]),
    Answer("tokenize-2", tokens=[{"id": 1, "piece": "a"}, {"id": 2, "piece": [226, 130]}]),
    Answer("detokenize-1", content="hello"),
    Answer("slot-1", slot={"id_slot": 0, "filename": "a.bin", "n_saved": 12}),
    Answer("embed-1", embeddings=[[0.5, -0.25], [1.0, 0.0]], n_tokens=[3, 4]),
]


def _body(frame) -> bytes:
    data = pack(frame)
    assert length(data[:4]) == len(data) - 4
    return data[4:]


def _raw(obj) -> bytes:
    return msgspec.msgpack.encode(obj)


@pytest.mark.parametrize("frame", COMMANDS, ids=lambda f: type(f).__name__)
def test_every_command_round_trips(frame):
    assert decode_command(_body(frame)) == frame


@pytest.mark.parametrize("frame", REPLIES, ids=lambda f: type(f).__name__)
def test_every_reply_round_trips(frame):
    assert decode_reply(_body(frame)) == frame


def test_every_frame_type_is_tested():
    assert {type(f) for f in COMMANDS} == set(typing.get_args(AnyCommand))
    assert {type(f) for f in REPLIES} == set(typing.get_args(AnyReply))


def test_the_start_frame_round_trips():
    start = Start("/models/m.gguf", EngineConfig(parallel=3).to_dict(), "{{ messages }}")
    assert decode_start(_body(start)) == start
    assert EngineConfig.from_dict(decode_start(_body(start)).engine).parallel == 3


def test_an_event_frame_carries_the_engines_own_event():
    """One type from the engine's queue to the server's: an Event, numpy values in its stats made
    plain."""
    ev = Event("final", finish_reason="length", stats={"generated_tokens": np.int64(4),
                                                       "ms": np.float32(1.5), "ids": np.arange(2)})
    got = decode_reply(_body(EventFrame("r", ev)))
    assert type(got.event) is Event
    assert got.event.stats == {"generated_tokens": 4, "ms": 1.5, "ids": [0, 1]}
    assert got.event.finish_reason == "length"


def test_the_wire_is_a_map_tagged_by_its_kind():
    assert msgspec.msgpack.decode(_body(Cancel("a"))) == {"op": "cancel", "id": "a"}
    assert msgspec.msgpack.decode(_body(Rejected("x", "invalid", "m"))) == \
        {"t": "rejected", "id": "x", "kind": "invalid", "message": "m"}


def test_a_submit_carries_the_engines_own_sampling_parameters():
    """The server builds SamplingParams once (serve/prompts.py); the engine reads them as they are:
    the same type, tuples and all, with no dict of parameters on the wire."""
    got = decode_command(_body(COMMANDS[0]))
    assert type(got.sampling) is SamplingParams and got.sampling == SAMPLING
    assert got.sampling.stop == ("\n",) and got.sampling.logit_bias == ((3, -1.5),)
    wire = msgspec.msgpack.decode(_body(COMMANDS[0]))
    assert set(wire) == {"op", "id", "ids", "sampling", "progress", "cache_salt", "checkpoint_at"}
    assert wire["sampling"]["grammar"] == ["json_schema", '{"type": "object"}', "response_format"]


# ---- malformed frames ----------------------------------------------------------------------------

MALFORMED = [  # (frame as sent, decoder, what the error says)
    ({"op": "submit", "id": "a", "ids": "1 2 3", "sampling": {}}, decode_command,
     ["malformed 'submit' frame from the server", "Expected `array`, got `str`", "$.ids"]),
    ({"op": "submit", "id": "a", "ids": [1, "2"], "sampling": {}}, decode_command,
     ["'submit'", "$.ids[1]"]),
    ({"op": "submit", "id": 7, "ids": [1], "sampling": {}}, decode_command,
     ["'submit'", "$.id"]),
    ({"op": "submit", "id": "a", "ids": [1], "sampling": {"top_k": "x"}}, decode_command,
     ["'submit'", "$.sampling.top_k"]),
    ({"op": "submit", "id": "a", "ids": [1], "params": {}}, decode_command,
     ["'submit'", "unknown field `params`"]),
    ({"op": "submit", "id": "a", "ids": [1]}, decode_command,
     ["'submit'", "missing required field `sampling`"]),
    ({"op": "slot", "id": "s", "action": "burn", "slot": 0}, decode_command,
     ["'slot'", "$.action"]),
    ({"op": "cancel"}, decode_command, ["'cancel'", "missing required field `id`"]),
    ({"op": "cancel", "id": "a", "rid": "b"}, decode_command, ["'cancel'", "unknown field `rid`"]),
    ({"op": "launch", "id": "a"}, decode_command,
     ["unknown frame from the server", "op = 'launch'", "submit"]),
    ({"id": "a"}, decode_command, ["unknown frame", "op = None"]),
    ([1, 2], decode_command, ["not a map"]),
    ({"t": "ev", "id": "a", "event": {"kind": "token", "token": "five"}}, decode_reply,
     ["malformed 'ev' frame from the engine", "$.event.token"]),
    ({"t": "ev", "id": "a", "event": {"text": "x"}}, decode_reply, ["'ev'", "`kind`"]),
    ({"t": "beat", "stuck_s": 0.5, "compiling": False, "loop": "gone"}, decode_reply,
     ["'beat'", "$.loop"]),
    ({"t": "rejected", "id": "a", "kind": "context", "message": "m"}, decode_reply,
     ["'rejected'", "n_prompt_tokens, max_tokens and n_ctx"]),
    ({"t": "ready", "info": 3}, decode_reply, ["'ready'", "$.info"]),
    ({"t": "hello"}, decode_reply,
     ["unknown frame from the engine", "t = 'hello'", "answer, beat"]),
    ({"model": 1, "engine": {}}, decode_start, ["start-up frame", "$.model"]),
]


@pytest.mark.parametrize("frame, decode, says", MALFORMED, ids=lambda x: None)
def test_a_malformed_frame_names_the_frame_and_the_field(frame, decode, says):
    with pytest.raises(FrameError) as e:
        decode(_raw(frame))
    for part in says:
        assert part in str(e.value), (part, str(e.value))
    assert isinstance(e.value, ValueError)


def test_a_frame_error_keeps_the_frame_and_its_id():
    """The engine process answers a malformed command that names an id (worker.py: Worker.serve)."""
    with pytest.raises(FrameError) as e:
        decode_command(_raw({"op": "detokenize", "id": "detokenize-4", "tokens": [1.5]}))
    assert (e.value.tag, e.value.id) == ("detokenize", "detokenize-4")
    with pytest.raises(FrameError, match="not msgpack"):
        decode_reply(b"\xc1")


def test_a_malformed_frame_in_a_stream_is_read_whole():
    """The length header keeps the stream in step: the frame after a malformed one reads as it was
    sent."""
    bad = _raw({"op": "cancel", "id": 3})
    f = io.BytesIO(struct.pack(">I", len(bad)) + bad + pack(Cancel("b")))
    with pytest.raises(FrameError, match="'cancel'"):
        read_frame(f, decode_command)
    assert read_frame(f, decode_command) == Cancel("b")
    assert read_frame(f, decode_command) is None
    with pytest.raises(ValueError, match="beyond the limit"):
        length(struct.pack(">I", MAX_FRAME + 1))


def test_an_answer_of_the_wrong_kind_is_an_error():
    assert expect(Answer("a", content="x"), Answer).content == "x"
    with pytest.raises(ApiError) as e:
        expect(Rejected("a", "invalid", "tokens[0] = -1: not a token id", param="tokens"), Answer)
    assert (e.value.status, e.value.param) == (400, "tokens")
    with pytest.raises(ApiError) as e:
        expect(Stats("a", {}), Answer)
    assert e.value.status == 500


BAD_ENGINE = """
import struct, sys
import msgspec
from strata_jax.serve.protocol import decode_start, read_frame
read_frame(sys.stdin.buffer, decode_start)
body = msgspec.msgpack.encode({"t": "ready", "info": 3})
sys.stdout.buffer.write(struct.pack(">I", len(body)) + body)
sys.stdout.buffer.flush()
sys.stdin.buffer.read()
"""


def test_an_engine_that_sends_a_malformed_frame_is_stopped_and_says_which():
    async def go():
        faults = asyncio.Queue()
        sup = Supervisor("mock.gguf", EngineConfig(parallel=1, max_context=64), backoff_s=30.0,
                         command=[sys.executable, "-c", BAD_ENGINE], on_fault=faults.put_nowait)
        await sup.start()
        try:
            return await asyncio.wait_for(faults.get(), 30)
        finally:
            await sup.stop(timeout=2.0)

    fault = asyncio.run(go())
    assert fault.error_line.startswith("ERR the engine's answers could not be read: a malformed "
                                       "'ready' frame")
    assert "$.info" in fault.error_line and fault.exit_code == -9


def _types_in(hint) -> list:
    """Every type a type hint names, nested ones and a dataclass's or struct's fields' included."""
    import dataclasses

    out, stack, seen = [], [hint], set()
    while stack:
        h = stack.pop()
        if id(h) in seen:
            continue
        seen.add(id(h))
        out.append(h)
        stack += typing.get_args(h)
        origin = typing.get_origin(h)
        if origin is not None:
            out.append(origin)
        if isinstance(h, type) and (dataclasses.is_dataclass(h) or issubclass(h, msgspec.Struct)):
            stack += typing.get_type_hints(h).values()
    return out


def test_no_dict_of_a_request_crosses_the_pipe():
    """issue 35: a request goes to the engine as one Submit, typed to its last field (the engine's
    own SamplingParams); no dict, no Any anywhere in it."""
    found = _types_in(Submit)
    assert SamplingParams in found
    assert dict not in found and typing.Any not in found, found
    # (the check sees one: a struct with a dict of parameters)

    class Loose(msgspec.Struct):
        params: dict[str, typing.Any]

    assert dict in _types_in(Loose)
