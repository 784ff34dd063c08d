"""What the bench measures: a Method maps token-id prompts to token-id outputs (a MethodRun) with the
same stop ids as every other method, so outputs compare token for token. Ours (engine_methods.py) and
the peers (peers/) subclass it; methods.py builds the list a run measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..sampling import SamplingParams
from ..stats import SpecStats


@dataclass
class MethodRun:
    outputs: list[list[int]]
    latencies: list[float]  # seconds per request, admission to finish
    target_forwards: int
    stats: SpecStats | None = None  # our engine's counters; None for peers


@dataclass
class Method:
    name: str
    kind: str
    settings: dict = field(default_factory=dict)
    weight_bytes: int = 0  # target weights read per target forward
    resident_bytes: int = 0  # weights this method holds (target + drafter or assistant)
    lossless: bool = True

    def run(self, prompts: list[list[int]], max_new_tokens: int, params: SamplingParams, batch_size: int) -> MethodRun:
        raise NotImplementedError

    def prepare(self, max_batch: int) -> None:
        """One-time set-up for batches up to max_batch, kept out of the timed runs (as a server does at start)."""


def tensor_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def weight_bytes_per_forward(model) -> int:
    """Bytes of weights one forward reads: every parameter once, except an untied input embedding
    (a forward gathers only a few of its rows). Same for our LlamaTarget and HF Llama-family models."""
    from ..models.quantized_linear import QuantizedLinear

    if getattr(model, "runtime", None) == "llamacpp":  # its GGUF's tensors (tied: the embedding is the lm_head)
        return model.path.stat().st_size
    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    quantized = sum(m.weight_bytes() for m in model.modules() if isinstance(m, QuantizedLinear))  # buffers
    return tensor_bytes(p for p in model.parameters() if tied or p is not embed) + quantized
