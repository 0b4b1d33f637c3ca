"""CallStream's states for gpt-oss's harmony calls, as http/harmony.py hands them on (its normal
form, whatever header the model wrote):

    <|start|>assistant to=functions.get_weather<|message|>{"city": "Paris"}

The arguments are one JSON object, read as Mistral's after [ARGS] (named_calls.py). gpt-oss writes
one call an answer (`<|call|>` ends it)."""

from __future__ import annotations

from .marks import H_MESSAGE


class HarmonyCalls:
    """A part of CallStream (the attributes these states read and set are CallStream's)."""

    def _harmony_name(self, final: bool) -> bool:
        """After the call's mark: the tool's name, then <|message|>."""
        rest = self.rest
        j = rest.find(H_MESSAGE)
        if j < 0:
            return self._fail() if final or len(rest) > 256 else False
        name = rest[:j].strip()
        if name not in self.fns:
            return self._fail()
        self.i += j + len(H_MESSAGE)
        self._begin(name)
        self.state = "mistral_args"
        return True
