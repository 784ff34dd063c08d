"""Cost-aware speculation policy: whether to speculate, how deep to draft, how wide, how many nodes.

Expected tokens of a step. With greedy verification the accepted path is unique, so the expected
number of accepted draft tokens is the sum over verified nodes v of P(v is on the accepted path) =
P(every token on the path root..v is the target's choice). EAGLE-2 observed that the drafter's
cumulative probability along the path, exp(score_v), estimates this well; we calibrate it per depth
online: q(v) = min(1, alpha[depth] * exp(score_v)), alpha = observed accepted nodes / predicted. Nodes
copied from the context (n-grams) get q = beta[j], the measured chance that the first j copied tokens
are right. A step that verifies the node set S costs C = draft + verify(|S| + 1) seconds (calibrated,
speculation/costs.py) and yields B + sum_S q tokens over B rows, so the policy

- keeps the n best nodes (by q; top-n is ancestor-closed because q never grows along a path) with n
  maximising (B + S_n) / (draft + verify(n + 1)), n = 0 meaning "root only";
- stops drafting deeper (confidence-based drafting) as soon as the next level's expected nodes
  (frontier q times the conditional probabilities the last level showed) could not raise that value:
  a confidence threshold on the frontier that follows from the measured costs instead of being a
  fixed number;
- picks the drafting width (top-k 1 = chain, 2, 4, ...) per batch size by measured throughput
  (a small bandit that keeps probing the other widths now and then);
- turns speculation off when measured speculative throughput falls below plain decoding's (plain
  rate from calibration, refreshed by measured plain steps), probing again with exponential back-off;
- does not draft at all where the measured costs say it cannot gain 15% even with good drafts
  (`speculation_ceiling`): at large batches on a CPU a row's extra verified token costs nearly a whole
  step, and learning that by measurement (and feeding the drafter every prompt) cost 7-34% of
  throughput at batch 64-256 on SmolLM2 (32-token replies).

Only what is proposed changes, never what is accepted, so every decision here is lossless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .costs import StepCosts
from .tree import depth_table

OPTIMISTIC_ACCEPTANCE = 0.75  # per depth, a good draft token's chance to be right (SmolLM2's drafter: 0.74 at depth 1)


@dataclass
class AcceptanceModel:
    """Online calibration of draft confidence (alpha per depth), n-gram accuracy (beta per depth) and
    how far accepted paths reach (per depth d: of the rows whose verified tree reached d, the share that
    accepted d tokens, drafted or copied). Counts decay by `decay` per update so estimates follow the text
    being generated. One per batch bucket: reach depends on the trees a bucket verifies (wide at batch 1,
    one node a row at 16)."""

    max_depth: int = 16
    prior: float = 4.0  # pseudo-counts: alpha starts at 1 (trust the drafter), beta at prior_beta
    prior_beta: float = 0.3
    decay: float = 0.98
    obs: list[float] = field(default_factory=list)
    pred: list[float] = field(default_factory=list)
    ng_hit: list[float] = field(default_factory=list)
    ng_try: list[float] = field(default_factory=list)
    reach_hit: list[float] = field(default_factory=list)
    reach_try: list[float] = field(default_factory=list)

    def __post_init__(self):
        d = self.max_depth + 1
        self.obs = self.obs or [self.prior] * d
        self.pred = self.pred or [self.prior] * d
        self.ng_hit = self.ng_hit or [self.prior * self.prior_beta**j for j in range(d)]
        self.ng_try = self.ng_try or [self.prior] * d
        self.reach_hit = self.reach_hit or [self.prior * OPTIMISTIC_ACCEPTANCE**j for j in range(d)]
        self.reach_try = self.reach_try or [self.prior] * d

    def alpha(self) -> torch.Tensor:
        return torch.tensor([o / p for o, p in zip(self.obs, self.pred)])

    def eagle_q(self, scores: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """scores [.., M] cumulative log-probs, depths [.., M] -> q [.., M] in [0, 1]."""
        a = self.alpha().to(scores.device)[depths.clamp(max=self.max_depth)]
        return (a * scores.float().exp()).clamp(max=1.0)

    def ngram_q(self, length: int) -> list[float]:
        """q of the first `length` copied tokens (non-increasing)."""
        out, last = [], 1.0
        for j in range(1, min(length, self.max_depth) + 1):
            last = min(last, self.ng_hit[j] / self.ng_try[j])
            out.append(last)
        return out

    def observe_eagle(self, predicted: list[float], accepted: list[float]) -> None:
        """Per depth d: predicted = sum of exp(score) over verified EAGLE nodes at depth d, accepted =
        how many of them were on an accepted path (summed over rows)."""
        for d in range(1, min(len(predicted), self.max_depth + 1)):
            if predicted[d] > 0:
                self.obs[d] = self.decay * self.obs[d] + accepted[d]
                self.pred[d] = self.decay * self.pred[d] + predicted[d]

    def reach(self, depth: int) -> list[float]:
        """P(the accepted path reaches depth d | the verified tree did), d = 1..depth, non-increasing;
        before any measurement OPTIMISTIC_ACCEPTANCE**d."""
        out, last = [], 1.0
        for d in range(1, depth + 1):
            j = min(d, self.max_depth)
            last = min(last, self.reach_hit[j] / self.reach_try[j])
            out.append(last)
        return out

    def observe_reach(self, tried: list[float], reached: list[float]) -> None:
        """Per depth d: rows whose verified tree reached depth d, and how many of them accepted d tokens."""
        for d in range(1, min(len(tried), self.max_depth + 1)):
            if tried[d]:
                self.reach_hit[d] = self.decay * self.reach_hit[d] + reached[d]
                self.reach_try[d] = self.decay * self.reach_try[d] + tried[d]

    def observe_ngram(self, tried: list[int], hits: list[int]) -> None:
        """tried[j] chains whose first j tokens could be judged, hits[j] of them right."""
        for j in range(1, min(len(tried), self.max_depth + 1)):
            if tried[j]:
                self.ng_hit[j] = self.decay * self.ng_hit[j] + hits[j]
                self.ng_try[j] = self.decay * self.ng_try[j] + tried[j]


# speculation is tried only where it could gain at least this much: the drafter's prompt pairs and the policy's
# measuring steps are paid before any gain (SmolLM2, 32-token replies: 0.98x plain at batch 16, ceiling 1.07)
MIN_CEILING_GAIN = 1.15
REACH_PROBE_EVERY = 256  # steps between probes of a bucket whose measured acceptance says drafting cannot pay


def speculation_ceiling(costs: StepCosts, q: float = OPTIMISTIC_ACCEPTANCE, max_depth: int = 8,
                        reach: list[float] | None = None) -> float:  # fmt: skip
    """The most speculation could gain over plain decoding at these step costs: the best chain of n
    nodes (n drafter forwards, the node at depth d right with probability reach[d-1], by default q**d)
    in tokens per second, over plain steps'."""
    rows, plain = costs.batch, costs.verify_cost(1)
    best, expected = 0.0, 1.0
    for n in range(1, min(max_depth, costs.max_verify_tokens - 1) + 1):
        expected += reach[n - 1] if reach is not None else q**n
        best = max(best, expected * plain / (n * costs.draft_cost(1) + costs.verify_cost(n + 1)))
    return best if rows > 0 else 0.0


def best_node_count(q_sorted: torch.Tensor, rows: int, draft_seconds: float, costs: StepCosts,
                    max_nodes: int) -> tuple[int, float]:  # fmt: skip
    """q_sorted [B, M] per-row q values sorted descending. Returns (n, tokens per second) maximising
    (B + sum over rows of the n best q) / (draft_seconds + verify(n + 1)), n in 0..min(M, max_nodes)."""
    m = min(q_sorted.shape[-1], max_nodes, costs.max_verify_tokens - 1)
    gains = [0.0] + (q_sorted[:, :m].float().sum(0).cumsum(0).tolist() if m > 0 else [])
    verify = costs.verify_costs(m + 1)
    values = [(rows + g) / (draft_seconds + v) for g, v in zip(gains, verify)]
    best_n = max(range(m + 1), key=values.__getitem__)
    return best_n, values[best_n]


def level_pays(value_now: float, tokens_now: float, seconds_now: float, n_now: int, next_gains: torch.Tensor,
               costs: StepCosts, level_seconds: float, max_nodes: int) -> bool:  # fmt: skip
    """Could one more drafted level raise the step's tokens per second? next_gains[m-1]: expected
    tokens (summed over rows) of the m most likely nodes the next level is expected to add."""
    for m in range(1, min(next_gains.numel(), max_nodes - n_now) + 1):
        v = (tokens_now + float(next_gains[m - 1])) / (seconds_now + level_seconds + costs.verify_cost(n_now + m + 1))
        if v > value_now * 1.0001:
            return True
    return False


@dataclass
class StepPlan:
    """A speculative step's shape, decided by the policy level by level (the proposer's DraftShape):
    width `top_k`, at most `depth` levels, each further level and the verified node count chosen to
    maximise expected tokens per second."""

    policy: Policy
    top_k: int
    depth: int

    def keep_drafting(self, level: int, scores: list[torch.Tensor], depths: list[int], frontier: torch.Tensor,
                      cond: torch.Tensor) -> bool:  # fmt: skip
        acc, p = self.policy.acceptance, self.policy
        # the next level's children, guessed from the conditional log-probs this level showed
        guess = (frontier[:, :, None] + cond[:, None, :]).reshape(frontier.shape[0], -1)
        nxt = acc.eagle_q(guess, torch.full_like(guess, level + 1, dtype=torch.long))
        q = acc.eagle_q(torch.cat(scores, 1), depth_table(scores, depths))
        return p.keep_drafting(level, q, nxt, p.draft_seconds(level, self.top_k))

    def num_nodes(self, scores: torch.Tensor, depths: torch.Tensor, levels: int) -> int:
        p = self.policy
        return p.node_count(p.acceptance.eagle_q(scores, depths), p.draft_seconds(levels, self.top_k))


class Policy:
    """Per batch size: speculation on/off, drafting width and per-step depth/node choices.

    costs None: a fixed shape (the caller's); only the on/off decision is made, from measured rates.
    adaptive False: always speculate (measurements of a forced shape)."""

    def __init__(self, costs: StepCosts | None, *, widths=(1, 2, 4), max_depth: int = 8, max_nodes: int = 64,
                 adaptive: bool = True, acceptance: AcceptanceModel | None = None,
                 judge_after: int = 3, probe_every: int = 48, alpha: float = 0.3):  # fmt: skip
        self.costs = costs
        if costs is not None:
            widths = tuple(w for w in widths if costs.draft_cost(w) < math.inf) or (1,)
        self.widths = tuple(widths)
        self.max_depth, self.max_nodes, self.adaptive = max_depth, max_nodes, adaptive
        self.acceptance = acceptance or AcceptanceModel(max_depth=max(16, max_depth))
        self.judge_after, self.probe_every, self.ema = judge_after, probe_every, alpha
        # tokens/s of plain steps: from calibration when there is one, refreshed by measured plain steps
        self.plain_rate = costs.batch / costs.verify_cost(1) if costs is not None else None
        # the calibrated rate is taken at a fixed context (speculation/costs.py), often longer than the one being
        # decoded, where plain steps are cheaper: speculation is judged against measured plain steps
        self.plain_measured = False
        self.batch = costs.batch if costs is not None else None
        self.rates: dict[int, float | None] = {w: None for w in self.widths}  # measured, per width
        self.tries: dict[int, int] = {w: 0 for w in self.widths}
        self.width = max(self.widths)
        self.streak = 0  # speculative steps since the last plain one
        self.plain_left = 0
        self.backoff = 8
        self.steps = 0
        self.plain_steps = 0
        self.chosen: list[tuple[int, int, int]] = []  # (width, depth, nodes) per speculative step
        # measured minus calibrated seconds per step (tree building, acceptance, bookkeeping, a busy
        # machine): an additive term in every expected-rate formula
        self.overhead_spec = 0.0
        self.overhead_plain = 0.0
        self.ratios: list[float] = []  # measured / calibrated step time, to notice a stale calibration
        self.rescaled = False  # at most once: a machine that stays far from any calibration is busy

    # -- before a step ---------------------------------------------------------------------------
    @property
    def can_pay(self) -> bool:
        """False where the step costs (at the rows' current context) say speculation cannot gain
        MIN_CEILING_GAIN at the acceptance this bucket measured so far (optimistic until measured): then no
        drafting at all, but for a probe every REACH_PROBE_EVERY steps where the optimistic ceiling would pay
        (the text may have changed). SmolLM2's drafter reaches depth 1 in ~40% of rows in 16-row batches of
        mixed prompts, where a 16-row step with 2 tokens a row costs 1.4x one with 1: a ceiling below 1.0."""
        if self.costs is None:
            return True
        reach = self.acceptance.reach(self.max_depth)
        if speculation_ceiling(self.costs, max_depth=self.max_depth, reach=reach) >= MIN_CEILING_GAIN:
            return True
        return self.steps % REACH_PROBE_EVERY == 0 and \
            speculation_ceiling(self.costs, max_depth=self.max_depth) >= MIN_CEILING_GAIN  # fmt: skip

    def plan(self) -> StepPlan | None:
        """The drafting plan for the next step, or None for a plain step."""
        self.steps += 1
        if self.adaptive:
            if not self.can_pay:
                return None
            if self.plain_left > 0:
                return None
            if not self.plain_measured and self.streak >= self.judge_after:
                self.plain_left = 2  # no measured plain rate yet: measure it
                return None
        self.width = self._pick_width()
        return StepPlan(self, self.width, self.max_depth)

    @property
    def backing_off(self) -> bool:
        """In a run of plain steps because speculation measured slower (not a short plain-rate probe) or
        cannot pay at these costs."""
        return self.adaptive and (self.plain_left > 2 or not self.can_pay)

    def _pick_width(self) -> int:
        if len(self.widths) == 1:
            return self.widths[0]
        untried = [w for w in self.widths if self.tries[w] < self.judge_after]
        if untried:
            return max(untried)
        if self.steps % 16 == 0:  # keep the others' measurements fresh
            return self.widths[(self.steps // 16) % len(self.widths)]
        return max(self.widths, key=lambda w: self.rates[w] or 0.0)

    # -- while drafting --------------------------------------------------------------------------
    def keep_drafting(self, level: int, q: torch.Tensor, next_q: torch.Tensor, draft_seconds: float) -> bool:
        """After `level` drafted levels: q [B, M] candidates so far; next_q [B, K] the expected q of the
        nodes the next level would add (frontier q times the last level's conditional probabilities)."""
        if level >= self.max_depth:
            return False
        b = q.shape[0]
        q_sorted = q.sort(dim=-1, descending=True).values
        n, value = best_node_count(q_sorted, b, draft_seconds, self.costs, self.max_nodes)
        tokens = value * (draft_seconds + self.costs.verify_cost(n + 1))
        gains = next_q.sort(dim=-1, descending=True).values.float().sum(0).cumsum(0).cpu()
        k = self.width
        return level_pays(value, tokens, draft_seconds, n, gains, self.costs, self.costs.draft_cost(k),
                          self.max_nodes)  # fmt: skip

    def node_count(self, q: torch.Tensor, draft_seconds: float) -> int:
        q_sorted = q.sort(dim=-1, descending=True).values
        n, value = best_node_count(q_sorted, q.shape[0], draft_seconds, self.costs, self.max_nodes)
        self._last = (n, value * (draft_seconds + self.costs.verify_cost(n + 1)), draft_seconds)
        return n

    def ngram_count(self, lengths: list[int], tree_nodes: int) -> int:
        """How many copied tokens to add per row (same for every row) after the drafter's tree of
        `tree_nodes` nodes: the count maximising expected tokens per second, each copied token j
        worth beta[j] (measured) in every row whose copy is that long."""
        longest = max(lengths, default=0)
        if longest == 0 or not hasattr(self, "_last"):
            return 0
        _, tokens, draft = self._last
        beta = self.acceptance.ngram_q(longest)
        best_j, best_v, gain = 0, tokens / (draft + self.costs.verify_cost(tree_nodes + 1)), 0.0
        for j in range(1, len(beta) + 1):
            gain += beta[j - 1] * sum(1 for n in lengths if n >= j)
            v = (tokens + gain) / (draft + self.costs.verify_cost(tree_nodes + j + 1))
            if v > best_v:
                best_j, best_v = j, v
        return best_j

    def draft_seconds(self, levels: int, width: int) -> float:
        """Predicted non-verification time of a speculative step: the extend (about one width-1
        forward), each tree level, and the measured per-step overhead."""
        return self.costs.draft_cost(1) + max(levels - 1, 0) * self.costs.draft_cost(width) + self.overhead_spec

    def predicted_seconds(self, shape: tuple[int, int, int] | None) -> float | None:
        """Calibrated seconds of a step (without the measured overhead); shape None = plain."""
        if self.costs is None:
            return None
        if shape is None:
            return self.costs.verify_cost(1)
        width, depth, nodes = shape
        return self.costs.draft_cost(1) + max(depth - 1, 0) * self.costs.draft_cost(width) + \
            self.costs.verify_cost(nodes + 1)

    def _stale_ratio(self) -> float | None:
        """The median measured / calibrated step time of the last 32 steps, when it is persistently far
        from 1 (the calibration was taken on a busy machine, or the machine changed); else None."""
        if len(self.ratios) < 16:
            return None
        mid = sorted(self.ratios[-32:])[len(self.ratios[-32:]) // 2]
        return None if 0.5 <= mid <= 2.0 else mid

    def calibration_suspect(self) -> bool:
        return self._stale_ratio() is not None

    def recheck_calibration(self) -> None:
        """Once, when measured steps stay far from the calibration: scale every cost by their median
        ratio. Not measured again: that stalls every running request (about a minute through llama.cpp,
        whose calibration prefills a 4K context, measured inside a request's step)."""
        ratio = None if self.costs is None or self.rescaled else self._stale_ratio()
        if ratio is None:
            return
        self.costs = self.costs.scaled(ratio)
        self.ratios.clear()
        self.rescaled = True

    # -- after a step ----------------------------------------------------------------------------
    def observe(self, speculated: bool, tokens: int, seconds: float, shape: tuple[int, int, int] | None = None,
                rows: int | None = None):  # fmt: skip
        """After a step: `tokens` emitted over all rows in `seconds`; shape = (width, depth, nodes);
        rows: the step's batch size (None: the calibrated one). A policy serves a bucket of batch sizes,
        so only steps at the calibrated size say whether the calibration is stale."""
        rate = tokens / max(seconds, 1e-9)
        predicted = self.predicted_seconds(shape if speculated else None)
        if predicted is not None and (shape is not None or not speculated):
            if rows is None or rows == self.costs.batch:
                self.ratios.append(seconds / predicted)
            extra = max(0.0, seconds - predicted)
            if speculated:
                self.overhead_spec = (1 - self.ema) * self.overhead_spec + self.ema * extra
            else:
                self.overhead_plain = (1 - self.ema) * self.overhead_plain + self.ema * extra
        if not speculated:
            self.plain_steps += 1
            self.plain_measured = True
            fresh = self.plain_rate is None or self.streak > 0
            self.plain_rate = rate if fresh else (1 - self.ema) * self.plain_rate + self.ema * rate
            self.plain_left = max(0, self.plain_left - 1)
            self.streak = 0
            return
        w = self.width
        self.tries[w] = self.tries.get(w, 0) + 1
        old = self.rates.get(w)
        fresh = old is None or self.streak == 0  # first step after plain ones: the text may have changed
        self.rates[w] = rate if fresh else (1 - self.ema) * old + self.ema * rate
        if shape is not None:
            self.chosen.append(shape)
        self.streak += 1
        if not self.adaptive or self.streak < self.judge_after or not self.plain_measured:
            return
        best = max((r for r in self.rates.values() if r is not None), default=0.0)
        if best < self.plain_rate:
            self.plain_left = self.backoff  # nothing pays now: plain steps, then probe again
            self.backoff = min(2 * self.backoff, 512)
        else:
            self.backoff = 8
            if self.streak >= self.probe_every:
                self.plain_left = 1  # refresh the plain rate now and then

    def summary(self) -> dict:
        """What the policy chose: widths, mean depth and nodes of speculative steps, measured rates."""
        n = len(self.chosen)
        out = {"speculative_steps": n, "plain_steps": self.plain_steps,
               "plain_rate": round(self.plain_rate, 1) if self.plain_rate else None,
               "rates": {w: (round(r, 1) if r else None) for w, r in self.rates.items()}}  # fmt: skip
        if n:
            out["mean_depth"] = round(sum(c[1] for c in self.chosen) / n, 2)
            out["mean_nodes"] = round(sum(c[2] for c in self.chosen) / n, 2)
            counts: dict[int, int] = {}
            for c in self.chosen:
                counts[c[0]] = counts.get(c[0], 0) + 1
            out["width_share"] = {w: round(c / n, 3) for w, c in sorted(counts.items())}
        return out


def observe_acceptance(model: AcceptanceModel, tree, acc) -> None:
    """Feed one verified step to the confidence calibration: per depth, the predicted sum of
    exp(score) over the drafter's nodes and how many of them were on the accepted path."""
    score, depth = tree.score, tree.depth
    d_max = int(depth.max())
    if d_max == 0:
        return
    eagle = torch.isfinite(score) & (depth > 0)
    p = torch.where(eagle, score.float().exp(), torch.zeros_like(score, dtype=torch.float32))
    predicted = torch.zeros(d_max + 1).scatter_add_(0, depth.flatten().cpu(), p.flatten().cpu())
    steps = torch.arange(acc.path.shape[1], device=acc.path.device)
    on_path = (steps[None] <= acc.accepted[:, None]) & (steps[None] > 0)
    path_eagle = eagle.gather(1, acc.path) & on_path
    accepted = path_eagle.sum(0).float().cpu().tolist() + [0.0] * (d_max + 1 - path_eagle.shape[1])
    model.observe_eagle(predicted.tolist(), accepted)
    # reach counts every accepted token, the drafter's and those copied from the context (at long context the
    # copies carry much of the acceptance: the drafter's own nodes alone put the ceiling below 1.15 at 4K)
    model.observe_reach(_at_least(depth.amax(1), d_max), _at_least(acc.accepted, d_max))


def _at_least(values: torch.Tensor, top: int) -> list[float]:
    """[number of values >= d for d in 0..top], from one histogram (no loop of small ops per step)."""
    counts = torch.bincount(values.clamp(0, top).long().flatten(), minlength=top + 1)
    return counts.flip(0).cumsum(0).flip(0).float().tolist()
