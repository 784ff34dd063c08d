"""Speculation statistics with vLLM's definitions (v1/spec_decode/metrics.py).

tau (mean acceptance length) = 1 + accepted / drafts; draft acceptance rate = accepted / draft tokens;
per-position acceptance[i] = drafts with >= i+1 accepted tokens / drafts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    copied_tokens: int = 0  # hybrid proposer: draft tokens copied from the context ...
    copied_accepted: int = 0  # ... and how many of them were accepted
    target_forwards: int = 0
    drafter_forwards: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    time_prefill: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_other: float = 0.0
    wall_time: float = 0.0

    def observe_draft(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.drafts += 1
        self.draft_tokens += num_draft_tokens
        self.accepted += num_accepted
        if len(self.accepted_per_pos) < num_accepted:
            self.accepted_per_pos += [0] * (num_accepted - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def tau(self) -> float:
        return 1.0 + self.accepted / self.drafts if self.drafts else 1.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.drafts for a in self.accepted_per_pos] if self.drafts else []

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0

    def merge(self, other: SpecStats) -> SpecStats:
        out = SpecStats()
        for name in self.__dataclass_fields__:
            a, b = getattr(self, name), getattr(other, name)
            if isinstance(a, list):
                n = max(len(a), len(b))
                setattr(out, name, [(a[i] if i < len(a) else 0) + (b[i] if i < len(b) else 0) for i in range(n)])
            else:
                setattr(out, name, a + b)
        return out

    def to_dict(self) -> dict:
        return {
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted,
            "accepted_per_pos": list(self.accepted_per_pos),
            "tau": round(self.tau, 4),
            "acceptance_rate": round(self.acceptance_rate, 4),
            "per_position_acceptance": [round(x, 4) for x in self.per_position_acceptance],
            "target_forwards": self.target_forwards,
            "drafter_forwards": self.drafter_forwards,
            "target_forwards_per_token": round(self.target_forwards / self.new_tokens, 4) if self.new_tokens else 0.0,
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "time_prefill_s": round(self.time_prefill, 6),
            "time_draft_s": round(self.time_draft, 6),
            "time_verify_s": round(self.time_verify, 6),
            "time_other_s": round(self.time_other, 6),
            "wall_time_s": round(self.wall_time, 6),
            "tokens_per_s": round(self.tokens_per_second, 3),
        }


def aggregate(stats: list[SpecStats]) -> SpecStats:
    total = SpecStats()
    for s in stats:
        total = total.merge(s)
    return total
