"""Every route fuzzed from the server's own OpenAPI document (issue 32: "widen the net", as vLLM
does with schemathesis): GET /openapi.json (serve/openapi.py) describes each route's request body,
schemathesis generates requests from it (valid ones and ones that break the schema: wrong types,
missing fields, odd strings, huge numbers) and sends them to one real server process. No answer may
be a 500; another 5xx only as one of the server's deliberate answers in OpenAI's error shape (501: a
feature this server was started without; 503 with Retry-After: load shedding). Afterwards an
ordinary request is served and the engine never restarted.

The server runs with an API key (sent with every case), --props, --slot-save-path and
--expert-profile-dir in a temporary folder. /cors-proxy stays off (--ui-mcp-proxy would make the
server fetch the generated URLs: a fuzzer must not send traffic beyond this machine), so it is
fuzzed as the refusal it is.

STRATA_OPENAPI_FUZZ_EXAMPLES (default 12 a route, the bounded CI run) sets hypothesis' examples a
route, STRATA_OPENAPI_FUZZ_ONLY a regular expression of the paths to fuzz (and
STRATA_OPENAPI_FUZZ_PATHS how many paths that run must reach); the summary
(routes, cases tried, answers by status) is printed (`pytest -s`) and written to
$TMPDIR/strata-jax-openapi-fuzz.json, which docs/BENCHMARKS.md quotes for the long run.
"""

from __future__ import annotations

import collections
import json
import os
import tempfile
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from strata_jax.serve.launch import ServerProcess

KEY = "fuzz-key"
EXAMPLES = int(os.environ.get("STRATA_OPENAPI_FUZZ_EXAMPLES", "12"))
# a long run of some routes: a regular expression of their paths (e.g. "^/v1/(messages|responses)"),
# and how many paths it must reach (all of them by default)
ONLY = os.environ.get("STRATA_OPENAPI_FUZZ_ONLY")
MIN_PATHS = int(os.environ.get("STRATA_OPENAPI_FUZZ_PATHS", "24"))
SUMMARY = Path(tempfile.gettempdir()) / "strata-jax-openapi-fuzz.json"
DELIBERATE_5XX = {501, 503}
seen: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
# route -> 4xx reasons
refusals: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("openapi-fuzz")
    model = tiny_model(arch="qwen3", layers=2, hidden=64)
    args = [str(model), "--parallel", "2", "--max-context", "256", "--no-warmup", "--api-key", KEY,
            "--props",
            "--slot-save-path", str(root / "slots"), "--expert-profile-dir", str(root / "profiles")]
    with ServerProcess(args) as srv:
        srv.api_key = KEY
        srv.wait_ready()
        yield srv


@pytest.fixture(scope="module")
def api_schema(server):
    document = httpx.get(server.url + "/openapi.json", headers=server.headers, timeout=30).json()
    schema = schemathesis.openapi.from_dict(document)
    # the document says "/": calls go to this server
    schema.config.update(base_url=server.url)
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")
if ONLY:
    schema = schema.include(path_regex=ONLY)


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, print_blob=True,
          suppress_health_check=list(HealthCheck))
def test_no_route_answers_a_server_error(case, server):
    response = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=120)
    # "POST /tokenize": the document's operation (the coverage phase also tries other methods on it)
    route = case.operation.label
    seen[route][response.status_code] += 1
    where = f"{route} -> {response.status_code}: {response.text[:300]}\n{case.as_curl_command()}"
    assert response.status_code < 500 or response.status_code in DELIBERATE_5XX, where
    if response.status_code >= 400:
        error = response.json()["error"]               # OpenAI's shape, whatever refused it
        if case.path.startswith("/v1/messages"):       # Anthropic's there
            assert response.json()["type"] == "error" and {"message", "type"} <= set(error), where
        else:
            assert {"message", "type", "code"} <= set(error), where
        refusals[route][str(error.get("param") or error["message"][:60])] += 1
    if response.status_code == 503 and case.path != "/health":
        assert "retry-after" in {k.lower() for k in response.headers}, where


def test_the_server_serves_after_the_fuzzing_and_never_restarted(server):
    routes = sorted(seen)
    tried = sum(sum(c.values()) for c in seen.values())
    statuses = collections.Counter()
    for counts in seen.values():
        statuses.update(counts)
    summary = {"operations": len(routes), "paths": len({r.split(" ", 1)[1] for r in routes}),
               "cases": tried,
               "examples_a_route": EXAMPLES, "statuses": dict(sorted(statuses.items())),
               "by_route": {r: dict(seen[r]) for r in routes},
               "refused_for": {r: dict(refusals[r].most_common(8)) for r in routes}}
    SUMMARY.write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: summary[k] for k in ("operations", "paths", "cases", "statuses")}))
    # every route was reached
    assert summary["paths"] >= MIN_PATHS and tried >= MIN_PATHS * min(EXAMPLES, 5), summary
    assert 500 not in statuses, summary
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, timeout=120,
                   json={"prompt": "hello", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, r.text
    faults = httpx.get(server.url + "/faults", headers=server.headers, timeout=30).json()
    assert faults["generation"] == 1 and faults["restarts"] == 0, faults
