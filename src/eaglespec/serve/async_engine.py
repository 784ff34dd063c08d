"""The engine core on a background thread, and asyncio streams of its outputs for the HTTP side.

One thread owns the EngineCore (it is not thread-safe): it applies queued add/abort commands between
steps, steps while there is work, and hands each request's StepOutputs to that request's asyncio
queue. The HTTP side never touches tensors; the core never touches HTTP. Metrics are observed here,
where the step timestamps are.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ..engine import Engine, Request
from ..request import StepOutput
from ..sampling import SamplingParams
from .metrics import ServerMetrics
from .protocol import ApiError

log = logging.getLogger("eaglespec.serve")


@dataclass
class _Live:
    index: int  # the choice index within its HTTP request
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    prompt_tokens: int
    first: float | None = None
    last: float | None = None
    seen: tuple = (0, 0, 0, ())  # drafts, draft tokens, accepted, per position: already counted in metrics
    finished: bool = False


@dataclass
class Submission:
    ids: list[int]  # engine request ids, in choice order
    queue: asyncio.Queue  # (request id, StepOutput or an exception), filled by the engine thread


@dataclass
class _Command:
    kind: str  # "add" | "abort" | "end_all"
    request_id: int
    request: Request | None = None
    params: SamplingParams | None = None
    live: _Live | None = None
    done: concurrent.futures.Future | None = field(default=None)
    note: str = ""  # end_all: the message every ended request gets


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: ServerMetrics, *, max_num_seqs: int = 8,
                 max_num_batched_tokens: int | None = None, kv_budget_tokens: int | None = None,
                 max_queue: int = 256):  # fmt: skip
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an integer >= 0, got {max_queue!r}")
        self.engine, self.metrics, self.max_queue = engine, metrics, max_queue
        self.core = engine.new_core(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                               kv_budget_tokens=kv_budget_tokens)  # fmt: skip
        self._cv = threading.Condition()
        self._commands: list[_Command] = []
        self._live: dict[int, _Live] = {}  # engine thread only
        self._next_id = 0
        self._pending_adds = 0
        self._accepting = True
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="eaglespec-engine", daemon=True)
        self.error: BaseException | None = None

    # -- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float | None = None) -> None:
        """Refuse new requests, finish the running ones, stop the thread."""
        with self._cv:
            self._accepting = False
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)

    def stop_accepting(self) -> None:
        """New requests get 503 from now on; running ones go on (the start of a graceful shutdown)."""
        with self._cv:
            self._accepting = False

    def end_all(self, message: str) -> None:
        """Stop accepting and end every queued or running request now with a 503 saying `message` (the
        end of a graceful shutdown that ran out of time): each client gets an OpenAI error body or an SSE
        error event and [DONE], not a cut connection."""
        with self._cv:
            self._accepting = False
            self._commands.append(_Command("end_all", -1, note=message))
            self._cv.notify()

    @property
    def healthy(self) -> bool:
        return self._thread.is_alive() and self._accepting

    # -- the HTTP side ---------------------------------------------------------------------------
    async def submit(self, items: list[tuple[Request, SamplingParams]]) -> Submission:
        """Queue every (request, params) of one HTTP request. Raises ApiError 400 (invalid, or can never
        fit the KV budget), 429 (queue full) or 503 (shutting down); nothing stays queued then."""
        for request, _ in items:
            try:
                self.core.validate(request)  # reads the engine's config only: safe off the engine thread
            except ValueError as e:
                raise ApiError(400, str(e), param="prompt") from None
        loop = asyncio.get_running_loop()
        sub = Submission([], asyncio.Queue())
        futures = []
        with self._cv:
            if not self._accepting:
                raise ApiError(503, "the server is shutting down")
            if self.core.num_waiting + self._pending_adds + len(items) > self.max_queue:
                raise ApiError(429, f"the waiting queue is full ({self.max_queue} requests, --max-queue); retry later")
            now = time.perf_counter()
            for i, (request, params) in enumerate(items):
                rid = self._next_id
                self._next_id += 1
                fut = concurrent.futures.Future()
                self._commands.append(_Command("add", rid, request, params, _Live(i, sub.queue, loop, now,
                                                                                  len(request.prompt_ids)), fut))
                futures.append(fut)
                sub.ids.append(rid)
            self._pending_adds += len(items)
            self._cv.notify()
        try:
            for fut in futures:
                await asyncio.wrap_future(fut)  # the core's own refusal (e.g. over the KV budget)
        except BaseException:
            self.cancel(sub)
            raise
        return sub

    async def stream(self, sub: Submission, timeout: float | None = None) -> AsyncIterator[tuple[int, StepOutput]]:
        """(choice index, output) as tokens arrive, until every request of the submission finished.
        Raises ApiError 408 past `timeout` seconds. Whatever ends the iteration early (a client that
        disconnects, a timeout, an error) aborts the unfinished requests at once."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        open_ids = set(sub.ids)
        try:
            while open_ids:
                wait = None if deadline is None else max(0.0, deadline - loop.time())
                try:
                    rid, item = await asyncio.wait_for(sub.queue.get(), wait)
                except TimeoutError:
                    raise ApiError(408, f"the request took longer than the server's --request-timeout of "
                                        f"{timeout:g} s and was aborted") from None  # fmt: skip
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    open_ids.discard(rid)
                yield sub.ids.index(rid), item
        finally:
            sub.ids = [i for i in sub.ids if i in open_ids]
            self.cancel(sub)

    def cancel(self, sub: Submission) -> None:
        """Abort every request of the submission that has not finished (no-op for finished ones)."""
        for rid in sub.ids:
            self._abort(rid)

    def _abort(self, request_id: int) -> None:
        with self._cv:
            self._commands.append(_Command("abort", request_id))
            self._cv.notify()

    # -- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        core = self.core
        while True:
            with self._cv:
                while not self._commands and not core.has_work and not self._stop:
                    self._cv.wait()
                commands, self._commands = self._commands, []
                if self._stop and not commands and not core.has_work:
                    break
            for cmd in commands:
                self._apply(cmd)
            if core.has_work:
                try:
                    outputs = core.step()
                except Exception as e:  # a bug or OOM: fail the live requests, keep serving
                    log.exception("engine step failed")
                    self._fail_all(e)
                    continue
                self._dispatch(outputs)
            self.metrics.observe_queue(core.num_running, core.num_waiting + self._pending_adds, core.kv_usage())

    def _apply(self, cmd: _Command) -> None:
        if cmd.kind == "add":
            with self._cv:
                self._pending_adds -= 1
            try:
                self.core.add_request(cmd.request, cmd.params, request_id=cmd.request_id)
            except ValueError as e:
                cmd.done.set_exception(ApiError(400, str(e), param="max_tokens"))
                return
            self._live[cmd.request_id] = cmd.live
            cmd.done.set_result(cmd.request_id)
        elif cmd.kind == "end_all":
            self._end_all(ApiError(503, cmd.note))
        elif cmd.request_id in self._live:  # abort: frees the cache slot before the next step
            self.core.abort(cmd.request_id)
            del self._live[cmd.request_id]

    def _dispatch(self, outputs: list[StepOutput]) -> None:
        now = time.perf_counter()
        m = self.metrics
        m.observe_step(getattr(self.core, "last_shape", None))
        for out in outputs:
            live = self._live.get(out.request_id)
            if live is None:
                continue
            name = m.model_name
            if live.first is None:
                live.first = now
                m.prompt_tokens.labels(name).inc(live.prompt_tokens)
                m.ttft.labels(name).observe(now - live.arrival)
            else:
                m.itl.labels(name).observe(now - live.last)
            live.last = now
            m.generation_tokens.labels(name).inc(len(out.new_token_ids))
            s = out.stats
            d0, t0, a0, p0 = live.seen
            per_pos = [n - (p0[i] if i < len(p0) else 0) for i, n in enumerate(s.accepted_per_pos)]
            m.observe_spec(s.drafts - d0, s.draft_tokens - t0, s.accepted - a0, per_pos)
            live.seen = (s.drafts, s.draft_tokens, s.accepted, tuple(s.accepted_per_pos))
            if out.finished:
                n = len(out.output_ids)
                m.e2e.labels(name).observe(now - live.arrival)
                if n > 1:
                    m.tpot.labels(name).observe((now - live.first) / (n - 1))
                m.request_success.labels(name, out.finish_reason).inc()
                del self._live[out.request_id]
            _put(live, (out.request_id, out))

    def _fail_all(self, error: Exception) -> None:
        self._end_all(ApiError(500, f"the engine failed: {type(error).__name__}: {error}"))

    def _end_all(self, error: ApiError) -> None:
        for rid, live in list(self._live.items()):
            self.core.abort(rid)
            _put(live, (rid, error))
        self._live.clear()


def _put(live: _Live, item) -> None:
    try:
        live.loop.call_soon_threadsafe(live.queue.put_nowait, item)
    except RuntimeError:  # the client's event loop is gone
        pass
