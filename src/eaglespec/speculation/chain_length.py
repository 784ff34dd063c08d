"""How many draft tokens per step to start other engines with (`eaglespec export`): measured chain
acceptance, then the length that maximises tokens per second under two cost models.

A chain of k drafted tokens yields 1 + a_1 + ... + a_k tokens per step (a_i: the measured share of steps
whose first i drafted tokens were all accepted, from a deep chain with speculation forced). It costs
- here (llama.cpp on this CPU): k drafter steps plus one verification over k + 1 tokens, both measured
  on this machine (speculation/costs.py);
- on a bandwidth-bound server (vLLM / SGLang on a GPU at small batch): every forward reads its weights
  once whatever its few tokens, so the step costs target bytes + k x drafter bytes.
Either choice is a starting point to tune on the serving hardware. measure() runs the whole engine
(api.load_engine, imported when called) on the bundled prompt suites (suites.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..stats import SpecStats

CATEGORIES = ("chat", "code", "docs_qa")  # one short suite each: the export should take seconds, not minutes


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


def measure(target_dir, drafter_dir, *, depth: int = 8, prompts_per_category: int = 2,
            max_new_tokens: int = 48) -> LengthChoice:  # fmt: skip
    """Chain acceptance with speculation forced at `depth`, on the bundled suites, fp32 greedy."""
    from ..api import generate, load_engine
    from ..suites import load_prompts
    from .costs import load_or_calibrate

    engine = load_engine(target_dir, drafter_dir, mode="chain", chain_k=depth, adaptive=False, dtype="fp32")
    if engine.tokenizer is None:
        raise ValueError(f"{target_dir} has no tokenizer; pass --num-speculative-tokens to skip the measurement")
    context = engine.target.cfg.max_position_embeddings
    prompts, _ = load_prompts(list(CATEGORIES), engine.tokenizer, limit=prompts_per_category,
                              max_new_tokens=max_new_tokens, max_length=context)  # fmt: skip
    stats = SpecStats()
    flat = [p.ids for ps in prompts.values() for p in ps]
    for ids in flat:
        stats = stats.merge(generate(engine, [ids], max_new_tokens=max_new_tokens).stats)
    costs = load_or_calibrate(engine.target, engine.drafter, 1)
    acceptance = stats.per_position_acceptance + [0.0] * (depth - len(stats.per_position_acceptance))
    k_here, _, speed_here = best_chain_length(acceptance, costs.draft_cost(1), costs.verify_cost)
    ratio = weight_bytes(engine.drafter, skip=("embed_tokens",)) / weight_bytes(engine.target)
    k_bw, _, speed_bw = best_chain_length(acceptance, ratio, lambda n: 1.0)
    return LengthChoice(k_here, k_bw, acceptance, speed_here, speed_bw, ratio, len(flat))


def weight_bytes(model, skip=()) -> int:
    """Bytes of distinct parameters (tied weights once), leaving out names containing any of `skip`."""
    seen = {}
    for name, p in model.named_parameters():
        if not any(s in name for s in skip):
            seen[p.data_ptr()] = p.numel() * p.element_size()
    return sum(seen.values())
