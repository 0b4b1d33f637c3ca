"""Time to first token of a conversation's second turn: read from scratch, reused from the slot
(prefix cache), and restored from host RAM (conversation cache, after an unrelated request took the
slot).

    python scripts/bench_prefix.py [MODEL.gguf] [--first-tokens 1500] [--repeats 3] [--prefill auto]

With no MODEL, SmolLM2-135M-Instruct (strata_jax.fetch). One engine, one slot: the first round
builds every program (not timed); each repeat then starts two new conversations (other words), so no
turn is ever reused from an earlier one. Prints a markdown table and the greedy-token check (turn 2
gives the same tokens in the three cases).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from strata_jax import Engine, EngineConfig

WORDS = [
    "river", "mountain", "lantern", "copper", "harbor", "meadow", "signal", "orchard", "thunder",
    "velvet", "quarry", "marble", "compass", "ember", "falcon", "glacier", "hollow", "ivory",
    "jasper", "kettle", "lagoon", "mosaic", "nectar", "oasis", "pebble"
]


def first_turn(eng: Engine, n_tokens: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    words: list[str] = []
    msgs: list[dict] = []
    while True:
        words += [str(w) for w in rng.choice(WORDS, 50)] + ["."]
        msgs = [{"role": "system", "content": "You are a careful assistant."},
                {"role": "user",
                 "content": "Here are my notes: " + " ".join(words) + "\nSummarise them."}]
        if len(eng.prompt_ids(msgs)) >= n_tokens:
            return msgs


def ttft(eng: Engine, msgs: list[dict], max_tokens: int) -> tuple[float, list[int], str, dict]:
    t0 = time.perf_counter()
    first, toks, text, stats = None, [], [], {}
    for ev in eng.stream(msgs, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        if ev.kind == "token":
            first = first or time.perf_counter()
            toks.append(ev.token)
            text.append(ev.text)
        elif ev.kind == "final":
            text.append(ev.text)
            stats = ev.stats or {}
    return (first - t0) * 1000, toks, "".join(text), stats


def check_logits(eng: Engine, a) -> None:
    """Logits of the tokens a second turn reads through the prefix cache (eng.logits_reusing)
    against the same positions read from scratch (eng.logits, on a scratch cache)."""
    msgs = first_turn(eng, a.first_tokens, seed=99)
    _, _, answer, _ = ttft(eng, msgs, a.answer_tokens)
    second = msgs + [{"role": "assistant", "content": answer},
                     {"role": "user",
                      "content": "Thanks. Now list the three words that come up most."}]
    ids = eng.prompt_ids(second)
    n, got = eng.logits_reusing(ids)
    want = eng.logits(ids)[n:]
    diff = np.abs(got - want)
    print(f"second turn {len(ids)} tokens = {n} reused + {len(ids) - n} read: max |logit "
          f"difference| {diff.max():.3g} (largest |logit| {np.abs(want).max():.3g}), bits equal: "
          f"{np.array_equal(got, want)}, argmax equal at "
          f"{int((got.argmax(-1) == want.argmax(-1)).sum())} of {len(got)} positions")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--first-tokens", type=int, default=1500)
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill", default="auto")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--check-logits", action="store_true",
                    help="instead: compare a second turn's logits through the prefix cache with "
                         "reading it all")
    a = ap.parse_args()
    if a.model is None:
        from strata_jax.fetch import smollm2_path
        a.model = str(smollm2_path())
    eng = Engine.from_gguf(a.model,
                           EngineConfig(parallel=1, max_context=a.max_context, prefill=a.prefill,
                                                 conversation_cache_mib=1024,
                                                 conversation_cache_slots=4))
    if a.check_logits:
        try:
            check_logits(eng, a)
        finally:
            eng.close()
        return
    rows: dict[str, list[float]] = {"scratch": [], "slot": [], "host": []}
    reused: dict[str, int] = {}
    same = True
    try:
        for r in range(a.repeats + 1):
            turns = {}
            for name in ("slot", "host"):                               # two new conversations
                msgs = first_turn(eng, a.first_tokens, seed=2 * r + (name == "host"))
                _, _, answer, _ = ttft(eng, msgs, a.answer_tokens)
                second = msgs + [{"role": "assistant", "content": answer},
                                 {"role": "user",
                                  "content": "Thanks. Now list the three words that come up most."}]
                # an unrelated request takes the slot
                if name == "host":
                    ttft(eng, first_turn(eng, 300, seed=1000 + r), 4)
                t, toks, _, st = ttft(eng, second, 8)
                turns[name] = (second, toks)
                if r:
                    rows[name].append(t)
                    reused[name] = st["reused_tokens"]
                    reused["prompt"] = st["prompt_tokens"]
            # the same second turns from scratch
            eng.prefix.enabled = False
            for name, (second, toks) in turns.items():
                t, want, _, _ = ttft(eng, second, 8)
                same &= toks == want
                if r and name == "slot":
                    rows["scratch"].append(t)
            eng.prefix.enabled = True
    finally:
        eng.close()
    print(f"# {a.model.split('/')[-1]}, {platform.machine()}, prefill "
          f"{eng.runner.choices['prefill']}, median of {a.repeats}; second turn: "
          f"{reused['prompt']} prompt tokens")
    print("| second turn | reused tokens | time to first token (ms) | vs scratch |")
    print("| --- | ---: | ---: | ---: |")
    base = statistics.median(rows["scratch"])
    for name, label, n in (("scratch", "read from scratch (--no-prefix-cache)", 0),
                           ("slot", "prefix cache: the slot kept it", reused["slot"]),
                           ("host", "conversation cache: restored from host RAM", reused["host"])):
        m = statistics.median(rows[name])
        print(f"| {label} | {n} | {m:.0f} | {base / m:.1f}x |")
    print(f"greedy tokens of turn 2 the same in all three: {same}")


if __name__ == "__main__":
    main()
