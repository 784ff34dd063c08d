"""Output processing after a step: append each request's new tokens, apply its stop rules (stop
tokens, max tokens, stop strings, the context's end) and say what the step gave it (a StepOutput).

Stop strings are found incrementally (StopStringMatcher), so checking them costs the same per token
at any output length."""

from __future__ import annotations

import time

from .request import RequestState, StepOutput


class IncrementalText:
    """The text of a growing list of token ids, decoded one token at a time with only the tokens since
    the last complete character as context (vLLM's incremental detokenization): the window is decoded
    with and without the new token and the difference is the new text, so a tokenizer's leading-space
    rules cancel out. A token that ends inside a multi-byte character (or a skipped special token) adds
    no text until the character completes. The cost per token does not grow with the text."""

    def __init__(self, decode):
        self.decode = decode
        self.text = ""  # the text of ids[:read]
        self.prefix = 0  # ids[prefix:read] is the context the next token is decoded with
        self.read = 0

    def read_one(self, ids: list[int], end: int | None = None) -> str | None:
        """Read the tokens up to ids[read + k] for the smallest k that completes text; the new text, or
        None when every token before `end` (default: all) is still pending."""
        for j in range(self.read, len(ids) if end is None else end):
            before = self.decode(ids[self.prefix : self.read], skip_special_tokens=True)
            window = self.decode(ids[self.prefix : j + 1], skip_special_tokens=True)
            if len(window) > len(before) and not window.endswith("\ufffd"):
                new = window[len(before) :]
                self.text += new
                self.prefix, self.read = self.read, j + 1
                return new
        return None


class StopStringMatcher:
    """A request's output text, grown token by token (IncrementalText), and the first stop string in it,
    searched in the new text plus the longest stop string's length of text before it."""

    def __init__(self, decode, stop_strings: tuple[str, ...]):
        self.text = IncrementalText(decode)
        self.stops = stop_strings
        self.longest = max(len(s) for s in stop_strings)

    def add(self, output: list[int], upto: int) -> str | None:
        """Read output[:upto]; at the first stop string, return the text before it (the tokens after
        the one that completed it are not read)."""
        while self.text.read < upto:
            searched_from = max(0, len(self.text.text) - self.longest + 1)
            if self.text.read_one(output, upto) is None:
                return None
            hits = [p for p in (self.text.text.find(s, searched_from) for s in self.stops) if p >= 0]
            if hits:
                return self.text.text[: min(hits)]
        return None

    @property
    def tokens_read(self) -> int:
        return self.text.read


class TextStream:
    """Streamed text of one output: push the new token ids, get the new printable text."""

    def __init__(self, tokenizer):
        self.ids: list[int] = []
        self.text = IncrementalText(tokenizer.decode)

    def push(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        parts = []
        while (part := self.text.read_one(self.ids)) is not None:
            parts.append(part)
        return "".join(parts)


class OutputProcessor:
    def __init__(self, tokenizer, max_length: int):
        self.tokenizer, self.max_length = tokenizer, max_length

    def process(self, rows: list[RequestState], new_tokens: list[list[int]] | None) -> list[StepOutput]:
        """After a step: new_tokens[j] for rows[j] (None: the rows were just prefilled, their first token
        already in place). Cuts at stops, marks finished rows; returns what each row gained."""
        outputs = []
        for j, r in enumerate(rows):
            if new_tokens is None:
                start, new = len(r.output) - 1, None
            else:
                r.output.extend(new_tokens[j])
                start, new = len(r.output) - len(new_tokens[j]), new_tokens[j]
            self._apply_stops(r, start, new)
            outputs.append(self._output(r, new if new is not None else r.output[-1:]))
        return outputs

    def _apply_stops(self, r: RequestState, start: int, new: list[int] | None) -> None:
        req = r.request
        cut, reason = None, None
        for i in range(start, len(r.output)):
            if r.output[i] in req.stop_token_ids:
                cut, reason = i + 1, "stop"
                break
        if cut is None and len(r.output) >= req.max_new_tokens:
            cut, reason = req.max_new_tokens, "length"
        if req.stop_strings and self.tokenizer is not None:
            if r.stop_text is None:
                r.stop_text = StopStringMatcher(self.tokenizer.decode, tuple(req.stop_strings))
            text = r.stop_text.add(r.output, cut or len(r.output))
            if text is not None:
                r.text = text
                cut, reason = r.stop_text.tokens_read, "stop"
        if cut is not None:
            if new is not None:
                del new[max(0, cut - start) :]
            del r.output[cut:]
            r.finish = reason
        elif len(req.prompt_ids) + len(r.output) >= self.max_length:
            r.finish = "length"

    @staticmethod
    def _output(r: RequestState, new: list[int]) -> StepOutput:
        if r.finish is not None:
            r.stats.new_tokens = len(r.output)
            r.stats.wall_time = time.perf_counter() - r.started
        return StepOutput(r.id, list(new), r.output, r.finish is not None, r.finish, r.stats, r.text)
