"""Tools the tool-calling tests share (test_structured, test_tool_formats): one with a string and an
enum, one with a bounded integer, both strict."""

WEATHER = {"type": "function",
           "function": {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object",
                          "properties": {"city": {"type": "string", "maxLength": 12},
                                                           "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object",
        "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
        "required": ["zone"], "additionalProperties": False}}}


def grammar_walk(constraint, tk, rng, prefer=None, steps: int = 400) -> tuple[list[int], bool]:
    """Random tokens among those `constraint` allows, until it is done or an end token is drawn ->
    (the tokens, whether the walk ended within `steps`). prefer (token id, p): that token with
    probability p whenever it is allowed (the harmony test keeps its analysis short so)."""
    import numpy as np

    from strata_jax.engine.grammar.constrain import fill_masks

    ids = np.arange(tk.vocab_size)
    out: list[int] = []
    for _ in range(steps):
        mask = fill_masks([constraint], 1, tk.vocab_size)[0]
        allowed = np.flatnonzero((mask[ids // 32] >> (ids % 32)) & 1)
        if prefer and prefer[0] in allowed and rng.random() < prefer[1]:
            t = prefer[0]
        else:
            t = int(rng.choice(allowed))
        if t in tk.eos_ids or constraint.done:
            return out, True
        assert constraint.advance(t) is None
        out.append(t)
    return out, False
