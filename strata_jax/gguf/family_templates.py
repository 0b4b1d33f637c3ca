"""Model families' own chat templates, kept in the package (gguf/templates/*.jinja) so a maker can
write one into a GGUF (`tokenizer.chat_template`) and tests can serve a made model in the family's
chat format; `family_template(name)` reads one.

- "gpt-oss": OpenAI's gpt-oss-20b / -120b (Apache-2.0); speaks harmony.
- "deepseek-r1": DeepSeek-R1-Distill-Qwen-32B's (MIT), with V3's and R1's call form; deepseek_v3.
- "deepseek-v3.1": DeepSeek-V3.1's (MIT); deepseek_v31.

Each file is byte for byte the copy that llama.cpp keeps in models/templates/ (MIT; fetched from the
models' Hugging Face repositories by its scripts/get_chat_template.py; here from the llama.cpp that
llama-cpp-python 0.3.36 vendors): openai-gpt-oss-120b.jinja, deepseek-ai-DeepSeek-R1-Distill-Qwen-
32B.jinja, deepseek-ai-DeepSeek-V3.1.jinja. The DeepSeek ones render calls and tool results but not
the tools themselves: the server describes them in a system message (serve/tools.py), as llama.cpp
does.
"""

from __future__ import annotations

from importlib import resources

FAMILY_TEMPLATES = {"gpt-oss": "gpt-oss.jinja", "deepseek-r1": "deepseek-r1.jinja",
                    "deepseek-v3.1": "deepseek-v3.1.jinja"}


def family_template(name: str) -> str:
    """The template's Jinja source; KeyError naming the ones there are."""
    if name not in FAMILY_TEMPLATES:
        raise KeyError(f"no family template {name!r}; there are {', '.join(FAMILY_TEMPLATES)}")
    return (resources.files("strata_jax.gguf") / "templates" / FAMILY_TEMPLATES[name]).read_text(
        encoding="utf-8")
