"""The step-level engine core: requests join and leave a running batch between steps.

`add_request` queues a request, `step` runs one forward of work (a prefill chunk of the waiting
requests, or one decoding step of the running ones: draft -> verify -> accept -> compact) and
returns what each request gained, `abort` drops a request and frees its cache slot at once.
`Engine.generate` and the server (serve/) are loops over it.

Scheduling: first come first served; at most `max_num_seqs` requests hold cache slots; prompts are
prefilled in chunks of at most `max_num_batched_tokens` tokens per step, alternating with decoding
steps, so a long prompt delays the running requests by one chunk per token instead of stalling them;
a request is admitted only while the KV budget (positions over all slots) covers it, and one that
could never fit is refused when it is added.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .kv_cache import ContextLengthError, causal_mask
from .sampling import BatchSampling, SamplingParams, make_generator, token_scores
from .speculation.ngram import NgramIndex, merge_chains
from .speculation.policy import observe_acceptance
from .speculation.synthetic import accept_synthetic
from .speculation.tree import root_only
from .speculation.verify import accept_greedy
from .stats import SpecStats

PENDING_PAIRS_MAX = 16  # drafter pairs queued by plain steps that a catch-up extend feeds (see _append_pending)
POLICY_RECHECK_STEPS = 16  # how often the policy's calibration is checked for being off


class AdmissionError(ValueError):
    """A request that can never be admitted (it alone needs more KV memory than the budget)."""


@dataclass
class StepOutput:
    request_id: int
    new_token_ids: list[int]  # tokens this step added (after stop-token and stop-string cuts)
    output_ids: list[int]  # everything generated so far
    finished: bool
    finish_reason: str | None  # "stop" (EOS or stop string), "length" (max tokens or context)
    stats: SpecStats  # the request's own, cumulative
    text: str | None = None  # when a stop string cut the text: the text before it


@dataclass
class _Row:
    id: int
    request: object  # engine.Request
    params: SamplingParams
    seed: int | None  # per-request seed (reproducible sampling), None: the core's shared generator
    slot: int = -1
    done: int = 0  # prompt tokens prefilled so far
    output: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    started: float = 0.0
    finish: str | None = None
    text: str | None = None
    ngram: NgramIndex | None = None  # prompt + output, for copying continuations (hybrid proposer)


class EngineCore:
    """One engine's batch state. Not thread-safe: one thread calls add_request/step/abort (serve/
    wraps it in a background loop)."""

    def __init__(self, engine, *, max_num_seqs: int = 1, max_num_batched_tokens: int | None = None,
                 kv_budget_tokens: int | None = None, default_params: SamplingParams = SamplingParams(),
                 seed: int | None = None, policy_batch: int | None = None):  # fmt: skip
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
        budget = max_num_batched_tokens or engine.prefill_chunk
        if not isinstance(budget, int) or budget < 1:
            raise ValueError(f"max_num_batched_tokens must be a positive integer, got {budget!r}")
        if kv_budget_tokens is not None and (not isinstance(kv_budget_tokens, int) or kv_budget_tokens < 1):
            raise ValueError(f"the KV budget must be a positive number of positions, got {kv_budget_tokens!r}")
        self.engine = engine
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, budget
        self.kv_budget_tokens = kv_budget_tokens
        self.default_params = default_params
        self.policy_batch = policy_batch  # None: the policy of the running batch size's bucket
        self.device = engine.device
        self.generator = make_generator(seed, self.device)
        self.tcache = engine.target.new_cache(max_num_seqs, max_length=engine.max_length)
        self.dcache = None
        if engine.drafter is not None:
            self.dcache = engine.drafter.new_cache(max_num_seqs, max_length=engine.max_length + engine.tree_slack)
        self.stats = SpecStats()  # the core's own phase times (not summed over rows)
        self.waiting: list[_Row] = []
        self.prefilling: list[_Row] = []
        self.running: list[_Row] = []
        self.state = None  # running batch tensors: root [B], ids [B, E], aux [B, E, A*H], cnt [B]
        self._sampling: BatchSampling | None = None  # of self.running, rebuilt when it changes
        self._next_id = 0
        self._decode_turn = False
        self._policy, self._policy_key, self._policy_age = None, None, 0
        self.last_shape: tuple[int, int, int] | None = None  # the last decoding step's (width, depth, nodes)
        self._deferred_extend = None  # the drafter's share of the last prefill chunk (see step)

    # -- public API ------------------------------------------------------------------------------
    def add_request(self, request, params: SamplingParams | None = None, request_id: int | None = None) -> int:
        """Queue a request; returns its id. Raises ValueError (or ContextLengthError, AdmissionError)
        with what to fix when it can never run; nothing is queued then."""
        self.validate(request)
        need = self._positions_needed(request)
        if self.kv_budget_tokens is not None and need > self.kv_budget_tokens:
            raise AdmissionError(
                f"the request needs {need} KV cache positions (prompt {len(request.prompt_ids)} + up to "
                f"{request.max_new_tokens} new tokens) but the KV budget is {self.kv_budget_tokens}; "
                "lower max_tokens or shorten the prompt"
            )
        params = params or getattr(request, "params", None) or self.default_params
        seed = params.seed
        if request_id is None:
            request_id = self._next_id
        self._next_id = max(self._next_id, request_id + 1)
        self.waiting.append(_Row(request_id, request, params, seed))
        return request_id

    def abort(self, request_id: int) -> bool:
        """Drop a request wherever it is; its cache slot is free for the next step. False if unknown."""
        for rows in (self.waiting, self.prefilling):
            for i, r in enumerate(rows):
                if r.id == request_id:
                    del rows[i]
                    self._free(r)
                    return True
        for i, r in enumerate(self.running):
            if r.id == request_id:
                self._remove_running([i])
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.prefilling)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def kv_usage(self) -> float:
        """Fraction of the KV budget (or of the allocated cache) the live sequences occupy."""
        used = sum(int(self.tcache.lengths[r.slot]) for r in self.running + self.prefilling)
        total = self.kv_budget_tokens or self.tcache.num_slots * max(self.tcache.capacity, 1)
        return min(1.0, used / total)

    def validate(self, request) -> None:
        vocab, limit = self.engine.target.cfg.vocab_size, self.engine.max_length
        ids = request.prompt_ids
        if len(ids) == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(ids) >= limit:
            raise ContextLengthError(
                f"the prompt has {len(ids)} tokens but the model context is {limit}; "
                f"shorten it to at most {limit - 1} tokens"
            )
        n = request.max_new_tokens
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {n!r}")

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One forward of work; returns the requests that gained tokens (finished ones included)."""
        self._run_deferred_extend()
        self._admit()
        if self.prefilling and not (self.running and self._decode_turn):
            rows, new_tokens = self._prefill_chunk(), None
            self._decode_turn = True
            self.last_shape = None
        elif self.running:
            rows, new_tokens = self.running, self._decode()
            self._decode_turn = False
        else:
            return []
        self._after_tokens(rows, new_tokens)
        outputs = [self._output(r, new_tokens[j] if new_tokens is not None else r.output[-1:])
                   for j, r in enumerate(rows)]  # fmt: skip
        done = [i for i, r in enumerate(self.running) if r.finish is not None]
        if done:
            self._remove_running(done)
        return [o for o in outputs if o.new_token_ids or o.finished]

    # -- scheduling ------------------------------------------------------------------------------
    def _positions_needed(self, request) -> int:
        return min(len(request.prompt_ids) + request.max_new_tokens + self.engine.tree_slack, self.engine.max_length)

    def _admit(self) -> None:
        while self.waiting and self.num_running < self.max_num_seqs:
            r = self.waiting[0]
            if self.kv_budget_tokens is not None:
                live = [self._positions_needed(x.request) for x in self.running + self.prefilling]
                need = max(live + [self._positions_needed(r.request)])
                if need * (len(live) + 1) > self.kv_budget_tokens:  # slots are rectangular: rows x longest
                    return
            self.waiting.pop(0)
            r.slot = self.tcache.allocate()
            if self.dcache is not None:
                while self.dcache.num_slots < self.tcache.num_slots:
                    self.dcache.add_slots(self.tcache.num_slots - self.dcache.num_slots)
                self.dcache.in_use[r.slot] = True
                self.dcache.lengths[r.slot] = 0
            r.started = time.perf_counter()
            r.stats.prompt_tokens = len(r.request.prompt_ids)
            self.prefilling.append(r)

    def _free(self, r: _Row) -> None:
        if r.slot >= 0:
            self.tcache.free(r.slot)
            if self.dcache is not None:
                self.dcache.free(r.slot)
            r.slot = -1

    def _remove_running(self, indices: list[int]) -> None:
        now = time.perf_counter()
        gone = set(indices)
        for i in indices:
            r = self.running[i]
            r.stats.wall_time = now - r.started
            r.stats.new_tokens = len(r.output)
            self._free(r)
        keep = [i for i in range(len(self.running)) if i not in gone]
        self.running = [self.running[i] for i in keep]
        self.state = _select_state(self.state, keep) if keep else None
        self._sampling = None

    def _policy_now(self, batch: int):
        engine = self.engine
        if engine.drafter is None:
            return None
        key = self.policy_batch or min(1 << (batch - 1).bit_length(), self.max_num_seqs)
        self._policy_age += 1
        if key != self._policy_key or self._policy_age >= POLICY_RECHECK_STEPS:
            self._policy, self._policy_key, self._policy_age = engine._policy_for(key), key, 0
            engine.policy = self._policy
        return self._policy

    # -- prefill -------------------------------------------------------------------------------
    def _prefill_chunk(self) -> list[_Row]:
        """Prefill the next chunk of the prefilling rows; returns the rows whose prompt is now complete
        (their first token sampled), which join the running batch."""
        engine = self.engine
        t0 = time.perf_counter()
        group = self.prefilling[: self.max_num_batched_tokens]
        remaining = max(len(r.request.prompt_ids) - r.done for r in group)
        t = max(1, min(engine.prefill_chunk, self.max_num_batched_tokens // len(group), remaining))
        b = len(group)
        cnt = [min(t, len(r.request.prompt_ids) - r.done) for r in group]
        ids = torch.zeros(b, t + 1, dtype=torch.long)
        for j, r in enumerate(group):
            piece = r.request.prompt_ids[r.done : r.done + t + 1]
            ids[j, : len(piece)] = torch.tensor(piece)
        ids = ids.to(self.device)
        cnt_t = torch.tensor(cnt)
        slots = torch.tensor([r.slot for r in group], device=self.device)
        use_drafter = engine.drafter is not None
        meta = self.tcache.prepare(slots, causal_mask(cnt_t.to(self.device), t))
        h, aux = engine.target(ids[:, :t], meta.write_pos, self.tcache, meta, capture_aux=use_drafter)
        self.tcache.commit(slots, cnt_t)
        if use_drafter:
            self._deferred_extend = self._drafter_prompt_pairs(group, slots, ids, aux, t)
        for r, c in zip(group, cnt):
            r.done += c
            r.stats.target_forwards += 1
        complete = [j for j, r in enumerate(group) if r.done == len(r.request.prompt_ids)]
        joined = [group[j] for j in complete]
        if complete:
            sel = torch.tensor(complete, device=self.device)
            pick = (cnt_t[complete] - 1).to(self.device)[:, None, None]
            last_h = h.index_select(0, sel).gather(1, pick.expand(-1, 1, h.shape[-1]))
            logits = engine.target.logits(last_h)  # [J, 1, V]
            params = [r.params for r in joined]
            batch = BatchSampling.of(params, [r.seed for r in joined], self.device)
            next_pos = torch.tensor([[len(r.request.prompt_ids)] for r in joined])
            first = token_scores(logits, batch, next_pos, self.generator).argmax(-1)[:, 0]
            state = {"root": first, "ids": None, "aux": None, "cnt": None}
            if use_drafter:
                last_aux = aux.index_select(0, sel).gather(1, pick.expand(-1, 1, aux.shape[-1]))
                state.update(ids=first[:, None], aux=last_aux, cnt=torch.ones(len(joined), dtype=torch.long,
                                                                             device=self.device))  # fmt: skip
            for r, tok in zip(joined, first.tolist()):
                r.output.append(tok)
                if engine.ngram_tokens:
                    r.ngram = NgramIndex(r.request.prompt_ids + [tok])
            self.prefilling = [r for r in self.prefilling if r.done < len(r.request.prompt_ids)]
            self.running += joined
            self.state = state if self.state is None else _cat_state(self.state, state)
            self._sampling = None
        dt = time.perf_counter() - t0
        self.stats.time_prefill += dt
        for r in group:
            r.stats.time_prefill += dt
        return joined

    def _drafter_prompt_pairs(self, group, slots, ids, aux, t):
        """The drafter's share of a prefill chunk: pairs (state at i, token i+1) for i < n - 1 (the
        last one waits for the sampled token), limited to the last `draft_prefill_window` pairs of
        each prompt. Returned as the arguments of one extend, run at the start of the next step so
        that the first token reaches the client after the target's prefill alone."""
        window = self.engine.draft_prefill_window
        if self._policy is not None and self._policy.backing_off:
            window = 0  # speculation does not pay at this batch size now: the drafter starts from later pairs
        done = torch.tensor([r.done for r in group])
        pairs = torch.tensor([len(r.request.prompt_ids) - 1 for r in group])
        d_cnt = (pairs - done).clamp(0, t)
        skip = torch.zeros_like(d_cnt) if window is None else ((pairs - window) - done).clamp(min=0).minimum(d_cnt)
        cnt = d_cnt - skip
        if int(cnt.max()) == 0:
            return None
        pair_ids, pair_aux = ids[:, 1 : t + 1], aux
        width = int(cnt.max())  # columns past every row's kept pairs would be drafter work thrown away
        if int(skip.max()) > 0:  # shift each row so its first kept pair comes first
            idx = (skip[:, None] + torch.arange(width)).clamp(max=t - 1).to(ids.device)
            pair_ids = pair_ids.gather(1, idx)
            pair_aux = aux.gather(1, idx[:, :, None].expand(-1, -1, aux.shape[-1]))
        return slots, pair_ids[:, :width], pair_aux[:, :width], cnt, width

    def _run_deferred_extend(self) -> None:
        pending, self._deferred_extend = self._deferred_extend, None
        if pending is None:
            return
        t0 = time.perf_counter()
        slots, pair_ids, pair_aux, cnt, t = pending
        alive = torch.tensor([bool(self.dcache.in_use[s]) for s in slots.tolist()])
        self.engine.proposer.extend(self.dcache, slots, pair_ids, pair_aux, cnt * alive, chunk=t)
        self.stats.time_prefill += time.perf_counter() - t0

    # -- one decoding step -----------------------------------------------------------------------
    def _decode(self) -> list[list[int]]:
        engine, rows, state = self.engine, self.running, self.state
        t0 = time.perf_counter()
        b = len(rows)
        rows_arg = _rows_arg(rows, self.device)
        engine.active_rows = rows  # read-only view for instrumentation (drift tools, rigged test proposers)
        if self._sampling is None:
            self._sampling = BatchSampling.of([r.params for r in rows], [r.seed for r in rows], self.device)
        lengths = self.tcache.lengths[[r.slot for r in rows]]
        policy = self._policy_now(b)
        if policy is not None and policy.costs is not None:
            policy.costs.set_context(int(lengths.float().mean()))  # verification gets dearer with context
        plan = policy.plan() if policy is not None else None
        speculate = plan is not None
        if speculate and int(lengths.max()) + engine.shape.kept_nodes + engine.ngram_tokens + 1 > engine.max_length:
            speculate = False  # too close to the context end for a tree: finish with plain steps
        chains = None
        if speculate:
            logits_d, state_d = engine.proposer.extend(self.dcache, rows_arg, state["ids"], state["aux"], state["cnt"])
            auto = policy if engine.mode == "auto" else None
            tree = engine.proposer.propose(self.dcache, rows_arg, state["root"], logits_d, state_d, width=plan.top_k,
                                           policy=auto, confidence=engine.confidence)  # fmt: skip
            chains = self._copied_chains(rows, auto, tree)
            if chains is not None:
                tree, _ = merge_chains(tree, chains)
        else:
            tree = root_only(state["root"])
        depth = int(tree.depth.max())
        t1 = time.perf_counter()
        positions = lengths.to(self.device)[:, None] + tree.depth
        meta = self.tcache.prepare(rows_arg, tree.mask, positions)
        h, aux = engine.target(tree.tokens, positions, self.tcache, meta, capture_aux=engine.drafter is not None)
        logits = engine.target.logits(h)
        if engine.synthetic_acceptance is not None and speculate:
            acc = accept_synthetic(tree, logits, depth, engine.synthetic_acceptance, self.generator)
        else:
            acc = accept_greedy(tree, token_scores(logits, self._sampling, positions + 1, self.generator), depth)
        self.tcache.compact(rows_arg, acc.path, (acc.accepted + 1).cpu())
        t2 = time.perf_counter()
        path_tokens = tree.tokens.gather(1, acc.path)
        new_state = {"root": acc.next_token, "ids": None, "aux": None, "cnt": None}
        if speculate:
            nxt = torch.cat([path_tokens[:, 1:], acc.next_token[:, None]], dim=1)
            nxt.scatter_(1, acc.accepted[:, None], acc.next_token[:, None])
            new_state["ids"] = nxt
            new_state["aux"] = aux.gather(1, acc.path[:, :, None].expand(b, acc.path.shape[1], aux.shape[-1]))
            new_state["cnt"] = acc.accepted + 1
        elif engine.drafter is not None:  # plain step: queue (state of root, next token) for the drafter
            new_state.update(_append_pending(state, aux[:, 0], acc.next_token))
        host = torch.cat([path_tokens, acc.accepted[:, None], acc.next_token[:, None]], dim=1).tolist()
        out = []
        n_draft = tree.num_draft
        for j, (r, row) in enumerate(zip(rows, host)):
            a = row[-2]
            out.append(row[1 : a + 1] + [row[-1]])
            r.stats.target_forwards += 1
            if r.ngram is not None:
                r.ngram.append(out[-1])
            if speculate and n_draft > 0:
                r.stats.observe_draft(n_draft, a)
                r.stats.drafter_forwards += max(depth, 1)
                if chains is not None and chains[j]:
                    r.stats.copied_tokens += len(chains[j])
                    r.stats.copied_accepted += _common_prefix(chains[j], out[-1][:a])
        t3 = time.perf_counter()
        if policy is not None:
            if speculate and tree.score is not None:
                observe_acceptance(policy.acceptance, tree, acc)
            if chains is not None:
                policy.acceptance.observe_ngram(*_ngram_hits(chains, out))
            shape = (plan.top_k, depth, n_draft) if speculate else None
            policy.observe(speculate, sum(len(o) for o in out), t3 - t0, shape, rows=b)
        self.last_shape = (plan.top_k, depth, n_draft) if speculate else (0, 0, 0)
        self.state = new_state
        for stats in [self.stats] + [r.stats for r in rows]:
            stats.time_draft += t1 - t0
            stats.time_verify += t2 - t1
            stats.time_other += t3 - t2
        return out

    def _copied_chains(self, rows, policy, tree) -> list[list[int]] | None:
        """Continuations copied from each row's context; with the policy, only as many tokens per step
        as their measured acceptance pays for. None when there is nothing to add."""
        if not self.engine.ngram_tokens:
            return None
        chains = [r.ngram.lookup(self.engine.ngram_tokens) for r in rows]
        if policy is not None:
            keep = policy.ngram_count([len(c) for c in chains], tree.num_draft)
            chains = [c[:keep] for c in chains]
        return chains if any(chains) else None

    # -- after a step ----------------------------------------------------------------------------
    def _after_tokens(self, rows, new_tokens) -> None:
        """Append accepted tokens (None: just prefilled, first token already in place), apply stops."""
        limit, tokenizer = self.engine.max_length, self.engine.tokenizer
        for j, r in enumerate(rows):
            if new_tokens is None:
                start = len(r.output) - 1
            else:
                r.output.extend(new_tokens[j])
                start = len(r.output) - len(new_tokens[j])
            req = r.request
            cut, reason = None, None
            for i in range(start, len(r.output)):
                if r.output[i] in req.stop_token_ids:
                    cut, reason = i + 1, "stop"
                    break
            if cut is None and len(r.output) >= req.max_new_tokens:
                cut, reason = req.max_new_tokens, "length"
            if req.stop_strings and tokenizer is not None:
                hit = self._stop_string(r, start, cut or len(r.output))
                if hit is not None:
                    cut, reason = hit
            if cut is not None:
                if new_tokens is not None:
                    del new_tokens[j][max(0, cut - start) :]
                del r.output[cut:]
                r.finish = reason
            elif len(req.prompt_ids) + len(r.output) >= limit:
                r.finish = "length"

    def _stop_string(self, r: _Row, start: int, end: int):
        decode = self.engine.tokenizer.decode
        for j in range(start, end):
            text = decode(r.output[: j + 1], skip_special_tokens=True)
            for s in r.request.stop_strings:
                pos = text.find(s)
                if pos >= 0:
                    r.text = text[:pos]
                    return j + 1, "stop"
        return None

    def _output(self, r: _Row, new: list[int]) -> StepOutput:
        if r.finish is not None:
            r.stats.new_tokens = len(r.output)
            r.stats.wall_time = time.perf_counter() - r.started
        return StepOutput(r.id, list(new), r.output, r.finish is not None, r.finish, r.stats, r.text)


def _rows_arg(rows: list[_Row], device):
    slots = [r.slot for r in rows]
    if slots == list(range(len(slots))):
        return None
    return torch.tensor(slots, dtype=torch.long, device=device)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ngram_hits(chains: list[list[int]], emitted: list[list[int]]) -> tuple[list[int], list[int]]:
    """Per copied length j: how many chains could be judged (the target's tokens are known that far,
    or the chain went wrong earlier) and how many had their first j tokens right."""
    size = max(len(c) for c in chains) + 1
    tried, hits = [0] * size, [0] * size
    for c, e in zip(chains, emitted):
        right = _common_prefix(c, e)
        for j in range(1, len(c) + 1):
            if j <= right:
                tried[j] += 1
                hits[j] += 1
            elif right < len(e) or j <= len(e):  # a known mismatch at or before j
                tried[j] += 1
    return tried, hits


def _cat_state(a: dict, b: dict) -> dict:
    out = {"root": torch.cat([a["root"], b["root"]])}
    if a["ids"] is None:
        return {**out, "ids": None, "aux": None, "cnt": None}
    e = max(a["ids"].shape[1], b["ids"].shape[1])
    pad = lambda x: (
        torch.nn.functional.pad(x, (0, e - x.shape[1]))
        if x.dim() == 2
        else torch.nn.functional.pad(x, (0, 0, 0, e - x.shape[1]))
    )
    out["ids"] = torch.cat([pad(a["ids"]), pad(b["ids"])])
    out["aux"] = torch.cat([pad(a["aux"]), pad(b["aux"])])
    out["cnt"] = torch.cat([a["cnt"], b["cnt"]])
    return out


def _append_pending(state: dict, aux: torch.Tensor, token: torch.Tensor, keep: int = PENDING_PAIRS_MAX) -> dict:
    """Add one (aux state, next token) pair after each row's pending pairs, keeping each row's last
    `keep`: after a long run of plain steps the drafter catches up on the recent pairs only (a gap in
    its context, like the prefill window), so the catch-up forward stays small at any batch size."""
    ids, pend_aux, cnt = state["ids"], state["aux"], state["cnt"]
    ids = torch.nn.functional.pad(ids, (0, 1))
    pend_aux = torch.nn.functional.pad(pend_aux, (0, 0, 0, 1))
    rows = torch.arange(ids.shape[0], device=ids.device)
    ids[rows, cnt] = token
    pend_aux[rows, cnt] = aux
    cnt = cnt + 1
    if ids.shape[1] > keep:
        first = (cnt - keep).clamp(min=0)
        idx = (first[:, None] + torch.arange(keep, device=ids.device)).clamp(max=ids.shape[1] - 1)
        ids = ids.gather(1, idx)
        pend_aux = pend_aux.gather(1, idx[:, :, None].expand(-1, -1, pend_aux.shape[-1]))
        cnt = cnt.clamp(max=keep)
    return {"ids": ids, "aux": pend_aux, "cnt": cnt}


def _select_state(state: dict, keep: list[int]) -> dict:
    idx = torch.tensor(keep, device=state["root"].device)
    return {k: (v.index_select(0, idx) if v is not None else None) for k, v in state.items()}
