"""Hostile GGUF files (issue 13, item 7): arrays nested without end, counts and lengths no file can
hold, huge strings and enormous tokens are refused with an error naming the key, at once and without
building anything that big; no byte string makes the header parser raise anything but a GGUFError;
and `strata-jax serve` on such a file exits at once with one error line."""

from __future__ import annotations

import itertools
import logging
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
from gguf import GGUFValueType as T
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strata_jax.gguf import (
    GGUFError,
    GGUFModel,
    TruncatedGGUFError,
    load_tokenizer,
    read_metadata,
)
from strata_jax.gguf.bpe_models import bytes_to_unicode, sentencepiece_merges
from strata_jax.gguf.errors import HeaderLimitError
from strata_jax.gguf.header import (
    MAX_ARRAY_DEPTH,
    MAX_ARRAY_STRING_BYTES,
    MAX_METADATA_BYTES,
    MAX_STRING_BYTES,
    parse_header,
)
from strata_jax.gguf.tokenizer import Tokenizer
from strata_jax.gguf.vocab import (
    BYTE,
    CONTROL,
    MAX_SPECIAL_TOKEN_BYTES,
    MAX_SPM_MERGES,
    MAX_VOCAB_TOKENS,
    NORMAL,
    TokenizerError,
)
from strata_jax.serve.launch import ServerProcess
from strata_jax.testing.edit_gguf import rewrite_gguf

HUGE = 2**62
# every refusal is a cheap check: seconds here would mean something was built or looped over bytes
# of Python allocations a refusal may cost (the file itself is memory-mapped)
FAST_S = 3.0
SMALL_PEAK = 8 << 20


# ---- raw GGUF bytes


def u32(n: int) -> bytes:
    return struct.pack("<I", n)


def u64(n: int) -> bytes:
    return struct.pack("<Q", n)


def gstr(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return u64(len(b)) + b


def kv(key: str, vtype: T, payload: bytes) -> bytes:
    return gstr(key) + u32(vtype) + payload


def gguf(*kvs: bytes, n_kv: int | None = None, n_tensors: int = 0, tail: bytes = b"") -> bytes:
    return (b"GGUF" + u32(3) + u64(n_tensors) + u64(len(kvs) if n_kv is None else n_kv)
            + b"".join(kvs) + tail)


def nested(depth: int) -> bytes:
    """An array of one array of one ... (`depth` arrays) of one uint8."""
    return (u32(T.ARRAY) + u64(1)) * (depth - 1) + u32(T.UINT8) + u64(1) + b"\x07"


ARCH = kv("general.architecture", T.STRING, gstr("llama"))
PAD = b"\0" * 1000  # the files are about 1 KB: a claim of 2**62 of anything cannot fit

# name: (file bytes, error class, words the message must hold)
HOSTILE = {
    "nested arrays, depth 1000": (
        gguf(ARCH, kv("hostile.nested", T.ARRAY, nested(1000))), HeaderLimitError,
        ["metadata key 'hostile.nested'", f"nested more than {MAX_ARRAY_DEPTH} deep"]),
    "2**62 strings": (
        gguf(ARCH, kv("tokenizer.ggml.tokens", T.ARRAY, u32(T.STRING) + u64(HUGE) + PAD)),
        HeaderLimitError,
        ["metadata key 'tokenizer.ggml.tokens'", f"an array of {HUGE:,} items cannot fit"]),
    "2**62 numbers": (
        gguf(ARCH, kv("tokenizer.ggml.scores", T.ARRAY, u32(T.FLOAT32) + u64(HUGE) + PAD)),
        HeaderLimitError,
        ["metadata key 'tokenizer.ggml.scores'", f"an array of {HUGE:,} items cannot fit"]),
    "2**62 arrays": (
        gguf(ARCH, kv("hostile.arrays", T.ARRAY, u32(T.ARRAY) + u64(HUGE) + PAD)), HeaderLimitError,
        ["metadata key 'hostile.arrays'", f"an array of {HUGE:,} items"]),
    "a string of 2**62 bytes": (
        gguf(ARCH, kv("general.name", T.STRING, u64(HUGE) + PAD)), HeaderLimitError,
        ["metadata key 'general.name'", f"a string of {HUGE:,} bytes cannot fit"]),
    "a token of 2**62 bytes": (
        gguf(ARCH, kv("tokenizer.ggml.tokens", T.ARRAY,
                      u32(T.STRING) + u64(3) + gstr("a") + u64(HUGE) + PAD)),
        HeaderLimitError,
        ["metadata key 'tokenizer.ggml.tokens'[1]", f"a string of {HUGE:,} bytes"]),
    "a key of 2**62 bytes": (
        gguf(ARCH, u64(HUGE) + PAD), HeaderLimitError,
        ["metadata key number 2", f"a string of {HUGE:,} bytes"]),
    "2**62 keys": (gguf(ARCH, PAD, n_kv=HUGE), HeaderLimitError,
                   ["the metadata", f"{HUGE:,} keys"]),
    "2**62 tensors": (gguf(ARCH, tail=PAD, n_tensors=HUGE), HeaderLimitError,
                      ["tensor", f"{HUGE:,} tensors"]),
    "an unknown value type": (
        gguf(ARCH, kv("hostile.type", 99, PAD)), GGUFError,
        ["metadata key 'hostile.type'", "value type 99"]),
}  # fmt: skip


def _refused(call, cls, words, *, seconds=FAST_S, peak: int | None = SMALL_PEAK):
    """Run `call`, which must raise `cls` with `words` in its message, within `seconds` and `peak`
    bytes of Python allocations (peak None: not measured, where tracing every allocation would slow
    it tenfold)."""
    if peak is not None:
        tracemalloc.start()
    start = time.perf_counter()
    try:
        with pytest.raises(cls) as info:
            call()
        took = time.perf_counter() - start
        used = tracemalloc.get_traced_memory()[1] if peak is not None else 0
    finally:
        tracemalloc.stop()
    message = str(info.value)
    for word in words:
        assert word in message, message
    assert took < seconds, f"{took:.2f} s: {message}"
    assert peak is None or used < peak, f"{used:,} bytes allocated: {message}"
    return message


@pytest.fixture(scope="module")
def hostile_files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hostile")
    paths = {}
    for i, (name, (data, _, _)) in enumerate(HOSTILE.items()):
        paths[name] = root / f"hostile{i}.gguf"
        paths[name].write_bytes(data)
    return paths


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_header_is_refused_naming_the_key(name, hostile_files):
    path = hostile_files[name]
    _, cls, words = HOSTILE[name]
    message = _refused(lambda: GGUFModel.open(path), cls, [str(path), *words])
    assert "\n" not in message
    # the tokenizer reads the same header, the same way
    for read in (read_metadata, load_tokenizer):
        _refused(lambda read=read: read(path), cls, words)


def test_a_cut_array_of_plausible_size_is_a_truncated_file(tmp_path):
    path = tmp_path / "cut.gguf"
    path.write_bytes(gguf(ARCH, kv("tokenizer.ggml.tokens", T.ARRAY,
                                   u32(T.STRING) + u64(50_000) + gstr("a"))))
    _refused(lambda: GGUFModel.open(path), TruncatedGGUFError,
             ["header is cut short", "'tokenizer.ggml.tokens'", "an array of 50,000 items",
              "fetch the file again"])


@pytest.mark.parametrize("key, value", [
    ("split.count", kv("split.count", T.STRING, gstr("3"))),
    ("split.no", kv("split.no", T.ARRAY, u32(T.INT32) + u64(1) + u32(0))),
    ("general.alignment", kv("general.alignment", T.FLOAT32, struct.pack("<f", 32.0))),
])  # fmt: skip
def test_keys_the_reader_uses_with_the_wrong_type(tmp_path, key, value):
    path = tmp_path / "typed.gguf"
    path.write_bytes(gguf(ARCH, value))
    _refused(lambda: GGUFModel.open(path, strict=False), GGUFError, [str(path), key])


def test_tokenizer_values_of_the_wrong_type_are_named():
    md = _gpt2(["x"])
    md["tokenizer.ggml.token_type"] = [*md["tokenizer.ggml.token_type"][:-1], "control"]
    _refused(lambda: Tokenizer(md), TokenizerError,
             ["tokenizer.ggml.token_type[256] should be an integer", "control"])


@pytest.fixture(scope="module")
def small_model(tiny_model) -> Path:
    return tiny_model(arch="qwen3", layers=1, hidden=64)


@pytest.fixture(scope="module")
def small_model_bytes(small_model) -> tuple[bytes, int]:
    """The small model's bytes, and its header's length (where its first tensor's data starts)."""
    return (small_model.read_bytes(),
            min(t.offset for t in GGUFModel.open(small_model).tensors.values()))


def test_a_50_mb_string_in_a_valid_model(small_model, tmp_path):
    big = rewrite_gguf(small_model, tmp_path / "big.gguf",
                       set_metadata={"general.description": "x" * (50 << 20)})
    _refused(lambda: GGUFModel.open(big), HeaderLimitError,
             ["metadata key 'general.description'", f"a string of {50 << 20:,} bytes",
              f"more than the {MAX_STRING_BYTES:,}"])
    # a long string within the bound still reads
    ok = rewrite_gguf(small_model, tmp_path / "ok.gguf",
                      set_metadata={"general.description": "x" * (1 << 20)})
    assert len(GGUFModel.open(ok).metadata["general.description"]) == 1 << 20


@pytest.fixture(scope="module")
def enormous_tokens(small_model, tmp_path_factory) -> tuple[Path, dict]:
    """The small model with three of its tokens 1 MiB long, as a file, and its metadata as a
    dict."""
    metadata = dict(GGUFModel.open(small_model).metadata)
    tokens = list(metadata["tokenizer.ggml.tokens"])
    for i in (5, 6, 7):
        tokens[i] = f"{i}" + "a" * ((1 << 20) - 1)
    metadata["tokenizer.ggml.tokens"] = tokens
    path = rewrite_gguf(small_model, tmp_path_factory.mktemp("tokens") / "enormous.gguf",
                        set_metadata={"tokenizer.ggml.tokens": tokens})
    return path, metadata


def test_enormous_tokens_are_refused_naming_the_token(enormous_tokens):
    path, metadata = enormous_tokens
    words = ["'tokenizer.ggml.tokens'[5]", f"a string of {1 << 20:,} bytes",
             f"more than the {MAX_ARRAY_STRING_BYTES:,}"]
    _refused(lambda: GGUFModel.open(path), HeaderLimitError, words)
    _refused(lambda: load_tokenizer(path), HeaderLimitError, words)
    # metadata given as a dict meets the same bound in the tokenizer
    _refused(lambda: Tokenizer(metadata), TokenizerError,
             ["tokenizer.ggml.tokens[5]", f"a token of {1 << 20:,} bytes",
              f"at most {MAX_ARRAY_STRING_BYTES:,}"],
             peak=64 << 20)


def test_a_vocabulary_past_the_metadata_bound(tmp_path):
    """70,000 tokens of 1 KB (a real vocabulary's tokens are a few bytes): refused where the
    metadata passes MAX_METADATA_BYTES, having built no more than that."""
    n, size = 70_000, 1024
    tokens = b"".join(gstr(f"{i:08d}".encode() * (size // 8)) for i in range(n))
    path = tmp_path / "wide.gguf"
    path.write_bytes(gguf(ARCH,
                          kv("tokenizer.ggml.tokens", T.ARRAY, u32(T.STRING) + u64(n) + tokens)))
    _refused(lambda: load_tokenizer(path), HeaderLimitError,
             ["metadata key 'tokenizer.ggml.tokens'[", f"past {MAX_METADATA_BYTES:,} bytes"],
             peak=2 * MAX_METADATA_BYTES)


def test_a_256k_vocabulary_still_reads_fast(tmp_path):
    # the bounds are checked per array and in one tight loop per string array: real vocabularies pay
    # little
    n = 256 * 1024
    tokens = b"".join(gstr(f"\u0120tok{i}") for i in range(n))
    merges = b"".join(gstr(f"\u0120tok {i}") for i in range(n))
    path = tmp_path / "vocab.gguf"
    path.write_bytes(gguf(ARCH,
                          kv("tokenizer.ggml.tokens", T.ARRAY, u32(T.STRING) + u64(n) + tokens),
                          kv("tokenizer.ggml.merges", T.ARRAY, u32(T.STRING) + u64(n) + merges),
                          kv("tokenizer.ggml.token_type", T.ARRAY,
                             u32(T.INT32) + u64(n) + u32(1) * n)))
    metadata, took = _timed(lambda: read_metadata(path))
    assert (len(metadata["tokenizer.ggml.tokens"]) == n
            and metadata["tokenizer.ggml.merges"][-1] == f"\u0120tok {n - 1}")
    # 0.3-0.5 s here (0.75-0.9 s before the bounds: the loop is tighter now)
    assert took < FAST_S, took


# ---- the tokenizer: long tokens build in linear time; what would not is refused


def _spm(extra: list[str], kind: int = NORMAL) -> dict:
    """SentencePiece metadata: unk, bos, eos, the 256 byte pieces, a few letters, then `extra`."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), *"abcdefgh\u2581",
              *extra]
    types = [2, CONTROL, CONTROL, *[BYTE] * 256, *[NORMAL] * 9, *[kind] * len(extra)]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.scores": [-float(i) for i in range(len(tokens))]}


def _gpt2(extra: list[str], kind: int = NORMAL) -> dict:
    alphabet = list(bytes_to_unicode().values())
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "qwen2",
            "tokenizer.ggml.tokens": alphabet + extra,
            "tokenizer.ggml.token_type": [NORMAL] * 256 + [kind] * len(extra),
            "tokenizer.ggml.merges": ["a b"]}


def _timed(make):
    start = time.perf_counter()
    result = make()
    return result, time.perf_counter() - start


def test_long_sentencepiece_pieces_build_in_linear_time():
    # Cutting each of these 60,000-character pieces at every place (the obvious way to find a
    # SentencePiece vocabulary's merges) hashes 60,000 strings of 30,000 characters on average: 0.6
    # s a piece here, 15 s in all.
    long = [chr(0x400 + i) + "a" * 59_999 for i in range(25)]
    tk, took = _timed(lambda: Tokenizer(_spm(long + ["a" * k for k in range(2, 200)])))
    assert took < FAST_S, took
    assert tk.vocab_size == 268 + 25 + 198
    assert tk.decode(tk.encode("aaaa baa", add_special=False)) == "aaaa baa"


def _reference_merges(tk: Tokenizer) -> list[tuple[str, str]]:
    """SentencePiece merges the obvious way: every cut of every piece."""
    merges = []
    for i, piece in enumerate(tk.tokens):
        for cut in range(1, len(piece)) if tk.token_types[i] != BYTE else ():
            left, right = piece[:cut], piece[cut:]
            if left in tk._ids and right in tk._ids:
                merges.append((-tk.scores[i], -len(left), -len(right), tk._ids[left],
                               tk._ids[right], left, right))
    return [m[5:] for m in sorted(merges)]


def test_sentencepiece_merges_are_every_cut_into_two_pieces():
    # short pieces (found by slicing) and long ones (by chains of prefixes and suffixes), scores
    # with ties
    words = {"".join(w) for n in range(2, 6) for w in itertools.product("ab\u2581", repeat=n)}
    words |= {"a" * k for k in range(2, 150)} | {"ab" * k for k in range(2, 90)}
    words |= {"b" + "a" * k for k in range(60, 80)}
    md = _spm(sorted(words))
    md["tokenizer.ggml.scores"] = [-float(i % 7) for i in range(len(md["tokenizer.ggml.tokens"]))]
    tk = Tokenizer(md)
    merges = sentencepiece_merges(tk.tokens, tk.scores, tk.token_types, tk._ids)
    assert merges == _reference_merges(tk) and len(merges) > 10_000


def test_tokens_within_the_bound_load(caplog):
    # the byte-level vocabulary lacks some merges: warnings not needed here
    caplog.set_level(logging.ERROR)
    tokens = [f"{i:05d}" + "x" * (MAX_ARRAY_STRING_BYTES - 5) for i in range(4)]
    for make in (_gpt2, _spm):
        tk, took = _timed(lambda make=make: Tokenizer(make(tokens)))
        assert took < FAST_S and tk.token_to_id(tokens[3]) == tk.vocab_size - 1


def test_special_tokens_past_their_bound_are_refused():
    # the `tokenizers` library's matcher for tokens matched whole costs seconds a MB to build
    tokens = [f"<|{i:06d}|" + "z" * 1000 + ">" for i in range(MAX_SPECIAL_TOKEN_BYTES // 1000 + 1)]
    _refused(lambda: Tokenizer(_gpt2(tokens, kind=CONTROL)), TokenizerError,
             ["tokenizer.ggml.tokens", "CONTROL, USER_DEFINED and UNKNOWN",
              f"at most {MAX_SPECIAL_TOKEN_BYTES:,}"],
             seconds=1.0, peak=16 << 20)


def test_sentencepiece_pieces_that_make_too_many_merges_are_refused():
    # "a" * k for every k: each piece splits k - 1 ways into two pieces, 2.2M merges in all
    _refused(lambda: Tokenizer(_spm(["a" * k for k in range(2, 2100)])), TokenizerError,
             ["tokenizer.ggml.tokens", f"more than {MAX_SPM_MERGES:,} merges"], seconds=2 * FAST_S,
             peak=None)


def test_too_many_tokens_are_refused():
    tokens = [f"t{i}" for i in range(MAX_VOCAB_TOKENS + 1)]
    _refused(lambda: Tokenizer(_gpt2(tokens)), TokenizerError,
             ["tokenizer.ggml.tokens", f"{MAX_VOCAB_TOKENS + 257:,} tokens"], peak=None)


# ---- no byte string makes the parser raise anything but a GGUFError

# A header with every value type, a nested array, string arrays and a tensor entry: the seed
# mutations start from.
SEED = gguf(
    ARCH,
    kv("a.u8", T.UINT8, b"\x01"), kv("a.i16", T.INT16, b"\xff\xff"),
    kv("a.f32", T.FLOAT32, struct.pack("<f", 1.5)),
    kv("a.bool", T.BOOL, b"\x01"), kv("a.u64", T.UINT64, u64(7)),
    kv("a.f64", T.FLOAT64, struct.pack("<d", 2.5)),
    kv("a.tokens", T.ARRAY, u32(T.STRING) + u64(3) + gstr("x") + gstr("yz") + gstr("\u00e9")),
    kv("a.ids", T.ARRAY, u32(T.INT32) + u64(2) + u32(1) + u32(2)),
    kv("a.nested", T.ARRAY, u32(T.ARRAY) + u64(2) + (u32(T.UINT8) + u64(1) + b"\x05") * 2),
    n_tensors=1, tail=gstr("w") + u32(2) + u64(32) + u64(4) + u32(0) + u64(0) + b"\0" * 600,
)  # fmt: skip
_NUMBERS = st.sampled_from([0, 1, 2, 8, 9, 12, 13, 99, 1 << 31, HUGE, 2**63, 2**64 - 1])
_EDIT = st.tuples(st.integers(0, len(SEED) - 1), st.one_of(
    _NUMBERS.map(lambda n: u64(n % 2**64)), _NUMBERS.map(lambda n: u32(n % 2**32)),
    st.binary(min_size=1, max_size=4)))


def _mutate(data: bytes, edits, cut: int | None) -> bytes:
    b = bytearray(data)
    for at, new in edits:
        b[at:at + len(new)] = new
    return bytes(b[:cut] if cut is not None else b)


def _parses_or_gguf_error(data: bytes) -> None:
    try:
        parse_header(Path("fuzz.gguf"), memoryview(data))
    except GGUFError as e:
        assert "fuzz.gguf" in str(e)


def test_the_seed_parses():
    h = parse_header(Path("seed.gguf"), memoryview(SEED))
    assert h.metadata["a.tokens"] == ["x", "yz", "\u00e9"] and h.metadata["a.nested"] == [[5], [5]]
    assert [t.ne for t in h.tensors] == [(32, 4)]


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(edits=st.lists(_EDIT, max_size=4), cut=st.none() | st.integers(0, len(SEED)))
def test_mutated_headers_raise_only_gguf_errors(edits, cut):
    _parses_or_gguf_error(_mutate(SEED, edits, cut))


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(rest=st.binary(max_size=400))
def test_random_headers_raise_only_gguf_errors(rest):
    _parses_or_gguf_error(b"GGUF" + u32(3) + rest)


@settings(max_examples=80, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 2**20), _EDIT.map(lambda e: e[1])), min_size=1,
                      max_size=3),
       cut=st.none() | st.integers(0, 2**20))
def test_mutated_model_files_open_or_raise_gguf_errors(small_model_bytes, tmp_path_factory,
                                                       edits, cut):
    # the whole read (header, split checks, tensor directory, memory map), edits anywhere in the
    # header
    data, header = small_model_bytes
    edits = [(4 + at % (header - 4), new) for at, new in edits]
    path = tmp_path_factory.getbasetemp() / "mutated.gguf"
    path.write_bytes(_mutate(data, edits, None if cut is None else cut % (header + 1000)))
    try:
        GGUFModel.open(path, strict=False)
    except GGUFError as e:
        assert str(path) in str(e)


# ---- the real server: exits at once, with one error line naming the key


@pytest.mark.parametrize("name", ["nested arrays, depth 1000", "2**62 strings", "enormous tokens"])
def test_serve_exits_at_once_naming_the_key(name, hostile_files, enormous_tokens):
    path = enormous_tokens[0] if name == "enormous tokens" else hostile_files[name]
    key = "tokenizer.ggml.tokens" if name != "nested arrays, depth 1000" else "hostile.nested"
    start = time.perf_counter()
    with ServerProcess([str(path), "--parallel", "1"]) as srv:
        code = srv.proc.wait(timeout=60)
        took = time.perf_counter() - start
        log = srv.log()
    assert code != 0 and "Traceback" not in log, log
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("strata-jax serve: error: " + str(path)), log
    assert f"metadata key '{key}'" in errors[0], log
    assert took < 30, took  # no engine was started: only the interpreter's start and imports


def test_serve_exits_at_once_on_a_vocabulary_the_tokenizer_refuses(tiny_model, tmp_path_factory):
    """A header within its bounds whose vocabulary the tokenizer refuses (600 KB of control tokens):
    serve checks the tokenizer before it starts an engine, so it exits with one line instead of
    restarting engines that can never load."""
    src = tiny_model(arch="qwen3", layers=2, hidden=64)
    md = GGUFModel.open(src).metadata
    tokens, types = list(md["tokenizer.ggml.tokens"]), list(md["tokenizer.ggml.token_type"])
    for i in range(1, 301):
        tokens[i], types[i] = f"<|ctl{i}|" + "c" * 2000 + ">", 3          # CONTROL
    path = rewrite_gguf(src, tmp_path_factory.mktemp("ctl") / "ctl.gguf",
                        set_metadata={"tokenizer.ggml.tokens": tokens,
                                      "tokenizer.ggml.token_type": types})
    with ServerProcess([str(path), "--parallel", "1"]) as srv:
        code = srv.proc.wait(timeout=60)
        log = srv.log()
    assert code != 0 and "Traceback" not in log and "engine process" not in log, log
    errors = [line for line in log.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("strata-jax serve: error: "), log
    assert "control" in errors[0].lower() or "special" in errors[0].lower(), errors[0]
