"""Bootstrap intervals for acceptance length (tau) and for the ratio of two drafter variants.

Data: counts[seed][prompt] = (drafts, accepted) for one variant, one condition, one shape. tau of a
sample = 1 + sum(accepted) / sum(drafts) (vLLM's definition, pooled over prompts and seeds, as a run
reports it). One replicate resamples the prompts (with replacement, the same prompts for every variant:
the comparison is paired) and, independently per variant, the training seeds; the 95% interval is the
2.5 and 97.5 percentiles of the replicates.
"""

from __future__ import annotations

import numpy as np

REPLICATES = 2000


def tau_of(counts: np.ndarray, seeds: np.ndarray | None = None, prompts: np.ndarray | None = None) -> float:
    """counts [S, P, 2] (drafts, accepted); seeds / prompts: the indices to pool (with repeats)."""
    c = counts if seeds is None else counts[seeds]
    c = c if prompts is None else c[:, prompts]
    drafts, accepted = c[..., 0].sum(), c[..., 1].sum()
    return 1.0 + accepted / drafts if drafts else 1.0


def bootstrap(variants: dict[str, np.ndarray], *, replicates: int = REPLICATES, seed: int = 0) -> np.ndarray:
    """variants name -> counts [S_v, P, 2] (same P prompts). Returns [replicates, V] resampled taus."""
    names = list(variants)
    prompts = {variants[n].shape[1] for n in names}
    if len(prompts) != 1:
        raise ValueError(f"variants must be measured on the same prompts, got prompt counts {sorted(prompts)}")
    (p,) = prompts
    rng = np.random.default_rng(seed)
    out = np.empty((replicates, len(names)))
    for r in range(replicates):
        pick = rng.integers(0, p, p)
        for j, n in enumerate(names):
            s = variants[n].shape[0]
            out[r, j] = tau_of(variants[n], rng.integers(0, s, s), pick)
    return out


def interval(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    lo, hi = np.percentile(samples, [50 * (1 - level), 50 * (1 + level)])
    return float(lo), float(hi)


def summarize(variants: dict[str, np.ndarray], baseline: str, *, replicates: int = REPLICATES, seed: int = 0) -> dict:
    """Point tau and 95% interval per variant, and each variant's tau ratio over `baseline` with its interval."""
    names = list(variants)
    boot = bootstrap(variants, replicates=replicates, seed=seed)
    base = names.index(baseline)
    out = {}
    for j, n in enumerate(names):
        tau = tau_of(variants[n])
        entry = {"tau": tau, "tau_ci": interval(boot[:, j]), "seeds": int(variants[n].shape[0]),
                 "prompts": int(variants[n].shape[1])}  # fmt: skip
        if n != baseline:
            entry["ratio"] = tau / tau_of(variants[baseline])
            entry["ratio_ci"] = interval(boot[:, j] / boot[:, base])
        out[n] = entry
    return out
