"""The step-level engine core: executes what the scheduler plans, one forward of work per step.

`add_request` queues a request, `step` runs one step (a prefill chunk of the waiting requests, or one
decoding step of the running ones: draft -> verify -> accept -> compact) and returns what each
request gained, `abort` drops a request and frees its cache slot at once. `Engine.generate` and the
server (serve/) are loops over it. The scheduler (scheduler.py) decides what runs, this file runs it
on the models, and output processing (outputs.py) applies stop rules; they talk through
RequestState / SchedulerOutput / StepOutput (request.py, scheduler.py) and the BatchState tensors.
"""

from __future__ import annotations

import time

import torch

from .batch_state import BatchState
from .kv_cache import causal_mask
from .outputs import OutputProcessor
from .request import Request, RequestState, StepOutput
from .sampling import BatchSampling, SamplingParams, make_generator, token_scores
from .scheduler import AdmissionError, Scheduler, check_request
from .speculation.config import SpecConfig
from .speculation.ngram import NgramIndex, merge_chains
from .speculation.policies import PolicyBook
from .speculation.policy import observe_acceptance
from .speculation.proposer import EagleProposer, FixedShape
from .speculation.synthetic import accept_synthetic
from .speculation.tree import root_only
from .speculation.verify import accept_greedy
from .stats import SpecStats

POLICY_RECHECK_STEPS = 16  # how often the policy's calibration is checked for being off

__all__ = ["AdmissionError", "EngineCore", "StepOutput"]


class EngineCore:
    """One batch's state on one engine's models. Not thread-safe: one thread calls add_request / step /
    abort (serve/ wraps it in a background loop). Built by `Engine.new_core`."""

    def __init__(self, target, drafter, proposer: EagleProposer | None, spec: SpecConfig, policies: PolicyBook, *,
                 tokenizer=None, max_length: int, prefill_chunk: int, max_num_seqs: int = 1,
                 max_num_batched_tokens: int | None = None, kv_budget_tokens: int | None = None,
                 default_params: SamplingParams = SamplingParams(), seed: int | None = None,
                 policy_batch: int | None = None, caches: tuple | None = None):  # fmt: skip
        self.target, self.drafter, self.proposer, self.spec = target, drafter, proposer, spec
        self.policies = policies
        self.max_length, self.prefill_chunk = max_length, prefill_chunk
        self.device = next(target.parameters()).device
        budget = max_num_batched_tokens or prefill_chunk
        self.scheduler = Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                   prefill_chunk=prefill_chunk, max_length=max_length, tree_slack=spec.tree_slack,
                                   kv_budget_tokens=kv_budget_tokens, allocate=self._allocate_slot,
                                   free=self._free_slot)  # fmt: skip
        self.outputs = OutputProcessor(tokenizer, max_length)
        self.default_params = default_params
        self.policy_batch = policy_batch  # None: the policy of the running batch size's bucket
        self.generator = make_generator(seed, self.device)
        if caches is None:  # caches: (target's, drafter's) of an idle core with these sizes, emptied (Engine.generate)
            caches = (target.new_cache(max_num_seqs, max_length=max_length),
                      drafter.new_cache(max_num_seqs, max_length=max_length + spec.tree_slack) if drafter else None)
        self.tcache, self.dcache = caches
        self.stats = SpecStats()  # the core's own phase times (not summed over rows)
        self.state: BatchState | None = None  # of scheduler.running, row for row
        self._sampling: BatchSampling | None = None  # of scheduler.running, rebuilt when it changes
        self._next_id = 0
        self.policy, self._policy_key, self._policy_age = None, None, 0  # the policy of the last decoding step
        self.last_shape: tuple[int, int, int] | None = None  # the last decoding step's (width, depth, nodes)
        self._deferred_extend = None  # the drafter's share of the last prefill chunk (see step)

    # -- public API ------------------------------------------------------------------------------
    def add_request(self, request: Request, params: SamplingParams | None = None,
                    request_id: int | None = None) -> int:  # fmt: skip
        """Queue a request; returns its id. Raises ValueError (or ContextLengthError, AdmissionError)
        with what to fix when it can never run; nothing is queued then."""
        self.validate(request)
        params = params or request.params or self.default_params
        if request_id is None:
            request_id = self._next_id
        self.scheduler.add(RequestState(request_id, request, params, params.seed))
        self._next_id = max(self._next_id, request_id + 1)
        return request_id

    def abort(self, request_id: int) -> bool:
        """Drop a request wherever it is; its cache slot is free for the next step. False if unknown."""
        found = self.scheduler.abort(request_id)
        if found is None:
            return False
        _, running_index = found
        if running_index is not None:
            self._keep_rows([i for i in range(len(self.state.root)) if i != running_index])
        return True

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def running(self) -> list[RequestState]:
        """The decoding rows, in batch order (read-only view)."""
        return self.scheduler.running

    def kv_usage(self) -> float:
        """Fraction of the KV budget (or of the allocated cache) the live sequences occupy."""
        s = self.scheduler
        used = sum(int(self.tcache.lengths[r.slot]) for r in s.running + s.prefilling)
        total = s.kv_budget_tokens or self.tcache.num_slots * max(self.tcache.capacity, 1)
        return min(1.0, used / total)

    def validate(self, request: Request) -> None:
        check_request(request, self.target.cfg.vocab_size, self.max_length)

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        """One forward of work; returns the requests that gained tokens (finished ones included)."""
        self._run_deferred_extend()
        self._pack_slots()
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        if plan.kind == "prefill":
            rows, new_tokens = self._prefill(plan.rows, plan.chunk), None
            self.last_shape = None
        else:
            rows, new_tokens = plan.rows, self._decode(plan.rows)
        outputs = self.outputs.process(rows, new_tokens)
        keep = self.scheduler.remove_finished()
        if self.state is not None and len(keep) < len(self.state.root):
            self._keep_rows(keep)
        return [o for o in outputs if o.new_token_ids or o.finished]

    # -- slots -----------------------------------------------------------------------------------
    def _allocate_slot(self) -> int:
        slot = self.tcache.allocate()
        if self.dcache is not None:
            while self.dcache.num_slots < self.tcache.num_slots:
                self.dcache.add_slots(self.tcache.num_slots - self.dcache.num_slots)
            self.dcache.in_use[slot] = True
            self.dcache.lengths[slot] = 0
        return slot

    def _free_slot(self, slot: int) -> None:
        self.tcache.free(slot)
        if self.dcache is not None:
            self.dcache.free(slot)

    def _pack_slots(self) -> None:
        """Put the running rows in slots 0..n-1, in batch order. The cache then reads the batch as views of
        itself; rows in scattered slots are gathered, a copy of every row's K/V per layer and step (56 % of
        a batch-64 decoding step, measured on SmolLM2). A finished row leaves a hole that the highest
        running row moves into (a prefilling row there swaps places), and rows that joined are sorted in."""
        running, n = self.scheduler.running, len(self.scheduler.running)
        if all(r.slot == i for i, r in enumerate(running)):  # the usual step: already packed
            return
        holes = sorted(set(range(n)) - {r.slot for r in running})
        movers = sorted((r for r in running if r.slot >= n), key=lambda r: r.slot)
        by_slot = {r.slot: r for r in self.scheduler.prefilling}
        for r, hole in zip(movers, holes):
            for cache in (self.tcache, self.dcache):
                if cache is not None:
                    cache.swap(r.slot, hole)
            if hole in by_slot:  # a prefilling row held the hole: it takes the mover's old slot
                by_slot[hole].slot = r.slot
            r.slot = hole
        order = sorted(range(n), key=lambda i: running[i].slot)
        if order != list(range(n)):
            self.scheduler.reorder_running(order)
            self.state = self.state.select(order)
            self._sampling = None

    def _keep_rows(self, keep: list[int]) -> None:
        self.state = self.state.select(keep) if keep else None
        self._sampling = None

    def _bucket(self, batch: int) -> int:
        """The batch-size bucket whose policy decodes `batch` rows."""
        return self.policy_batch or min(1 << (max(batch, 1) - 1).bit_length(), self.scheduler.max_num_seqs)

    def _policy_now(self, batch: int):
        if self.drafter is None:
            return None
        key = self._bucket(batch)
        self._policy_age += 1
        if key != self._policy_key or self._policy_age >= POLICY_RECHECK_STEPS:
            self.policy, self._policy_key, self._policy_age = self.policies.for_batch(key), key, 0
        return self.policy

    # -- prefill -------------------------------------------------------------------------------
    def _prefill(self, group: list[RequestState], t: int) -> list[RequestState]:
        """Prefill the next chunk (at most t tokens) of the prefilling rows; returns the rows whose prompt
        is now complete (their first token sampled), which join the running batch."""
        t0 = time.perf_counter()
        b = len(group)
        cnt = [min(t, len(r.request.prompt_ids) - r.done) for r in group]
        ids = torch.zeros(b, t + 1, dtype=torch.long)
        for j, r in enumerate(group):
            piece = r.request.prompt_ids[r.done : r.done + t + 1]
            ids[j, : len(piece)] = torch.tensor(piece)
        ids = ids.to(self.device)
        cnt_t = torch.tensor(cnt)
        slots = torch.tensor([r.slot for r in group], device=self.device)
        use_drafter = self.drafter is not None
        meta = self.tcache.prepare(slots, causal_mask(cnt_t.to(self.device), t))
        h, aux = self.target(ids[:, :t], meta.write_pos, self.tcache, meta, capture_aux=use_drafter, last_only=True)
        self.tcache.commit(slots, cnt_t)
        if use_drafter:
            self._deferred_extend = self._drafter_prompt_pairs(group, slots, ids, aux, t)
        for r, c in zip(group, cnt):
            r.done += c
            r.stats.target_forwards += 1
        complete = [j for j, r in enumerate(group) if r.prompt_done]
        joined = [group[j] for j in complete]
        if complete:
            sel = torch.tensor(complete, device=self.device)
            pick = (cnt_t[complete] - 1).to(self.device)[:, None, None]
            last_h = h.index_select(0, sel).gather(1, pick.expand(-1, 1, h.shape[-1]))
            logits = self.target.logits(last_h)  # [J, 1, V]
            batch = BatchSampling.of([r.params for r in joined], [r.seed for r in joined], self.device)
            next_pos = torch.tensor([[len(r.request.prompt_ids)] for r in joined])
            first = token_scores(logits, batch, next_pos, self.generator).argmax(-1)[:, 0]
            state = BatchState(first)
            if use_drafter:
                last_aux = aux.index_select(0, sel).gather(1, pick.expand(-1, 1, aux.shape[-1]))
                state = BatchState(first, first[:, None], last_aux,
                                   torch.ones(len(joined), dtype=torch.long, device=self.device))  # fmt: skip
            for r, tok in zip(joined, first.tolist()):
                r.output.append(tok)
                if self.spec.copied_tokens:
                    r.ngram = NgramIndex(r.request.prompt_ids + [tok])
            self.scheduler.start_decoding(joined)
            self.state = state if self.state is None else self.state.cat(state)
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
        window = self.spec.prefill_window
        policy = self.policies.for_batch(self._bucket(len(self.scheduler.running) + len(self.scheduler.prefilling)))
        if policy is not None and policy.backing_off:
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
        self.proposer.extend(self.dcache, slots, pair_ids, pair_aux, cnt * alive, chunk=t)
        self.stats.time_prefill += time.perf_counter() - t0

    # -- one decoding step -----------------------------------------------------------------------
    def _decode(self, rows: list[RequestState]) -> list[list[int]]:
        spec, state = self.spec, self.state
        t0 = time.perf_counter()
        b = len(rows)
        rows_arg = _rows_arg(rows, self.device)
        if self._sampling is None:
            self._sampling = BatchSampling.of([r.params for r in rows], [r.seed for r in rows], self.device)
        lengths = self.tcache.lengths[[r.slot for r in rows]]
        policy = self._policy_now(b)
        if policy is not None and policy.costs is not None:
            policy.costs.set_context(int(lengths.float().mean()))  # verification gets dearer with context
        plan = policy.plan() if policy is not None else None
        speculate = plan is not None
        if speculate and int(lengths.max()) + spec.shape.kept_nodes + spec.copied_tokens + 1 > self.max_length:
            speculate = False  # too close to the context end for a tree: finish with plain steps
        chains = None
        if speculate:
            logits_d, state_d = self.proposer.extend(self.dcache, rows_arg, state.ids, state.aux, state.cnt)
            auto = spec.mode == "auto"
            shape = plan if auto else FixedShape(spec.shape, spec.confidence)
            tree = self.proposer.propose(self.dcache, rows_arg, state.root, logits_d, state_d, shape=shape)
            chains = self._copied_chains(rows, policy if auto else None, tree)
            if chains is not None:
                tree, _ = merge_chains(tree, chains)
        else:
            tree = root_only(state.root)
        depth = int(tree.depth.max())
        t1 = time.perf_counter()
        positions = lengths.to(self.device)[:, None] + tree.depth
        meta = self.tcache.prepare(rows_arg, tree.mask, positions)
        h, aux = self.target(tree.tokens, positions, self.tcache, meta, capture_aux=self.drafter is not None)
        logits = self.target.logits(h)
        if spec.synthetic_acceptance is not None and speculate:
            acc = accept_synthetic(tree, logits, depth, list(spec.synthetic_acceptance), self.generator)
        else:
            acc = accept_greedy(tree, token_scores(logits, self._sampling, positions + 1, self.generator), depth)
        self.tcache.compact(rows_arg, acc.path, (acc.accepted + 1).cpu())
        t2 = time.perf_counter()
        path_tokens = tree.tokens.gather(1, acc.path)
        if speculate:
            nxt = torch.cat([path_tokens[:, 1:], acc.next_token[:, None]], dim=1)
            nxt.scatter_(1, acc.accepted[:, None], acc.next_token[:, None])
            path_aux = aux.gather(1, acc.path[:, :, None].expand(b, acc.path.shape[1], aux.shape[-1]))
            new_state = BatchState(acc.next_token, nxt, path_aux, acc.accepted + 1)
        elif self.drafter is not None:  # plain step: queue (state of root, next token) for the drafter
            new_state = state.with_pending(acc.next_token, aux[:, 0])
        else:
            new_state = BatchState(acc.next_token)
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
        if not self.spec.copied_tokens:
            return None
        chains = [r.ngram.lookup(self.spec.copied_tokens) for r in rows]
        if policy is not None:
            keep = policy.ngram_count([len(c) for c in chains], tree.num_draft)
            chains = [c[:keep] for c in chains]
        return chains if any(chains) else None


def _rows_arg(rows: list[RequestState], device):
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
