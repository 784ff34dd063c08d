"""The scheduler: which requests hold cache slots and what the next step runs.

First come first served; at most `max_num_seqs` requests hold cache slots; prompts are prefilled in
chunks of at most `max_num_batched_tokens` tokens per step, alternating with decoding steps, so a long
prompt delays the running requests by one chunk per turn instead of stalling them; a request is
admitted only while the KV budget (positions over all slots) covers it, and one that could never fit
is refused when it is added. The scheduler holds no tensors: it asks the core for slots.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from .kv_cache import ContextLengthError
from .request import Request, RequestState


class AdmissionError(ValueError):
    """A request that can never be admitted (it alone needs more KV memory than the budget)."""


@dataclass
class SchedulerOutput:
    """The next step: a prefill chunk (`chunk` prompt tokens at most for each of `rows`) or one decoding
    step of `rows` (the running requests, in the batch state's order)."""

    kind: str  # "prefill" | "decode"
    rows: list[RequestState]
    chunk: int = 0


def check_request(request: Request, vocab_size: int, max_length: int) -> None:
    """Raise ValueError (ContextLengthError for an over-long prompt) saying what to fix."""
    ids = request.prompt_ids
    if len(ids) == 0:
        raise ValueError("the prompt is empty; give at least one token")
    if min(ids) < 0 or max(ids) >= vocab_size:
        raise ValueError(f"prompt token ids must be in [0, {vocab_size})")
    if len(ids) >= max_length:
        raise ContextLengthError(
            f"the prompt has {len(ids)} tokens but the model context is {max_length}; "
            f"shorten it to at most {max_length - 1} tokens"
        )
    n = request.max_new_tokens
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {n!r}")


class Scheduler:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, prefill_chunk: int, max_length: int,
                 tree_slack: int, kv_budget_tokens: int | None, allocate: Callable[[], int],
                 free: Callable[[int], None]):  # fmt: skip
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
        if not isinstance(max_num_batched_tokens, int) or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be a positive integer, got {max_num_batched_tokens!r}")
        if kv_budget_tokens is not None and (not isinstance(kv_budget_tokens, int) or kv_budget_tokens < 1):
            raise ValueError(f"the KV budget must be a positive number of positions, got {kv_budget_tokens!r}")
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.prefill_chunk, self.max_length, self.tree_slack = prefill_chunk, max_length, tree_slack
        self.kv_budget_tokens = kv_budget_tokens
        self._allocate, self._free_slot = allocate, free
        self.waiting: list[RequestState] = []
        self.prefilling: list[RequestState] = []
        self.running: list[RequestState] = []  # decoding, in the batch state's row order
        self._decode_turn = False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    def positions_needed(self, request: Request) -> int:
        return min(len(request.prompt_ids) + request.max_new_tokens + self.tree_slack, self.max_length)

    def add(self, row: RequestState) -> None:
        """Queue a request (checked already); AdmissionError when it alone exceeds the KV budget."""
        need = self.positions_needed(row.request)
        if self.kv_budget_tokens is not None and need > self.kv_budget_tokens:
            raise AdmissionError(
                f"the request needs {need} KV cache positions (prompt {len(row.request.prompt_ids)} + up to "
                f"{row.request.max_new_tokens} new tokens) but the KV budget is {self.kv_budget_tokens}; "
                "lower max_tokens or shorten the prompt"
            )
        self.waiting.append(row)

    def abort(self, request_id: int) -> tuple[RequestState, int | None] | None:
        """Drop a request wherever it is and free its slot: (its state, its index in `running` or None),
        or None when unknown."""
        for rows in (self.waiting, self.prefilling, self.running):
            for i, r in enumerate(rows):
                if r.id == request_id:
                    del rows[i]
                    if rows is self.running:
                        _close_stats(r)
                    self._free(r)
                    return r, (i if rows is self.running else None)
        return None

    def schedule(self) -> SchedulerOutput | None:
        """Admit what fits, then pick the step: a prefill chunk or a decoding step, taking turns while
        both have work; None when there is nothing to do."""
        self._admit()
        if self.prefilling and not (self.running and self._decode_turn):
            self._decode_turn = True
            group, chunk = self._prefill_group()
            return SchedulerOutput("prefill", group, chunk)
        if self.running:
            self._decode_turn = False
            return SchedulerOutput("decode", self.running)
        return None

    def _prefill_group(self) -> tuple[list[RequestState], int]:
        """The prefilling rows of the next chunk and its width. The oldest prefilling row sets the width (first
        come, first served: nothing starves); every row of a chunk is padded to it, so others join only when
        they fill at least half of it, while the chunk fits max_num_batched_tokens. (Prompts of 35 and 487
        tokens in one [2, 487] forward spent more on padding than on tokens; batch-64 regeneration prefilled
        3x the tokens it had.)"""
        left = lambda r: len(r.request.prompt_ids) - r.done  # noqa: E731
        head, *rest = self.prefilling
        chunk = max(1, min(self.prefill_chunk, self.max_num_batched_tokens, left(head)))
        group = [head]
        for r in rest:
            if (len(group) + 1) * chunk > self.max_num_batched_tokens:
                break
            if 2 * min(left(r), chunk) >= chunk:
                group.append(r)
        return group, chunk

    def reorder_running(self, order: list[int]) -> None:
        """The running rows in a new batch order, `order` indexing the current one (the core keeps them in
        slot order)."""
        self.running = [self.running[i] for i in order]

    def start_decoding(self, rows: list[RequestState]) -> None:
        """Rows whose prompt is complete join the running batch (after the rows already there)."""
        self.prefilling = [r for r in self.prefilling if not r.prompt_done]
        self.running += rows

    def remove_finished(self) -> list[int]:
        """Free the finished running rows' slots; returns the indices of the rows kept."""
        keep = [i for i, r in enumerate(self.running) if r.finish is None]
        if len(keep) < len(self.running):
            for r in self.running:
                if r.finish is not None:
                    _close_stats(r)
                    self._free(r)
            self.running = [self.running[i] for i in keep]
        return keep

    def _admit(self) -> None:
        while self.waiting and self.num_running < self.max_num_seqs:
            r = self.waiting[0]
            if self.kv_budget_tokens is not None:
                live = [self.positions_needed(x.request) for x in self.running + self.prefilling]
                need = max(live + [self.positions_needed(r.request)])
                if need * (len(live) + 1) > self.kv_budget_tokens:  # slots are rectangular: rows x longest
                    return
            self.waiting.pop(0)
            r.slot = self._allocate()
            r.started = time.perf_counter()
            r.stats.prompt_tokens = len(r.request.prompt_ids)
            self.prefilling.append(r)

    def _free(self, r: RequestState) -> None:
        if r.slot >= 0:
            self._free_slot(r.slot)
            r.slot = -1


def _close_stats(r: RequestState) -> None:
    r.stats.wall_time = time.perf_counter() - r.started
    r.stats.new_tokens = len(r.output)
