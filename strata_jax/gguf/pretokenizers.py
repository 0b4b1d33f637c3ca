"""How byte-level BPE vocabularies split text before merging, by `tokenizer.ggml.pre` name.

A GGUF names its pre-tokenizer (`tokenizer.ggml.pre`) but does not store it. The regexes here are
the ones llama.cpp's `llm_tokenizer_bpe` applies for each name (src/llama-vocab.cpp), written in the
form of the model's own `tokenizer.json` where llama.cpp notes that it rewrote one for std::regex
(case-insensitive groups, `\\p{Lu}` classes): the `tokenizers` library (Oniguruma) takes the
original form, which is also what transformers' GGUF converter uses for the names it knows.

Each regex splits every piece left by the previous one into its matches and the text between them
(llama.cpp's `unicode_regex_split`, the `tokenizers` library's `Split(..., behavior="isolated")`).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class PreTokenizer:
    regexes: tuple[str, ...]
    # llama.cpp: a word that is itself a token is taken whole, before any merge (Llama 3, Tekken).
    ignore_merges: bool = False
    # llama.cpp's default for `tokenizer.ggml.add_bos_token` when a file does not say.
    add_bos: bool = False


_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"

_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_QWEN35 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|"
    r"'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
    r"*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_SEED_CODER = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}"
    r"| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The letters DeepSeek-LLM's tokenizer.json lists (llama.cpp copies the list). Written as escapes:
# the list holds compatibility characters (U+1FBE, U+2126, U+212A, ...) that text tools silently
# normalize away.
_DEEPSEEK_LLM_LETTERS = (  # Unicode's cased letters (Lu, Ll, Lt), as ranges
    "\u0041-\u005A\u0061-\u007A\u00B5\u00C0-\u00D6\u00D8-\u00F6\u00F8-\u01BA\u01BC-\u01BF\u01C4"
    "-\u0293\u0295-\u02AF\u0370-\u0373\u0376\u0377\u037B-\u037D\u037F\u0386\u0388-\u038A"
    "\u038C\u038E-\u03A1\u03A3-\u03F5\u03F7-\u0481\u048A-\u052F\u0531-\u0556\u10A0-\u10C5\u13A0"
    "-\u13F5\u13F8-\u13FD\u1C90-\u1CBA\u1CBD-\u1CBF\u1D00-\u1D2B\u1D6B-\u1D77\u1D79-\u1D9A\u1E00"
    "-\u1F15\u1F18-\u1F1D\u1F20-\u1F45\u1F48-\u1F4D\u1F50-\u1F57\u1F59\u1F5B\u1F5D\u1F5F-\u1F7D"
    "\u1F80-\u1FB4\u1FB6-\u1FBC\u1FBE\u1FC2-\u1FC4\u1FC6-\u1FCC\u1FD0-\u1FD3\u1FD6-\u1FDB\u1FE0"
    "-\u1FEC\u1FF2-\u1FF4\u1FF6-\u1FFC\u2102\u2107\u210A-\u2113\u2115\u2119-\u211D\u2124\u2126"
    "\u2128\u212A-\u212D\u212F-\u2134\u2139\u213C-\u213F\u2145-\u2149\u214E\u2183"
    "\u2184\u2C00-\u2C7B\u2C7E-\u2CE4\u2CEB-\u2CEE\u2CF2\u2CF3\uA640-\uA66D\uA680-\uA69B"
    "\uA722-\uA76F\uA771-\uA787\uA78B-\uA78E\uAB70-\uABBF\uFB00-\uFB06\uFB13-\uFB17\uFF21-\uFF3A"
    "\uFF41-\uFF5A\U00010400-\U0001044F\U000104B0-\U000104D3\U000104D8-\U000104FB\U00010C80"
    "-\U00010CB2\U00010CC0-\U00010CF2\U000118A0-\U000118DF\U0001E900-\U0001E943"
)

_CJK_HANGUL = "[\u4E00-\u9FA5\u0800-\u4E00\uAC00-\uD7FF]+"
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uFF0C\u3001\u0964\u06D4\u060C)]+"

_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"))
_GPT2_ONLY = PreTokenizer((_GPT2,))
_DIGITS_THEN_GPT2 = PreTokenizer((r"\p{N}", _GPT2))
_LLAMA3_SPEC = PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_LLAMA3_REGEX_ONLY = PreTokenizer((_LLAMA3,))
_QWEN2_SPEC = PreTokenizer((_QWEN2,))
_DEEPSEEK_V3 = PreTokenizer(
    (
        r"\p{N}{1,3}",
        "[\u4E00-\u9FA5\u3040-\u309F\u30A0-\u30FF]+",
        (r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"""
         r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
    )
)

PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    # GPT-2's own split. llama.cpp calls it "gpt-2"; "gpt2" is accepted as the same thing.
    **dict.fromkeys(("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion"),
                    _GPT2_ONLY),
    # Digits one by one, then GPT-2's split.
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"),
        _DIGITS_THEN_GPT2
    ),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2"),
        _LLAMA3_SPEC
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), _LLAMA3_REGEX_ONLY),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez", "hunyuan"), _QWEN2_SPEC),
    "qwen35": PreTokenizer((_QWEN35,)),
    "deepseek-llm": PreTokenizer(
        (
            "[\r\n]",
            r"\s?[" + _DEEPSEEK_LLM_LETTERS + "]+",
            "\\s?[!-/:-~\uFF01-\uFF0F\uFF1A-\uFF5E\u2018-\u201F\u3000-\u3002]+",
            r"\s+$",
            _CJK_HANGUL,
            r"\p{N}+",
        )
    ),
    "deepseek-coder": PreTokenizer(("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}")),
    **dict.fromkeys(("deepseek-v3", "hunyuan-dense"), _DEEPSEEK_V3),
    "falcon": PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **dict.fromkeys(("poro-chat", "bloom", "gpt3-finnish"), PreTokenizer((_BLOOM,))),
    "tekken": PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    **dict.fromkeys(("gpt-4o", "llama4", "minimax-m2", "kanana2"), PreTokenizer((_GPT4O,))),
    "seed-coder": PreTokenizer((_SEED_CODER,)),
}


def supported_names() -> list[str]:
    return sorted(PRE_TOKENIZERS)
