"""Grammars and JSON schemas a client sends cannot crash, stall or fail the engine (issue 32,
findings 1, 2, 5), against a real server (a process) on a tiny model.

1: a GBNF chain of ~4,500 rules (`rI ::= "x" rI+1 | "y"`, ~110 KiB: under the 128 Ki-character
   bound) overflowed llguidance's stack on the engine process's command thread: SIGSEGV, the stream
   beside it failed, the engine restarted. Now the rule bound refuses it (a 400 naming
   --max-grammar-rules and the grammar's count), the stream finishes, the engine's pid is the same
   and /faults shows no restart.
2: GBNF to Lark was quadratic in a chain's length (3,000 rules: a minute, three times a request) on
   the command thread, so every other request's prepare waited. Now it is linear, grammars compile
   on a thread of their own, and a plain request sent beside it is answered first (generous
   deadlines, no timing assertion).
5: a JSON schema whose string pattern llguidance's lexer cannot derive (`^(a{1000}){1000}$`) passed
   the check and failed mid-answer with a 500 ("lexer error: too many expressions constructed"). Now
   the check builds the request's real matcher and tries its first tokens, and each of the schema's
   patterns alone: a 400 naming response_format, at admission.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from strata_jax.serve.launch import ServerProcess

N_CTX = 512


def chain(n: int) -> str:
    """root ::= r0, then rI ::= "x" rI+1 | "y": n rules that each name the next (one chain n
    deep)."""
    return ("root ::= r0\n" + "".join(f'r{i} ::= "x" r{i + 1} | "y"\n' for i in range(n))
            + f'r{n} ::= "z"\n')


@pytest.fixture(scope="module")
def server(tiny_model):
    model = tiny_model(arch="qwen3", layers=2, hidden=64)
    args = [str(model), "--parallel", "4", "--max-context", str(N_CTX), "--model-name", "tiny",
            "--no-warmup"]
    with ServerProcess(args) as srv:
        srv.wait_up().wait_ready(timeout=300)
        yield srv


def _complete(srv, timeout: float = 120, **body) -> httpx.Response:
    return httpx.post(srv.url + "/v1/completions", timeout=timeout,
                      json={"model": "tiny", "prompt": "Hello", "max_tokens": 8, "temperature": 0,
                            **body})


def _error(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"}, err
    return err


class Stream(threading.Thread):
    """A streamed completion of `tokens` tokens (ignore_eos) running beside the test's requests."""

    def __init__(self, srv, tokens: int):
        super().__init__(daemon=True)
        self.srv, self.tokens = srv, tokens
        self.status, self.chunks, self.error = None, [], None

    def run(self) -> None:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": self.tokens,
                "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", self.srv.url + "/v1/completions", json=body,
                              timeout=300) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.chunks.append(json.loads(line[6:]))
        except Exception as e:  # noqa: BLE001 - reported by the test
            self.error = repr(e)

    def started(self, deadline: float = 120) -> None:
        """Wait until the stream has its first tokens (it is decoding when the test's request
        arrives)."""
        import time

        end = time.monotonic() + deadline
        while not self.chunks and self.is_alive() and time.monotonic() < end:
            time.sleep(0.05)
        assert self.chunks, (self.status, self.error)


def _faults(srv) -> dict:
    return httpx.get(srv.url + "/faults", timeout=10).json()


def test_a_rule_chain_deeper_than_the_bound_is_a_400_and_the_engine_lives_on(server):
    pids, before = server.engine_pids(), _faults(server)
    stream = Stream(server, 200)
    stream.start()
    stream.started()
    grammar = chain(4500)
    # under the 128 Ki-character bound: the rule bound says no
    assert 100_000 < len(grammar) < 1 << 17
    r = _complete(server, grammar=grammar)
    err = _error(r)
    assert "grammar" in err["message"] and "it has 4502 rules" in err["message"], err
    assert "--max-grammar-rules" in err["message"] and "2048" in err["message"], err
    stream.join(300)
    assert (stream.status == 200
            and stream.error is None), (stream.status, stream.error, server.log()[-3000:])
    finish = [c["choices"][0]["finish_reason"] for c in stream.chunks if c["choices"]]
    assert (finish[-1] == "length"
            and stream.chunks[-1]["usage"]["completion_tokens"] == 200), stream.chunks[-2:]
    assert server.engine_pids() == pids, server.log()[-3000:]
    after = _faults(server)
    assert (after["restarts"] == before["restarts"]
            and after["generation"] == before["generation"]), after
    assert server.health().status_code == 200


def test_a_chain_under_the_rule_bound_but_too_deep_is_a_400_naming_the_depth_bound(server):
    err = _error(_complete(server, grammar=chain(1000)))
    assert "--max-grammar-depth" in err["message"] and "256" in err["message"], err
    assert err.get("param") in (None, "grammar"), err


def test_a_long_chain_is_answered_at_once_and_other_prepares_do_not_wait(server):
    """A 3,500-rule chain (87 KiB) took 17 s to convert, three times a request, on the command
    thread, and the prepares of requests beside it waited; now the conversion is linear (a 400 at
    once) and a plain request sent beside it is answered. The deadlines are generous (CI is a loaded
    2-core machine)."""
    got: dict[str, httpx.Response] = {}

    def grammar_request():
        got["grammar"] = _complete(server, timeout=20, grammar=chain(3500))

    t = threading.Thread(target=grammar_request)
    t.start()
    plain = _complete(server, timeout=20)
    t.join(30)
    assert plain.status_code == 200, plain.text
    err = _error(got["grammar"])
    assert "it has 3502 rules" in err["message"], err


def test_a_grammar_at_the_bounds_compiles_and_is_followed(server):
    """A chain 250 deep (under the depth bound), in a grammar of 2,000 rules (under the rule bound):
    accepted, and the answer follows it, twice (the second from the compiled grammar kept)."""
    wide = "".join(f'w{i} ::= "w{i}"\n' for i in range(1749))
    grammar = chain(250).replace("root ::= r0",
                                 "root ::= r0 | " + " | ".join(f"w{i}" for i in range(1749)))
    grammar += wide
    for _ in range(2):
        r = _complete(server, grammar=grammar, max_tokens=300)
        assert r.status_code == 200, r.text
        text = r.json()["choices"][0]["text"]
        assert text.rstrip("xyz") == "" or text.startswith("w"), text


def test_a_schema_whose_lexer_cannot_be_built_is_a_400_at_admission(server):
    bad = {"type": "string", "pattern": "^(a{1000}){1000}$"}
    pids = server.engine_pids()
    # the pattern first, then behind an alternative the model could take instead (each pattern is
    # tried alone)
    for schema, stream in ((bad, False), (bad, True),
                           ({"anyOf": [{"type": "integer"}, bad]}, False)):
        fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}
        r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                             "max_tokens": 16, "response_format": fmt, "stream": stream})
        err = _error(r)
        assert "response_format" in err["message"] and "too many expressions" in err["message"], err
    # a schema it can follow still works
    ok = {"type": "json_schema",
          "json_schema": {"name": "s", "schema": {"type": "string", "pattern": "^a{3}$"}}}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}],
                         "max_tokens": 16, "response_format": ok})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == '"aaa"', r.json()
    assert server.engine_pids() == pids


# ---- in-process: the converter's output and the one compile a grammar gets -----------------------

JSON_GBNF = r'''root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::= "{" ws ( string ":" ws value ("," ws string ":" ws value)* )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
# a comment
ws ::= | " " | "\n" [ \t]{0,20}
'''


@pytest.mark.parametrize("text", [JSON_GBNF, chain(40), 'root ::= ("yes" | "no") "." [0-9]',
                                  'root ::= fooBar-baz # c\nfooBar-baz ::= "a" | "b"\n',
                                  'root ::= a{2,5} b?\na ::= "x"\nb ::= root | "q"\n'])
def test_the_linear_converter_writes_what_llguidance_s_writes(text):
    from llguidance.gbnf_to_lark import gbnf_to_lark as theirs

    from strata_jax.engine.grammar.gbnf import gbnf_to_lark

    assert gbnf_to_lark(text) == theirs(text)


def test_a_grammar_is_compiled_once_for_its_check_and_every_request(tiny_model, monkeypatch):
    from strata_jax.engine.grammar import grammar_compile
    from strata_jax.engine.grammar.constrain import Grammars
    from strata_jax.gguf import GGUFModel, load_tokenizer

    model = GGUFModel.open(tiny_model(arch="qwen3", layers=2, hidden=64))
    tk = load_tokenizer(model.metadata)
    calls = []
    real = grammar_compile.grammar_source
    monkeypatch.setattr(grammar_compile, "grammar_source",
                        lambda *a: calls.append(a[:2]) or real(*a))
    grammars = Grammars(tk, model.spec.vocab_size)
    g = ("gbnf", 'root ::= "a" [0-9]', "grammar")
    grammars.check(g)
    first, second = grammars.constraint(g), grammars.constraint(g)
    assert len(calls) == 1, calls
    assert first.matcher is not second.matcher                 # each request advances its own copy
    assert first.matcher.consume_token(tk.encode("a", add_special=False)[0])
    assert not second.matcher.is_error() and not first.matcher.is_error()
