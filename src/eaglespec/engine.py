"""The decoding loop: prefill, then draft -> verify -> accept -> compact, for a batch of sequences.

Plain decoding is the same loop with a one-node tree and no drafter. Requests join the batch as
earlier ones finish (each owns a cache slot), so a batch never waits for its slowest member.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .kv_cache import ContextLengthError
from .models.drafter import Eagle3Drafter, check_pair
from .models.fast_linear import prepare_for_inference
from .models.llama import LlamaTarget
from .sampling import SamplingParams, make_generator, target_probs
from .spec.costs import load_or_calibrate
from .spec.ngram import NgramIndex, merge_chains
from .spec.policy import Policy, observe_acceptance
from .spec.proposer import EagleProposer, TreeShape, causal_mask
from .spec.synthetic import accept_synthetic
from .spec.tree import max_children, root_only
from .spec.verify import accept_greedy, accept_sampling
from .stats import SpecStats

StreamCallback = Callable[[int, list[int]], None]
MODES = ("auto", "tree", "chain", "off")
AUTO_WIDTHS = (1, 2, 4)  # drafting widths the policy chooses among (1 = chain)
AUTO_MAX_DEPTH = 8
AUTO_MAX_NODES = 48
NGRAM_MAX = 8  # most tokens copied from the context per step


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()


@dataclass
class Result:
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string), "length" (max_new_tokens or context)
    stats: SpecStats
    text: str | None = None


@dataclass
class BatchOutput:
    results: list[Result]
    stats: SpecStats  # aggregated; wall and phase times are the batch's own (not summed per row)


@dataclass
class _Row:
    index: int  # request index
    slot: int
    request: Request
    output: list[int] = field(default_factory=list)
    stats: SpecStats = field(default_factory=SpecStats)
    started: float = 0.0
    finish: str | None = None
    text: str | None = None
    ngram: NgramIndex | None = None  # prompt + output, for copying continuations (hybrid proposer)


class Engine:
    """Lossless speculative generation with an EAGLE-3/3.1 drafter (or plain decoding without one).

    mode: "auto" (the cost-aware policy, spec/policy.py, picks width, depth and nodes per step from
    calibrated costs; `tree` gives the maximum depth), "tree" (EAGLE-2 dynamic tree of `tree` shape),
    "chain" (`chain_k` tokens), "off".
    adaptive: plain steps while speculation measures slower (never changes output); False forces it.
    confidence: fixed shapes only: stop drafting below this cumulative draft probability.
    ngram_tokens: hybrid proposer: up to this many tokens copied from the context (prompt lookup) join
    each step's tree; auto picks how many per step from their measured acceptance (None: 8 for auto,
    0 for fixed shapes).
    """

    def __init__(
        self,
        target: LlamaTarget,
        drafter: Eagle3Drafter | None = None,
        *,
        mode: str = "tree",
        tree: TreeShape | None = None,
        chain_k: int = 4,
        tokenizer=None,
        prefill_chunk: int = 512,
        max_length: int | None = None,
        adaptive: bool = True,
        confidence: float = 0.0,
        ngram_tokens: int | None = None,
        synthetic_acceptance: list[float] | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if not 0.0 <= confidence < 1.0:
            raise ValueError(f"confidence must be in [0, 1), got {confidence!r}")
        if mode != "off" and drafter is None:
            mode = "off"
        self.target, self.tokenizer = target, tokenizer
        prepare_for_inference(target)
        self.mode = mode
        self.drafter = drafter if mode != "off" else None
        self.max_length = max_length or target.cfg.max_position_embeddings
        self.prefill_chunk = prefill_chunk
        self.shape = None
        if self.drafter is not None:
            check_pair(self.drafter, target)
            prepare_for_inference(self.drafter)
            if self.drafter.embed_tokens is None:
                self.drafter.attach_target_embedding(target.model.embed_tokens)
            target.set_aux_layers(tuple(self.drafter.cfg.aux_layer_ids or ()) or None)
            if mode == "auto":
                self.shape = TreeShape(tree.depth if tree else AUTO_MAX_DEPTH, max(AUTO_WIDTHS), AUTO_MAX_NODES)
            else:
                self.shape = TreeShape.chain(chain_k) if mode == "chain" else (tree or TreeShape())
            self.proposer = EagleProposer(self.drafter, self.shape)
        self.device = next(target.parameters()).device
        self.adaptive = adaptive
        # benchmarks only: accept by a given per-position profile instead of the target (not lossless)
        self.synthetic_acceptance = list(synthetic_acceptance) if synthetic_acceptance else None
        self.confidence = confidence
        if ngram_tokens is None:
            ngram_tokens = NGRAM_MAX if mode == "auto" else 0
        if not isinstance(ngram_tokens, int) or not 0 <= ngram_tokens <= NGRAM_MAX:
            raise ValueError(f"ngram_tokens must be an integer in [0, {NGRAM_MAX}], got {ngram_tokens!r}")
        self.ngram_tokens = ngram_tokens if self.drafter is not None else 0
        self.policy: Policy | None = None  # of the last generate call
        self._policies: dict[int, Policy] = {}  # per batch size: measurements persist across calls

    # -- public API ------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(
        self,
        requests: Sequence[Request],
        params: SamplingParams = SamplingParams(),
        *,
        batch_size: int = 1,
        on_tokens: StreamCallback | None = None,
    ) -> BatchOutput:
        """Generate for every request; at most `batch_size` run at once. on_tokens(i, ids) streams."""
        self._validate(requests, batch_size)
        self.policy = self._policy_for(min(batch_size, len(requests)))  # may calibrate: not timed
        t_start = time.perf_counter()
        gen = make_generator(params.seed, self.device)
        if params.seed is not None and self.device.type == "cpu":
            torch.manual_seed(params.seed)
        tcache = self.target.new_cache(batch_size, max_length=self.max_length)
        dcache = None
        if self.drafter is not None:
            extra = max(self.shape.top_k * self.shape.depth, NGRAM_MAX) + 1
            dcache = self.drafter.new_cache(batch_size, max_length=self.max_length + extra)
        batch_stats = SpecStats()
        waiting = list(range(len(requests)))
        rows: list[_Row] = []
        state = None  # batch tensors: root [B], pend_ids [B, E], pend_aux [B, E, A*H], pend_cnt [B]
        results: list[Result | None] = [None] * len(requests)
        while waiting or rows:
            if waiting and len(rows) < batch_size:
                take = [waiting.pop(0) for _ in range(min(batch_size - len(rows), len(waiting)))]
                new_rows, new_state = self._admit(take, requests, tcache, dcache, params, gen, batch_stats)
                rows += new_rows
                state = new_state if state is None else _cat_state(state, new_state)
                self._after_tokens(new_rows, None, on_tokens)
            else:
                new_tokens = self._step(rows, state, tcache, dcache, params, gen, batch_stats)
                state = new_tokens.pop()
                self._after_tokens(rows, new_tokens, on_tokens)
            done = [i for i, r in enumerate(rows) if r.finish is not None]
            if done:
                now = time.perf_counter()
                for i in done:
                    r = rows[i]
                    r.stats.wall_time = now - r.started
                    r.stats.new_tokens = len(r.output)
                    tcache.free(r.slot)
                    if dcache is not None:
                        dcache.free(r.slot)
                    results[r.index] = Result(r.request.prompt_ids, r.output, r.finish, r.stats, r.text)
                keep = [i for i in range(len(rows)) if i not in set(done)]
                rows = [rows[i] for i in keep]
                state = _select_state(state, keep) if keep else None
        batch_stats.wall_time = time.perf_counter() - t_start
        total = SpecStats()
        for r in results:
            total = total.merge(r.stats)
        for name in ("wall_time", "time_prefill", "time_draft", "time_verify", "time_other"):
            setattr(total, name, getattr(batch_stats, name))
        if self.tokenizer is not None:
            for r in results:
                if r.text is None:
                    r.text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        return BatchOutput(results, total)

    def _policy_for(self, batch: int) -> Policy | None:
        if self.drafter is None:
            return None
        if batch not in self._policies:
            if self.mode == "auto":
                costs = load_or_calibrate(self.target, self.drafter, batch)
                policy = Policy(costs, widths=AUTO_WIDTHS, max_depth=self.shape.depth, max_nodes=AUTO_MAX_NODES,
                                adaptive=self.adaptive)  # fmt: skip
            else:
                policy = Policy(None, widths=(self.shape.top_k,), max_depth=self.shape.depth, adaptive=self.adaptive)
            self._policies[batch] = policy
        policy = self._policies[batch]
        if policy.costs is not None and policy.calibration_suspect():
            policy.costs = load_or_calibrate(self.target, self.drafter, batch, force=True)
            policy.ratios.clear()
        policy.adaptive = self.adaptive
        return policy

    # -- internals -------------------------------------------------------------------------------
    def _validate(self, requests, batch_size):
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        vocab = self.target.cfg.vocab_size
        for i, r in enumerate(requests):
            if len(r.prompt_ids) == 0:
                raise ValueError(f"request {i}: the prompt is empty; give at least one token")
            if min(r.prompt_ids) < 0 or max(r.prompt_ids) >= vocab:
                raise ValueError(f"request {i}: prompt token ids must be in [0, {vocab})")
            if len(r.prompt_ids) >= self.max_length:
                raise ContextLengthError(
                    f"request {i}: the prompt has {len(r.prompt_ids)} tokens but the model context is "
                    f"{self.max_length}; shorten it to at most {self.max_length - 1} tokens"
                )
            if not isinstance(r.max_new_tokens, int) or r.max_new_tokens < 1:
                raise ValueError(f"request {i}: max_new_tokens must be an integer >= 1, got {r.max_new_tokens!r}")

    def _rows_arg(self, rows: list[_Row]):
        slots = [r.slot for r in rows]
        if slots == list(range(len(slots))):
            return None
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def _pick(self, logits, params, gen):
        if params.greedy:
            return logits.argmax(-1)
        return torch.multinomial(target_probs(logits, params), 1, generator=gen)[:, 0]

    def _admit(self, indices, requests, tcache, dcache, params, gen, batch_stats):
        """Prefill new requests (chunked) into free slots; returns their rows and batch state."""
        t0 = time.perf_counter()
        rows = []
        for i in indices:
            slot = tcache.allocate()
            if dcache is not None:
                while dcache.num_slots < tcache.num_slots:
                    dcache.add_slots(tcache.num_slots - dcache.num_slots)
                dcache.in_use[slot] = True
                dcache.lengths[slot] = 0
            rows.append(_Row(i, slot, requests[i], started=t0))
        b = len(rows)
        lens = torch.tensor([len(r.request.prompt_ids) for r in rows])
        n_max = int(lens.max())
        ids = torch.zeros(b, n_max + 1, dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, : lens[j]] = torch.tensor(r.request.prompt_ids)
        ids, lens_d = ids.to(self.device), lens.to(self.device)
        slots = torch.tensor([r.slot for r in rows], device=self.device)
        use_drafter = self.drafter is not None
        last_h = last_aux = None
        for c0 in range(0, n_max, self.prefill_chunk):
            t = min(self.prefill_chunk, n_max - c0)
            cnt = (lens_d - c0).clamp(0, t)
            meta = tcache.prepare(slots, causal_mask(cnt, t))
            pos = meta.write_pos
            h, aux = self.target(ids[:, c0 : c0 + t], pos, tcache, meta, capture_aux=use_drafter)
            tcache.commit(slots, cnt.cpu())
            pick = (cnt - 1).clamp(min=0)[:, None, None]
            has = (cnt > 0)[:, None]
            h_last = h.gather(1, pick.expand(b, 1, h.shape[-1]))[:, 0]
            last_h = h_last if last_h is None else torch.where(has, h_last, last_h)
            if use_drafter:
                a_last = aux.gather(1, pick.expand(b, 1, aux.shape[-1]))[:, 0]
                last_aux = a_last if last_aux is None else torch.where(has, a_last, last_aux)
                # drafter pairs (state at t, token t+1) for t < n-1; the last one waits for the sampled token
                d_cnt = (lens_d - 1 - c0).clamp(0, t)
                self.proposer.extend(dcache, slots, ids[:, c0 + 1 : c0 + 1 + t], aux, d_cnt, chunk=t)
        first = self._pick(self.target.logits(last_h), params, gen)
        state = {
            "root": first,
            "ids": first[:, None] if use_drafter else None,
            "aux": last_aux[:, None] if use_drafter else None,
            "cnt": torch.ones(b, dtype=torch.long, device=self.device) if use_drafter else None,
        }
        firsts = first.tolist()
        for r, tok in zip(rows, firsts):
            r.output.append(tok)
            if self.ngram_tokens:
                r.ngram = NgramIndex(r.request.prompt_ids + [tok])
            r.stats.prompt_tokens = len(r.request.prompt_ids)
            r.stats.target_forwards += -(-len(r.request.prompt_ids) // self.prefill_chunk)
        dt = time.perf_counter() - t0
        batch_stats.time_prefill += dt
        for r in rows:
            r.stats.time_prefill += dt
        return rows, state

    def _step(self, rows, state, tcache, dcache, params, gen, batch_stats):
        t0 = time.perf_counter()
        b = len(rows)
        rows_arg = self._rows_arg(rows)
        self.active_rows = rows  # read-only view for instrumentation (drift tools, rigged test proposers)
        root = state["root"]
        lengths = tcache.lengths[[r.slot for r in rows]]
        policy = self.policy
        plan = policy.plan() if policy is not None else None
        speculate = plan is not None
        if speculate and int(lengths.max()) + self.shape.kept_nodes + self.ngram_tokens + 1 > self.max_length:
            speculate = False  # too close to the context end for a tree: finish with plain steps
        if speculate:
            logits_d, state_d = self.proposer.extend(dcache, rows_arg, state["ids"], state["aux"], state["cnt"])
            auto = policy if self.mode == "auto" else None
            tree = self.proposer.propose(dcache, rows_arg, root, logits_d, state_d, width=plan.top_k, policy=auto,
                                         confidence=self.confidence)  # fmt: skip
            chains = self._copied_chains(rows, auto, tree)
            if chains is not None:
                tree, _ = merge_chains(tree, chains)
        else:
            tree, chains = root_only(root), None
        depth = int(tree.depth.max())
        t1 = time.perf_counter()
        base = lengths.to(self.device)[:, None]
        positions = base + tree.depth
        meta = tcache.prepare(rows_arg, tree.mask, positions)
        h, aux = self.target(tree.tokens, positions, tcache, meta, capture_aux=self.drafter is not None)
        logits = self.target.logits(h)
        if self.synthetic_acceptance is not None and speculate:
            acc = accept_synthetic(tree, logits, depth, self.synthetic_acceptance, gen)
        elif params.greedy:
            acc = accept_greedy(tree, logits, depth)
        else:
            acc = accept_sampling(tree, target_probs(logits, params), depth, max_children(tree), gen)
        tcache.compact(rows_arg, acc.path, (acc.accepted + 1).cpu())
        t2 = time.perf_counter()
        path_tokens = tree.tokens.gather(1, acc.path)
        new_state = {"root": acc.next_token, "ids": None, "aux": None, "cnt": None}
        if speculate:
            nxt = torch.cat([path_tokens[:, 1:], acc.next_token[:, None]], dim=1)
            nxt.scatter_(1, acc.accepted[:, None], acc.next_token[:, None])
            new_state["ids"] = nxt
            new_state["aux"] = aux.gather(1, acc.path[:, :, None].expand(b, acc.path.shape[1], aux.shape[-1]))
            new_state["cnt"] = acc.accepted + 1
        elif self.drafter is not None:  # plain step: queue (state of root, next token) for the drafter
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
            policy.observe(speculate, sum(len(o) for o in out), t3 - t0, shape)
        batch_stats.time_draft += t1 - t0
        batch_stats.time_verify += t2 - t1
        batch_stats.time_other += t3 - t2
        for r in rows:
            r.stats.time_draft += t1 - t0
            r.stats.time_verify += t2 - t1
            r.stats.time_other += t3 - t2
        out.append(new_state)
        return out

    def _copied_chains(self, rows, policy, tree) -> list[list[int]] | None:
        """Continuations copied from each row's context; with the policy, only as many tokens per step
        as their measured acceptance pays for. None when there is nothing to add."""
        if not self.ngram_tokens:
            return None
        chains = [r.ngram.lookup(self.ngram_tokens) for r in rows]
        if policy is not None:
            keep = policy.ngram_count([len(c) for c in chains], tree.num_draft)
            chains = [c[:keep] for c in chains]
        return chains if any(chains) else None

    def _after_tokens(self, rows, new_tokens, on_tokens):
        """Append accepted tokens (None: just admitted, first token already in place), stop, stream."""
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
            if req.stop_strings and self.tokenizer is not None:
                hit = self._stop_string(r, start, cut or len(r.output))
                if hit is not None:
                    cut, reason = hit
            if cut is not None:
                del r.output[cut:]
                r.finish = reason
            elif len(req.prompt_ids) + len(r.output) >= self.max_length:
                r.finish = "length"
            if on_tokens is not None and len(r.output) > start:
                on_tokens(r.index, r.output[start:])

    def _stop_string(self, r: _Row, start: int, end: int):
        decode = self.tokenizer.decode
        for j in range(start, end):
            text = decode(r.output[: j + 1], skip_special_tokens=True)
            for s in r.request.stop_strings:
                pos = text.find(s)
                if pos >= 0:
                    r.text = text[:pos]
                    return j + 1, "stop"
        return None


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


def _append_pending(state: dict, aux: torch.Tensor, token: torch.Tensor) -> dict:
    """Add one (aux state, next token) pair after each row's pending pairs."""
    ids, pend_aux, cnt = state["ids"], state["aux"], state["cnt"]
    ids = torch.nn.functional.pad(ids, (0, 1))
    pend_aux = torch.nn.functional.pad(pend_aux, (0, 0, 0, 1))
    rows = torch.arange(ids.shape[0], device=ids.device)
    ids[rows, cnt] = token
    pend_aux[rows, cnt] = aux
    return {"ids": ids, "aux": pend_aux, "cnt": cnt + 1}


def _select_state(state: dict, keep: list[int]) -> dict:
    idx = torch.tensor(keep, device=state["root"].device)
    return {k: (v.index_select(0, idx) if v is not None else None) for k, v in state.items()}
