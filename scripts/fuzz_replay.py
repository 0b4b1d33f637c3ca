"""Send a fuzz corpus again to this build of the server and compare each answer's status with the
recorded one.

    STRATA_FUZZ_CORPUS=/tmp/before.jsonl python3 -m pytest -q tests/test_fuzz.py    # on the old
        build: record
    python3 scripts/fuzz_replay.py /tmp/before.jsonl                                  # on the new
        one: replay

The server is started as tests/test_fuzz.py's fixture starts it (the same tiny qwen3, made by
make-model with the same options, --parallel 2, --max-context 256), so a body gets the same answer
from the same code. Each body is sent as recorded (route, Content-Type, bytes) one after the other;
a body that got a 200 must get a 200, a 400 a 400, and so on. Prints the counts by status and every
difference; exits 1 when there is one.
"""

from __future__ import annotations

import argparse
import base64
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from strata_jax.makers.make_model import make_model
from strata_jax.serve.launch import ServerProcess

MODEL = {"arch": "qwen3", "layers": 2, "hidden": 64}     # tests/test_fuzz.py's server fixture
ARGS = ["--parallel", "2", "--max-context", "256", "--model-name", "fuzz"]


def replay(corpus: Path, url: str) -> tuple[collections.Counter, list[str]]:
    by_status: collections.Counter = collections.Counter()
    differences = []
    with httpx.Client(base_url=url, timeout=httpx.Timeout(60.0, connect=5.0)) as client:
        for n, line in enumerate(corpus.read_text().splitlines(), 1):
            case = json.loads(line)
            data = base64.b64decode(case["body"])
            headers = {"Content-Type": case["content_type"]} if case["content_type"] else {}
            try:
                with client.stream("POST", case["route"], content=data, headers=headers) as r:
                    r.read()
                status = r.status_code
            except httpx.HTTPError as e:
                status = f"no answer ({type(e).__name__})"
            by_status[status] += 1
            if status != case["status"]:
                differences.append(f"body {n} to {case['route']} ({len(data)} bytes: "
                                   f"{data[:80]!r}): recorded {case['status']}, now {status}")
    return by_status, differences


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", type=Path,
                    help="JSON lines written with STRATA_FUZZ_CORPUS by tests/test_fuzz.py")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "model.gguf", **MODEL)[0]
        with ServerProcess([str(model), *ARGS]) as srv:
            srv.wait_ready()
            t0 = time.monotonic()
            by_status, differences = replay(args.corpus, srv.url)
    total = sum(by_status.values())
    print(f"{total} bodies replayed in {time.monotonic() - t0:.0f} s; by status "
          f"{dict(sorted(by_status.items(), key=str))}; {len(differences)} answers differ from the "
          "recorded ones")
    for d in differences[:50]:
        print("DIFFERS", d)
    return 1 if differences else 0


if __name__ == "__main__":
    sys.exit(main())
