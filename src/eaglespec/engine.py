"""The engine: a target (and drafter) with its speculation config and policies; `generate` runs a batch
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
from .models.checkpoint import check_pair
from .models.drafter import Eagle3Drafter
from .models.fast_linear import prepare_for_inference
from .models.llama import LlamaTarget
from .request import Request
from .sampling import SamplingParams
from .speculation.config import SpecConfig, TreeShape
from .speculation.policies import PolicyBook
from .speculation.policy import Policy
from .speculation.proposer import EagleProposer
from .stats import SpecStats

StreamCallback = Callable[[int, list[int]], None]

__all__ = ["BatchOutput", "Engine", "Request", "Result"]


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

    spec: how to speculate (speculation/config.py: mode, shape, adaptivity, n-gram copies, the drafter's
    prefill window); or give its fields as keywords (`Engine(target, drafter, mode="chain", chain_k=3)`).
    Without a drafter the engine decodes plainly whatever the spec says."""

    def __init__(self, target: LlamaTarget, drafter: Eagle3Drafter | None = None, spec: SpecConfig | None = None, *,
                 tokenizer=None, prefill_chunk: int = 512, max_length: int | None = None,
                 **spec_fields):  # fmt: skip
        spec = spec or SpecConfig(**spec_fields)
        if drafter is None or not spec.speculates:
            spec, drafter = spec.without_drafter(), None
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        prepare_for_inference(target)
        self.max_length = max_length or target.cfg.max_position_embeddings
        self.prefill_chunk = prefill_chunk
        self.proposer = None
        if drafter is not None:
            check_pair(drafter, target)
            prepare_for_inference(drafter)
            if drafter.embed_tokens is None:
                drafter.attach_target_embedding(target.model.embed_tokens)
            target.set_aux_layers(tuple(drafter.cfg.aux_layer_ids or ()) or None)
            self.proposer = EagleProposer(drafter)
        self.device = next(target.parameters()).device
        self.spec = spec
        self.policies = PolicyBook(target, drafter, spec)  # per batch size: measurements persist across calls
        self.policy: Policy | None = None  # of the last generate call's last step
        self.core: EngineCore | None = None  # of the running (or last) generate call

    @property
    def mode(self) -> str:
        return self.spec.mode

    @property
    def shape(self) -> TreeShape | None:
        return self.spec.shape

    def configure(self, **changes) -> None:
        """Change speculation settings (SpecConfig fields) between calls, e.g. adaptive=False; policies
        keep their measurements."""
        spec = replace(self.spec, **changes)
        if spec.speculates and self.drafter is None:
            raise ValueError("this engine has no drafter: it can only decode plainly")
        if spec.shape != self.spec.shape:
            self.policies = PolicyBook(self.target, self.drafter, spec)
        self.spec = self.policies.spec = spec

    def new_core(self, *, max_num_seqs: int = 1, max_num_batched_tokens: int | None = None,
                 kv_budget_tokens: int | None = None, default_params: SamplingParams = SamplingParams(),
                 seed: int | None = None, policy_batch: int | None = None,
                 caches: tuple | None = None) -> EngineCore:  # fmt: skip
        """A step-level core on this engine's models, config and policies (the server keeps one); caches:
        emptied (target, drafter) caches with max_num_seqs slots to reuse."""
        return EngineCore(self.target, self.drafter, self.proposer, self.spec, self.policies, tokenizer=self.tokenizer,
                          max_length=self.max_length, prefill_chunk=self.prefill_chunk, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, kv_budget_tokens=kv_budget_tokens,
                          default_params=default_params, seed=seed, policy_batch=policy_batch,
                          caches=caches)  # fmt: skip

    def _idle_caches(self, num_slots: int) -> tuple | None:
        """The last generate call's caches, emptied, when they have num_slots slots and the same drafter:
        a llama.cpp context took 0.3-6 s to create here, a fresh one per call showed in every request's latency.
        Setting `core` to None frees them instead."""
        core, self.core = self.core, None
        if (core is None or core.has_work or core.drafter is not self.drafter or core.tcache.num_slots != num_slots
                or core.spec.tree_slack != self.spec.tree_slack):
            return None
        caches = (core.tcache, core.dcache)
        for cache in caches:
            if cache is not None:
                cache.reset()
        return caches

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
        core = self.new_core(max_num_seqs=batch_size, max_num_batched_tokens=self.prefill_chunk * batch_size,
                             default_params=replace(params, seed=None), seed=params.seed,
                             policy_batch=min(batch_size, len(requests)) or 1,
                             caches=self._idle_caches(batch_size))  # fmt: skip
        for i, r in enumerate(requests):
            try:
                core.validate(r)
            except ValueError as e:
                raise type(e)(f"request {i}: {e}") from None
        self.core = core
        self.policy = self.policies.for_batch(core.policy_batch)  # may calibrate: not timed
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
        self.policy = core.policy or self.policy
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
        return self.policies.prepare(max_batch)
