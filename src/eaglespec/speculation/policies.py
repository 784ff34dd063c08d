"""The policies of one engine: one per batch-size bucket, kept across generate calls and server steps
so their measurements (rates, acceptance calibration) persist."""

from __future__ import annotations

from .config import AUTO_MAX_NODES, AUTO_WIDTHS, SpecConfig
from .costs import StepCosts, load_or_calibrate, tightened
from .policy import Policy


class PolicyBook:
    def __init__(self, target, drafter, spec: SpecConfig):
        self.target, self.drafter, self.spec = target, drafter, spec
        self._by_batch: dict[int, Policy] = {}
        self._measured: dict[int, StepCosts] = {}  # as loaded or calibrated, per batch bucket

    def for_batch(self, batch: int, adaptive: bool | None = None) -> Policy | None:
        """The policy of a batch bucket (None without a drafter); auto policies load or measure their
        step costs on first use (speculation/costs.py) and rescale them once if they prove stale."""
        if self.drafter is None or not self.spec.speculates:
            return None
        policy = self._by_batch.get(batch)
        if policy is None:
            shape = self.spec.shape
            if self.spec.mode == "auto":
                policy = Policy(self._costs(batch), widths=AUTO_WIDTHS, max_depth=shape.depth,
                                max_nodes=AUTO_MAX_NODES)  # fmt: skip
            else:
                policy = Policy(None, widths=(shape.top_k,), max_depth=shape.depth)
            self._by_batch[batch] = policy
        policy.recheck_calibration()
        policy.adaptive = self.spec.adaptive if adaptive is None else adaptive
        return policy

    def prepare(self, max_batch: int) -> list[int]:
        """Load or measure the step costs of every batch bucket up to max_batch now (a server does this
        at startup, so no request waits on a calibration); returns the buckets."""
        buckets = [1 << i for i in range(max(max_batch - 1, 0).bit_length())] + [max_batch]
        buckets = sorted({min(b, max_batch) for b in buckets})
        if self.drafter is not None and self.spec.mode == "auto":
            for b in buckets:  # every bucket's costs first: each one bounds the smaller buckets' costs
                self._costs(b, bound=False)
        for b in buckets:
            self.for_batch(b)
        return buckets

    def _costs(self, batch: int, bound: bool = True) -> StepCosts:
        """This bucket's costs, tightened by the other buckets measured so far (costs.tightened)."""
        if batch not in self._measured:
            self._measured[batch] = load_or_calibrate(self.target, self.drafter, batch)
        return tightened(self._measured)[batch] if bound else self._measured[batch]
