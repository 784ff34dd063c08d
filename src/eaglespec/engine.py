"""The engine: a target (and drafter) with its speculation settings and policy; `generate` runs a batch
of requests to completion as a loop over the step-level core (core.py).

Plain decoding is the same loop with a one-node tree and no drafter. Requests join the batch as
earlier ones finish (each owns a cache slot), so a batch never waits for its slowest member.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from .core import EngineCore
from .models.drafter import Eagle3Drafter, check_pair
from .models.fast_linear import prepare_for_inference
from .models.llama import LlamaTarget
from .sampling import SamplingParams
from .speculation.costs import load_or_calibrate
from .speculation.policy import Policy
from .speculation.proposer import EagleProposer, TreeShape
from .stats import SpecStats

StreamCallback = Callable[[int, list[int]], None]
MODES = ("auto", "tree", "chain", "off")
AUTO_WIDTHS = (1, 2, 4)  # drafting widths the policy chooses among (1 = chain)
AUTO_MAX_DEPTH = 8
AUTO_MAX_NODES = 48
NGRAM_MAX = 8  # most tokens copied from the context per step
DRAFT_PREFILL_WINDOW = 128  # prompt pairs fed to the drafter at prefill (None: all); BENCHMARKS §10


@dataclass
class Request:
    prompt_ids: list[int]
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    params: SamplingParams | None = None  # None: the settings given to generate (or the server's default)


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


class Engine:
    """Lossless speculative generation with an EAGLE-3/3.1 drafter (or plain decoding without one).

    mode: "auto" (the cost-aware policy, speculation/policy.py, picks width, depth and nodes per step from
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
        draft_prefill_window: int | None = DRAFT_PREFILL_WINDOW,
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
        if draft_prefill_window is not None and (not isinstance(draft_prefill_window, int) or draft_prefill_window < 0):
            raise ValueError(f"the drafter's prefill window (draft_prefill_window) must be an integer >= 0 "
                             f"(0 or None: the whole prompt), got {draft_prefill_window!r}")  # fmt: skip
        self.draft_prefill_window = draft_prefill_window or None
        if ngram_tokens is None:
            ngram_tokens = NGRAM_MAX if mode == "auto" else 0
        if not isinstance(ngram_tokens, int) or not 0 <= ngram_tokens <= NGRAM_MAX:
            raise ValueError(f"ngram_tokens must be an integer in [0, {NGRAM_MAX}], got {ngram_tokens!r}")
        self.ngram_tokens = ngram_tokens if self.drafter is not None else 0
        # cache positions a step may write past a row's committed tokens (tree nodes, copied tokens)
        self.tree_slack = max(self.shape.top_k * self.shape.depth, NGRAM_MAX) + 1 if self.drafter is not None else 1
        self.policy: Policy | None = None  # of the last step
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
        """Generate for every request; at most `batch_size` run at once. on_tokens(i, ids) streams.

        Requests without their own `params` use `params`; its seed seeds the batch's shared generator
        (reproducible for the same requests and batch size), while a request's own seed makes that
        request reproducible whatever runs beside it."""
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        core = EngineCore(self, max_num_seqs=batch_size, max_num_batched_tokens=self.prefill_chunk * batch_size,
                          default_params=replace(params, seed=None), seed=params.seed,
                          policy_batch=min(batch_size, len(requests)) or 1)  # fmt: skip
        for i, r in enumerate(requests):
            try:
                core.validate(r)
            except ValueError as e:
                raise type(e)(f"request {i}: {e}") from None
        self.policy = self._policy_for(core.policy_batch)  # may calibrate: not timed
        if params.seed is not None and self.device.type == "cpu":
            torch.manual_seed(params.seed)
        t_start = time.perf_counter()
        for i, r in enumerate(requests):
            core.add_request(r, request_id=i)
        results: list[Result | None] = [None] * len(requests)
        while core.has_work:
            for out in core.step():
                if on_tokens is not None and out.new_token_ids:
                    on_tokens(out.request_id, out.new_token_ids)
                if out.finished:
                    r = requests[out.request_id]
                    results[out.request_id] = Result(r.prompt_ids, out.output_ids, out.finish_reason, out.stats,
                                                     out.text)  # fmt: skip
        total = SpecStats()
        for r in results:
            total = total.merge(r.stats)
        core.stats.wall_time = time.perf_counter() - t_start
        for name in ("wall_time", "time_prefill", "time_draft", "time_verify", "time_other"):
            setattr(total, name, getattr(core.stats, name))
        if self.tokenizer is not None:
            for r in results:
                if r.text is None:
                    r.text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        return BatchOutput(results, total)

    def exercise(self, batch_sizes=(1, 2)) -> None:
        """Run every kind of step once on random prompts (prefill, plain steps with and without the
        drafter's state capture, drafter extend and tree levels, verification; uniform and ragged batches
        with rows leaving early), so that compiled graphs (models/compiled.py) are built now rather than
        inside a user's request. Output is discarded; policies and statistics are not touched."""
        g = torch.Generator().manual_seed(0)
        vocab = self.target.cfg.vocab_size
        prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (40, 23)]
        engines = [Engine(self.target, None, mode="off", max_length=self.max_length)]
        if self.drafter is not None:
            engines += [Engine(self.target, self.drafter, mode="tree", tree=TreeShape(3, 2, 4),
                               max_length=self.max_length, draft_prefill_window=8),
                        Engine(self.target, self.drafter, mode="chain", chain_k=2,
                               max_length=self.max_length)]  # fmt: skip
        for engine in engines:
            for b in batch_sizes:
                reqs = [Request(p, max_new_tokens=6 + 6 * i) for i, p in enumerate(prompts[:b])]
                engine.generate(reqs, batch_size=b)

    def prepare_policies(self, max_batch: int) -> list[int]:
        """Load or measure the step costs of every batch bucket up to max_batch now (a server does this
        at startup, so no request waits on a calibration); returns the buckets."""
        buckets = [1 << i for i in range(max(max_batch - 1, 0).bit_length())] + [max_batch]
        buckets = sorted({min(b, max_batch) for b in buckets})
        if self.drafter is not None:
            for b in buckets:
                self._policy_for(b)
        return buckets

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
        if policy.costs is not None and not policy.recalibrated and policy.calibration_suspect():
            policy.costs = load_or_calibrate(self.target, self.drafter, batch, force=True)
            policy.ratios.clear()
            policy.recalibrated = True
        policy.adaptive = self.adaptive
        return policy
