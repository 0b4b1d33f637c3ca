"""A request's reasoning section, followed token by token: how many tokens it has thought, and,
with a budget, its end forced once the budget is spent (issue 38: vLLM's `thinking_token_budget`,
llama.cpp's `--reasoning-budget`, Anthropic's `thinking.budget_tokens`).

The server gives the engine the section's marks as token ids (SamplingParams.reasoning_open /
reasoning_close: `<think>` and `</think>` in the model's vocabulary) and whether the prompt already
opened it (a Qwen3-style generation prompt ends with `<think>`). Otherwise a section opens when the
answer's first tokens are the open mark. Inside, every token counts as a reasoning token until the
close mark appears (or one of the single tokens that also end it: a tool call's mark, `<tool_call>`,
which the server's reasoning parser also reads as the end: a call is never reasoning); with a
budget of N, the token after the N-th is the close mark's first token
whatever the model sampled, then its next ones, and the answer follows. Forcing a token is choosing
it at that position: the window's logits there were computed, only the choice differs, so the KV the
next window writes is the forced token's (Output.emit commits it; a verify window's later accepted
drafts are dropped, as they followed the token that was not kept).
"""

from __future__ import annotations


class Thinking:
    def __init__(self, open_ids: tuple[int, ...], close_ids: tuple[int, ...], inside: bool,
                 budget: int = -1, ends: tuple[int, ...] = ()):
        self.open_ids, self.close_ids, self.ends = tuple(open_ids), tuple(close_ids), set(ends)
        self.inside = inside
        self.budget = budget                    # -1: no limit
        self.tokens = 0                         # reasoning tokens so far (not the marks)
        # the answer's first tokens, while they may open it (None: they cannot, or no longer: a
        # section opened by the prompt, or closed, is not opened again by a later <think>)
        self._seen: list[int] | None = None if inside else []
        self._closing: list[int] = []           # the tail that may be the close mark

    @classmethod
    def of(cls, params) -> Thinking | None:
        """The tracker a request's SamplingParams ask for, or None (no marks given)."""
        if not params.reasoning_close:
            return None
        return cls(params.reasoning_open, params.reasoning_close, params.reasoning_inside,
                   params.reasoning_budget, params.reasoning_ends)

    def choose(self, sampled: int) -> int:
        """The token to commit at this position: the sampled one, or the close mark's next token
        once the budget is spent."""
        if self.forcing:
            return self.close_ids[len(self._closing)]
        return sampled

    def commit(self, token: int) -> None:
        """A token joined the answer (after choose)."""
        if self.inside:
            self._inside(token)
        elif self._seen is not None:
            self._seen.append(token)
            n = len(self._seen)
            if tuple(self._seen) == self.open_ids[:n]:
                if n == len(self.open_ids):
                    self.inside, self._seen = True, None
            else:
                self._seen = None               # the answer began without the open mark

    def _inside(self, token: int) -> None:
        if token in self.ends and not self._closing:
            self.inside = False
            return
        self._closing.append(token)
        n = len(self._closing)
        if tuple(self._closing) == self.close_ids[:n]:
            if n == len(self.close_ids):
                self.inside, self._closing = False, []
            return
        # not the close mark after all: those tokens were thinking (this one may start it anew)
        restart = token == self.close_ids[0]
        self.tokens += n - restart
        self._closing = [token] if restart else []

    @property
    def forcing(self) -> bool:
        """The next token is forced: inside the section with the budget spent (a close mark's
        tokens already begun count toward it: they are kept, and the rest of the mark follows)."""
        return (self.inside and self.budget >= 0
                and self.tokens + len(self._closing) >= self.budget)
