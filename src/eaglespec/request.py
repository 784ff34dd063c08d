"""What flows between the engine's parts: a request as given, its state while it runs, and what a
step returns for it. Plain objects, no behaviour beyond bookkeeping."""

from __future__ import annotations

from dataclasses import dataclass, field

from .sampling import SamplingParams
from .speculation.ngram import NgramIndex
from .stats import SpecStats


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    params: SamplingParams | None = None  # None: the settings given to generate (or the server's default)


@dataclass
class RequestState:
    """A request inside the engine: where it is (scheduler.py), what it has produced (core.py) and
    whether it is finished (outputs.py)."""

    id: int
    request: Request
    params: SamplingParams
    seed: int | None  # per-request seed (reproducible sampling), None: the core's shared generator
    slot: int = -1  # its KV cache slot, -1 while waiting or after it left
    done: int = 0  # prompt tokens prefilled so far
    output: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    started: float = 0.0
    finish: str | None = None
    text: str | None = None  # when a stop string cut the output: the text before it
    ngram: NgramIndex | None = None  # prompt + output, for copying continuations (hybrid proposer)
    stop_text: object | None = None  # outputs.StopStringMatcher, with stop strings and a tokenizer

    @property
    def prompt_done(self) -> bool:
        return self.done == len(self.request.prompt_ids)


@dataclass
class StepOutput:
    request_id: int
    new_token_ids: list[int]  # tokens this step added (after stop-token and stop-string cuts)
    output_ids: list[int]  # everything generated so far
    finished: bool
    finish_reason: str | None  # "stop" (EOS or stop string), "length" (max tokens or context)
    stats: SpecStats  # the request's own, cumulative
    text: str | None = None  # when a stop string cut the text: the text before it
