"""Decides, step by step, whether speculating pays on this machine right now.

Speculation must never lose to plain decoding. The governor compares measured throughput of recent
speculative steps (tokens per second, acceptance included) with recent plain steps, falls back to
plain decoding with exponential back-off when speculation loses, and probes again later. It only
chooses between two lossless paths, so it never changes the output.
"""

from __future__ import annotations


class Governor:
    def __init__(self, enabled: bool = True, *, judge_after: int = 2, probe_every: int = 64, alpha: float = 0.3):
        self.enabled = enabled
        self.judge_after, self.probe_every, self.alpha = judge_after, probe_every, alpha
        self.spec_rate: float | None = None
        self.plain_rate: float | None = None
        self.spec_streak = 0  # speculative steps since the last plain one
        self.plain_left = 0  # plain steps still to do
        self.backoff = 8
        self.plain_steps = 0
        self.spec_steps = 0

    def should_speculate(self) -> bool:
        if not self.enabled:
            return True
        if self.plain_left > 0:
            return False
        if self.spec_streak >= self.judge_after and (self.plain_rate is None or self.spec_streak >= self.probe_every):
            self.plain_left = 2  # measure (or refresh) the plain rate
            return False
        return True

    def observe(self, speculated: bool, tokens: int, seconds: float) -> None:
        rate = tokens / max(seconds, 1e-9)
        if speculated:
            self.spec_steps += 1
            self.spec_streak += 1
            self.spec_rate = rate if self.spec_streak == 1 else self._ema(self.spec_rate, rate)
            if self.enabled and self.plain_rate is not None and self.spec_streak >= self.judge_after:
                if self.spec_rate < self.plain_rate:
                    self.plain_left = self.backoff
                    self.backoff = min(2 * self.backoff, 512)
                else:
                    self.backoff = 8
        else:
            self.plain_steps += 1
            self.plain_left = max(0, self.plain_left - 1)
            self.plain_rate = (
                rate if self.spec_streak > 0 or self.plain_rate is None else self._ema(self.plain_rate, rate)
            )
            self.spec_streak = 0

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new
