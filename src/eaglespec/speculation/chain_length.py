"""How many draft tokens per step to start other engines with (`eaglespec export`): measured chain
acceptance, then the length that maximises tokens per second under two cost models.

A chain of k drafted tokens yields 1 + a_1 + ... + a_k tokens per step (a_i: the measured share of steps
whose first i drafted tokens were all accepted, from a deep chain with speculation forced). It costs
- here (llama.cpp on this CPU): k drafter steps plus one verification over k + 1 tokens, both measured
  on this machine (speculation/costs.py);
- on a bandwidth-bound server (vLLM / SGLang on a GPU at small batch): every forward reads its weights
  once whatever its few tokens, so the step costs target bytes + k x drafter bytes.
Either choice is a starting point to tune on the serving hardware. The export command runs the chain
(cli.py) and choose_length turns what it measured into the two lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..stats import SpecStats
from .costs import load_or_calibrate

CATEGORIES = ("chat", "code", "docs_qa")  # one short suite each: the export should take seconds, not minutes
DEPTH = 8  # the forced chain acceptance is measured at


@dataclass
class LengthChoice:
    k_here: int  # best under this machine's measured costs
    k_bandwidth: int  # best when each forward costs its weight bytes
    acceptance: list[float]  # a_i, i = 1..depth
    speed_here: list[float]  # tokens per second for k = 1..depth relative to plain decoding, measured costs
    speed_bandwidth: list[float]  # the same under the bytes model
    drafter_to_target_bytes: float
    prompts: int


def best_chain_length(acceptance: list[float], draft_cost: float, verify_cost) -> tuple[int, list[float], list[float]]:
    """acceptance a_1..a_K, draft_cost seconds per drafter step, verify_cost(n) seconds for n tokens.
    Returns (k, expected tokens per step, speed relative to plain) for k = 1..K."""
    if not acceptance:
        raise ValueError("no acceptance measured (no draft step ran)")
    plain = verify_cost(1)
    tokens, speed = [], []
    for k in range(1, len(acceptance) + 1):
        tokens.append(1.0 + sum(acceptance[:k]))
        speed.append(tokens[-1] / (k * draft_cost + verify_cost(k + 1)) * plain)
    return 1 + max(range(len(speed)), key=speed.__getitem__), tokens, speed


def choose_length(engine, stats: SpecStats, depth: int, prompts: int) -> LengthChoice:
    """The lengths from a forced chain of `depth` (its SpecStats over `prompts` prompts) on `engine`: this
    machine's calibrated costs for the engine's pair (speculation/costs.py), and the bytes model."""
    acceptance = stats.per_position_acceptance + [0.0] * (depth - len(stats.per_position_acceptance))
    costs = load_or_calibrate(engine.target, engine.drafter, 1)
    k_here, _, speed_here = best_chain_length(acceptance, costs.draft_cost(1), costs.verify_cost)
    ratio = weight_bytes(engine.drafter, skip=("embed_tokens",)) / weight_bytes(engine.target)
    k_bw, _, speed_bw = best_chain_length(acceptance, ratio, lambda n: 1.0)
    return LengthChoice(k_here, k_bw, acceptance, speed_here, speed_bw, ratio, prompts)


def weight_bytes(model, skip=()) -> int:
    """Bytes of distinct parameters (tied weights once), leaving out names containing any of `skip`."""
    seen = {}
    for name, p in model.named_parameters():
        if not any(s in name for s in skip):
            seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())
