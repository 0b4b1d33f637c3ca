"""Record a server's answers, tokens and logprobs to the last bit, so that two builds can be
compared (issue 35: "the same logits bits" before and after a restructuring).

    PYTHONPATH=<old checkout> python3 scripts/answers_bits.py MODEL.gguf /tmp/old.json
    python3 scripts/answers_bits.py MODEL.gguf /tmp/new.json --compare /tmp/old.json

Starts the server on MODEL (--parallel 2, --max-context 1024), sends each request of REQUESTS
(greedy: chat and completions, logprobs with 5 alternatives, a JSON schema, a forced tool call, a
logit bias by text, a seeded sampled one, n = 2, a long prompt) one after the other, and writes
every answer with its volatile fields (ids, times, timings) removed. --compare: exits 1 and prints
the first difference when any answer differs from the recorded file's; the logprobs are compared as
the floats JSON carries (Python reads them back exactly as they were written).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import httpx

from strata_jax.serve.launch import ServerProcess

ARGS = ["--parallel", "2", "--max-context", "1024", "--model-name", "bits"]
VOLATILE = {"id", "created", "system_fingerprint", "timings", "usage"}
HI = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

REQUESTS = [
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 24, "temperature": 0,
                              "logprobs": True, "top_logprobs": 5}),
    ("/v1/completions", {"prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0,
                         "logprobs": 5}),
    ("/v1/completions", {"prompt": "Once upon a time, " * 60, "max_tokens": 16,
                         "temperature": 0, "logprobs": 3}),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 32, "temperature": 0,
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "a", "schema": {"type": "object", "properties": {
                                      "city": {"type": "string"}}, "required": ["city"]}}}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Weather in Paris?"}],
                              "tools": [TOOL], "tool_choice": "required", "max_tokens": 40,
                              "temperature": 0}),
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
                         "logit_bias": {"1": -100}, "logprobs": 2}),
    ("/completion", {"prompt": "The capital of France is", "n_predict": 12, "temperature": 0,
                     "logit_bias": [["Paris", -100]], "n_probs": 3}),
    ("/v1/chat/completions", {"messages": HI, "max_tokens": 24, "temperature": 0.9, "seed": 7,
                              "top_p": 0.9, "n": 2, "logprobs": True, "top_logprobs": 2}),
]


def clean(value):
    """An answer without what changes from run to run."""
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [clean(v) for v in value]
    return value


def record(model: str) -> list:
    out = []
    with ServerProcess([model, *ARGS]) as srv, httpx.Client(base_url=srv.url,
                                                             timeout=300.0) as client:
        srv.wait_ready(300.0)
        for route, body in REQUESTS:
            r = client.post(route, json=body)
            out.append({"route": route, "status": r.status_code, "answer": clean(r.json())})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("out", type=Path)
    ap.add_argument("--compare", type=Path, help="an earlier build's file")
    args = ap.parse_args()
    answers = record(args.model)
    args.out.write_text(json.dumps(answers, indent=1))
    statuses = [a["status"] for a in answers]
    print(f"{len(answers)} answers, statuses {statuses}")
    if args.compare is None:
        return 0
    old = json.loads(args.compare.read_text())
    differ = [(i, o, n) for i, (o, n) in enumerate(zip(old, answers, strict=True)) if o != n]
    for i, o, n in differ[:3]:
        print(f"DIFFERS: request {i} ({REQUESTS[i][0]}):\n  before {json.dumps(o)[:600]}\n"
              f"  after  {json.dumps(n)[:600]}")
    print(f"{len(answers) - len(differ)} of {len(answers)} answers the same to the bit")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
