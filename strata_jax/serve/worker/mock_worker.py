"""A mock engine process: speaks the worker's frames (protocol.py) with no model and no JAX, so the
server's own logic (queue, seats, cancels, deadlines, restarts) can be tested in a fraction of a
second.

    python -m strata_jax.serve.worker.mock_worker
    Supervisor(..., command=[sys.executable, "-m", this], prompts=MockPrompts(n_ctx))

A prompt's characters are its token ids (mock_prompts.py, on the server's side); the answer is
`max_tokens` tokens "w0 w1 ...", one every STRATA_MOCK_TOKEN_S seconds (default 0.005). Prompts that
contain a word ask for trouble:
    EXIT    the process prints `ERR mock: ...` and exits with code 3 after the third token
    HANG    the submit is never answered (an engine that is stuck)
    DEAF    the process stops reading its input for good, alive (what the server writes piles up)
    GRAMMAR the submit is refused as a grammar the engine cannot compile (Rejected "invalid")
Env STRATA_MOCK_START_FAIL=1: the process fails at start (prints an ERR line, exits 2).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

from ... import envs
from ..protocol import (
    Cancel,
    EventFrame,
    GetStats,
    Ready,
    Rejected,
    Reply,
    Shutdown,
    Stats,
    Submit,
    decode_command,
    decode_start,
    pack,
    read_frame,
)


def main() -> int:
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    lock = threading.Lock()

    def send(frame: Reply) -> None:
        with lock:
            out.write(pack(frame))

    start = read_frame(sys.stdin.buffer, decode_start)
    if start is None:
        return 0
    if envs.mock_start_fail():
        print("ERR mock engine start: asked to fail (STRATA_MOCK_START_FAIL)", file=sys.stderr,
              flush=True)
        return 2
    n_ctx, delay = start.engine["max_context"], envs.mock_token_s()
    cancelled: dict[str, threading.Event] = {}
    print(f"mock engine {envs.engine_generation()} ready", file=sys.stderr, flush=True)
    send(Ready({"architecture": "mock", "name": "mock", "n_ctx": n_ctx, "chat_template": True,
                "parallel": start.engine["parallel"]}))

    def generate(rid: str, ids: list[int], max_tokens: int) -> None:
        text = "".join(map(chr, ids))
        t0 = time.monotonic()
        for i in range(max_tokens):
            if cancelled[rid].is_set():
                send(EventFrame(rid, _event("final", finish_reason="cancelled",
                                            stats=_stats(ids, i, t0))))
                return
            if "EXIT" in text and i == 3:
                print("ERR mock: exit asked by the prompt", file=sys.stderr, flush=True)
                os._exit(3)
            time.sleep(delay)
            send(EventFrame(rid, _event("token", text=f"w{i} ", token=i)))
        send(EventFrame(rid,
                        _event("final", finish_reason="length", stats=_stats(ids, max_tokens, t0))))

    while (cmd := read_frame(sys.stdin.buffer, decode_command)) is not None:
        if isinstance(cmd, Submit):
            text = "".join(map(chr, cmd.ids))
            if "HANG" in text:
                continue
            if "DEAF" in text:
                time.sleep(3600)
            if "GRAMMAR" in text:
                send(Rejected(cmd.id, "invalid", "the json_schema cannot be compiled: mock",
                              param="response_format"))
                continue
            cancelled[cmd.id] = threading.Event()
            threading.Thread(target=generate, args=(cmd.id, cmd.ids, cmd.sampling.max_tokens),
                             daemon=True).start()
        elif isinstance(cmd, Cancel) and cmd.id in cancelled:
            cancelled[cmd.id].set()
        elif isinstance(cmd, GetStats):
            send(Stats(cmd.id, {"programs": {"built": 0, "live": 0}}))
        elif isinstance(cmd, Shutdown):
            break
    return 0


def _event(kind: str, **fields: Any) -> dict[str, Any]:
    """An engine Event (engine/request.py) as it travels: a map of its fields. The mock makes the
    map itself, so that it imports no engine (JAX would cost each start seconds); the server decodes
    it as an Event."""
    return {"kind": kind, **fields}


def _stats(ids: list[int], n: int, t0: float) -> dict:
    ms = (time.monotonic() - t0) * 1000
    return {"prompt_tokens": len(ids), "reused_tokens": 0, "generated_tokens": n, "queue_ms": 0.0,
            "prompt_ms": 0.0, "generate_ms": ms, "prompt_per_second": 0.0,
            "predicted_per_second": n / max(ms / 1000, 1e-9),
            "log_line": f"prompt {len(ids)} tokens = 0 reused + {len(ids)} read, {n} generated "
                        "(mock)"}


if __name__ == "__main__":
    sys.exit(main())
