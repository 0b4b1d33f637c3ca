"""The prefix cache (a slot keeps its KV after its request) and the conversation cache (evicted
conversations' KV in host RAM, in blocks keyed by their exact token prefix), issue 8.

What would catch llama.cpp's issue 27148 (an unrelated conversation's KV restored): the block lookup
is checked alone with a hash under which every block collides, and 16 concurrent conversations on 3
slots with a small host cache (so slots are overwritten, stored, evicted and restored all the time)
must each get, turn after turn, exactly the answer an engine without any cache gives, with every
restore checked against the request's prompt as it happens."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from strata_jax import Engine, EngineConfig
from strata_jax.engine.schedule.conversation_cache import ConversationCache
from strata_jax.serve.launch import ServerProcess

MOE = {"arch": "qwen3moe", "layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "experts": 8,
       "experts_used": 2, "expert_ffn": 32}
# conversation-cache blocks of 16 tokens (prefix_cache.block_tokens)
CTX = 256


def _rand(rng, n):
    return [int(t) for t in rng.integers(3, 500, n)]


# ---- the block store alone (no model) ------------------------------------------------------------

def _fake_kv(tokens, B):
    """A block's 'KV' that names its tokens, so a wrong restore shows in the values."""
    return lambda i: {"k": np.asarray(tokens[i * B:(i + 1) * B], np.float32)[None, :, None]}


def test_blocks_match_only_the_exact_prefix_even_when_every_hash_collides():
    cc = ConversationCache(block=4, max_bytes=1 << 20, max_conversations=0,
                           key_fn=lambda parent, toks: b"same")
    rng = np.random.default_rng(1)
    system = _rand(rng, 8)
    a = system + _rand(rng, 8)
    b = system + a[8:12] + _rand(rng, 4)            # shares a's first 3 blocks, differs in the 4th
    c = _rand(rng, 16)                               # nothing in common
    for toks in (a, b, c):
        cc.store(toks, _fake_kv(toks, 4))
    assert cc.stats()["blocks"] == 4 + 1 + 4         # b's shared blocks are stored once
    for toks in (a, b, c, system + _rand(rng, 8), a[:12] + _rand(rng, 4)):
        got = cc.match(toks, len(toks))
        want = {id(x) for x in got}
        assert len(want) == len(got)
        flat = np.concatenate([blk.tokens for blk in got]) if got else np.zeros(0, np.int32)
        # never another conversation's tokens
        assert flat.tolist() == toks[:len(flat)]
        for blk in got:
            assert blk.kv["k"][0, :, 0].tolist() == blk.tokens.tolist()
    assert len(cc.match(a, 16)) == 4 and len(cc.match(b, 16)) == 4 and len(cc.match(c, 16)) == 4
    assert len(cc.match(system + _rand(rng, 8), 16)) == 2
    # never past the limit (the last prompt token is read)
    assert len(cc.match(a, 15)) == 3


def test_bounds_evict_least_recent_conversations_and_keep_shared_blocks():
    # a block: 4 float32 values + its 4 int32 tokens
    nbytes = 4 * 4 + 4 * 4
    cc = ConversationCache(block=4, max_bytes=10 * nbytes, max_conversations=3)
    rng = np.random.default_rng(2)
    system = _rand(rng, 8)
    convs = [system + _rand(rng, 8) for _ in range(5)]
    cc.store(convs[0], _fake_kv(convs[0], 4))
    cc.store(convs[1], _fake_kv(convs[1], 4))
    assert cc.bytes == 6 * nbytes and cc.stats()["conversations"] == 2
    # a later turn of conversation 0 replaces its entry
    longer = convs[0] + _rand(rng, 4)
    cc.store(longer, _fake_kv(longer, 4))
    assert cc.stats()["conversations"] == 2 and cc.bytes == 7 * nbytes
    cc.store(convs[2], _fake_kv(convs[2], 4))         # 9 blocks
    # over both bounds: conversation 1 (least recent) goes
    cc.store(convs[3], _fake_kv(convs[3], 4))
    assert cc.stats()["conversations"] == 3 and cc.bytes <= 10 * nbytes
    # its own blocks are gone, the shared system prompt stays
    assert len(cc.match(convs[1], 16)) == 2
    assert len(cc.match(longer, 20)) == 5 and len(cc.match(convs[3], 16)) == 4
    cc.touch(cc.match(longer, 20))                    # a restore makes it the most recent
    cc.store(convs[4], _fake_kv(convs[4], 4))
    assert len(cc.match(longer, 20)) == 5 and len(cc.match(convs[2], 16)) == 2
    st = cc.stats()
    assert st["evicted_blocks"] >= 4 and st["bytes"] <= 10 * nbytes and st["conversations"] <= 3
    # larger than the whole cache: its prefix that fits
    huge = _rand(rng, 80)
    cc.store(huge, _fake_kv(huge, 4))
    assert cc.bytes <= 10 * nbytes and len(cc.match(huge, 80)) == 10


# ---- the engine ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def moe_path(tiny_model):
    return tiny_model(**MOE)


@pytest.fixture(scope="module")
def scratch(moe_path):
    """An engine with no prefix cache: every prompt read from its first token."""
    eng = Engine.from_gguf(moe_path, EngineConfig(parallel=2, max_context=CTX, prefill=16,
                                                  prefix_cache=False))
    yield eng
    eng.close()


def _answers(eng, prompts, n=6):
    handles = [eng.submit(p, max_tokens=n, ignore_eos=True) for p in prompts]
    return [[ev.token for ev in h if ev.kind == "token"] for h in handles]


def test_second_turn_reads_only_its_new_tokens(moe_path, scratch):
    eng = Engine.from_gguf(moe_path, EngineConfig(parallel=2, max_context=CTX, prefill=16,
                                                  conversation_cache_mib=1))
    try:
        rng = np.random.default_rng(3)
        p1 = _rand(rng, 37)
        a1 = eng.generate(p1, max_tokens=6, ignore_eos=True)
        assert a1.stats["reused_tokens"] == 0
        p2 = p1 + a1.tokens + _rand(rng, 21)
        a2 = eng.generate(p2, max_tokens=6, ignore_eos=True)
        # the slot holds p1 and the answer but its last token (which was never fed back)
        assert a2.stats["reused_tokens"] == len(p1) + len(a1.tokens) - 1
        assert "prompt 64 tokens = 42 reused + 22 read" in a2.stats["log_line"]
        assert a2.tokens == scratch.generate(p2, max_tokens=6, ignore_eos=True).tokens

        # logits of the tokens a second turn reads, against reading the whole prompt from scratch
        q1 = _rand(rng, 30)
        b1 = eng.generate(q1, max_tokens=5, ignore_eos=True)
        q2 = q1 + b1.tokens + _rand(rng, 25)
        n, got = eng.logits_reusing(q2)
        assert n == len(q1) + len(b1.tokens) - 1 and got.shape[0] == len(q2) - n
        want = eng.logits(q2)[n:]
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()
        assert (got.argmax(-1) == want.argmax(-1)).all()

        # a conversation pushed out of both slots comes back from host RAM
        r1 = _rand(rng, 40)
        c1 = eng.generate(r1, max_tokens=6, ignore_eos=True)
        for _ in range(2):                            # two unrelated requests take both slots
            eng.generate(_rand(rng, 20), max_tokens=2, ignore_eos=True)
        r2 = r1 + c1.tokens + _rand(rng, 9)
        c2 = eng.generate(r2, max_tokens=6, ignore_eos=True)
        assert c2.stats["reused_tokens"] == 32        # whole 16-token blocks of r1 + its answer
        assert c2.tokens == scratch.generate(r2, max_tokens=6, ignore_eos=True).tokens
        st = eng.stats()["prefix_cache"]
        assert st["slot_hits"] >= 2 and st["conversation_cache"]["hits"] >= 1
        assert (st["conversation_cache"]["restored_tokens"] >= 32
                and st["conversation_cache"]["stored_blocks"] >= 3)
    finally:
        eng.close()


def _conversations(rng, n=16):
    """First-turn prompts: one shared system prompt (2 blocks), then pairs that share a long part (3
    more blocks) and differ after it, so the hash chains of their shorter prefixes agree."""
    system = _rand(rng, 32)
    out = []
    for i in range(0, n, 2):
        shared = _rand(rng, 48)
        out += [system + shared + _rand(rng, 5 + i), system + shared + _rand(rng, 9 + i)]
    return out


def test_sixteen_conversations_never_get_another_ones_prefix(moe_path):
    """16 conversations x 3 turns, 6 of them going on at any time, on 3 slots, int8 KV (its scales
    travel too), a host cache of 8 conversations and 0.1 MiB (about 5 conversations' worth: it
    evicts), and a hash under which every block collides: every answer equals the answer without any
    cache."""
    cfg = {"parallel": 3, "max_context": CTX, "prefill": 16, "kv": "int8"}
    eng = Engine.from_gguf(moe_path, EngineConfig(**cfg, conversation_cache_mib=0.1,
                                                  conversation_cache_slots=8))
    eng.prefix.host.key_fn = lambda parent, toks: b"collide"
    restores, lock = [], threading.Lock()

    def check(prompt, restored):
        with lock:
            restores.append((len(prompt), len(restored)))
        # (the engine checks it too, and raises)
        assert restored.tolist() == prompt[:len(restored)]
    eng.prefix.on_restore = check
    rng = np.random.default_rng(4)
    firsts = _conversations(rng)
    news = [[_rand(rng, 3 + (i + t) % 7) for t in range(2)] for i in range(16)]
    record: list[list[tuple[list[int], list[int]]]] = [[] for _ in range(16)]

    going_on = threading.Semaphore(6)

    def talk(i):
        with going_on:
            prompt = firsts[i]
            for t in range(3):
                answer = eng.generate(prompt, max_tokens=4, ignore_eos=True).tokens
                record[i].append((prompt, answer))
                if t < 2:
                    prompt = prompt + answer + news[i][t]
    try:
        threads = [threading.Thread(target=talk, args=(i,)) for i in range(16)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        st = eng.stats()["prefix_cache"]
    finally:
        eng.close()
    assert all(len(r) == 3 for r in record)
    cc = st["conversation_cache"]
    assert restores and cc["hits"] == len(restores) and cc["evicted_blocks"] > 0
    assert (cc["bytes"] <= 0.1 * 2**20 and cc["conversations"] <= 8
            and cc["evicted_conversations"] > 0)
    assert st["slot_hits"] > 0
    scratch = Engine.from_gguf(moe_path, EngineConfig(**cfg, prefix_cache=False))
    try:
        pairs = [pa for r in record for pa in r]
        assert _answers(scratch, [p for p, _ in pairs], n=4) == [a for _, a in pairs]
    finally:
        scratch.close()


def test_server_reports_cache_n_for_a_second_turn(tiny_model):
    import httpx

    path = tiny_model(arch="qwen3", layers=2, hidden=64)
    args = [str(path), "--parallel", "2", "--max-context", "256", "--conversation-cache-mib", "4",
            "--conversation-cache-slots", "4", "--prefill", "16"]
    with ServerProcess(args) as srv:
        srv.wait_ready()
        msgs = [{"role": "user", "content": "Tell me about the sea and the mountains."}]

        def chat(messages):
            r = httpx.post(srv.url + "/v1/chat/completions",
                           json={"messages": messages, "max_tokens": 6,
                                                                    "temperature": 0}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()
        first = chat(msgs)
        assert first["timings"]["cache_n"] == 0
        msgs += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And the rivers?"}]
        second = chat(msgs)
        t = second["timings"]
        assert t["cache_n"] >= first["usage"]["prompt_tokens"] - 1
        assert t["cache_n"] + t["prompt_n"] == second["usage"]["prompt_tokens"]
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == t["cache_n"]
        assert f"= {t['cache_n']} reused + {t['prompt_n']} read" in srv.log()
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
                  if line.startswith(("strata_prefix_cache_", "strata_conversation_cache_"))}
        assert values["strata_prefix_cache_slot_hits"] >= 1
        assert values["strata_prefix_cache_slot_reused_tokens"] >= t["cache_n"]
        assert values["strata_conversation_cache_max_bytes"] == 4 * 2**20
