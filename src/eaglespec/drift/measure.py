"""Measure attention drift per draft depth: the target's greedy continuations, their aux states, and
the drafter's chains at many positions, summarised as one depth profile per drafter."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..api import generate
from ..engine import Engine
from ..kv_cache import causal_mask
from ..models.drafter import Eagle3Drafter
from ..models.llama import LlamaTarget
from ..sampling import SamplingParams
from .chains import ChainRecord, draft_chains

# A few chat turns and code continuations: the two regimes drafters are trained and served on.
DEFAULT_PROMPTS = [
    {"messages": [{"role": "user", "content": "How are you today?"}]},
    {"messages": [{"role": "user", "content": "Explain what a hash table is and when to use one."}]},
    {"messages": [{"role": "user", "content": "Write a short poem about the sea."}]},
    {"messages": [{"role": "user", "content": "What is the difference between a list and a tuple in Python?"}]},
    {"prompt": "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"},
    {"prompt": "import os\nimport sys\n\n\ndef main():\n    args = sys.argv[1:]\n"},
    {"prompt": "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"},
]


@dataclass
class DepthProfile:
    """Per-depth means over all chains of one drafter (lists indexed by depth - 1)."""

    label: str
    path: str
    eagle_version: str
    fc_norm: bool
    norm_output: bool
    chains: int
    sink_mass: list[float]
    context_mass: list[float]
    own_mass: list[float]
    own_uniform: list[float]
    fed_back_rms: list[float]
    prenorm_rms: list[float]
    acceptance: list[float]  # chains whose first d drafts all equal the target's continuation
    mean_accepted_length: float

    @property
    def depth(self) -> int:
        return len(self.sink_mass)

    @property
    def tau(self) -> float:
        return 1.0 + self.mean_accepted_length

    @classmethod
    def from_record(cls, label: str, path: str, drafter: Eagle3Drafter, record: ChainRecord) -> DepthProfile:
        mean = lambda x: [round(float(v), 6) for v in x.float().mean(0)]
        accepted = record.accepted_length
        depths = torch.arange(1, record.drafted.shape[1] + 1)
        cfg = drafter.cfg
        return cls(
            label=label, path=path, eagle_version=cfg.eagle_version, fc_norm=cfg.fc_norm,
            norm_output=cfg.norm_output, chains=int(accepted.numel()), sink_mass=mean(record.sink),
            context_mass=mean(record.context), own_mass=mean(record.own), own_uniform=mean(record.own_uniform),
            fed_back_rms=mean(record.fed_back_rms), prenorm_rms=mean(record.prenorm_rms),
            acceptance=mean(accepted[:, None] >= depths[None]), mean_accepted_length=float(accepted.float().mean()),
        )  # fmt: skip

    def to_dict(self) -> dict:
        return {**asdict(self), "depth": self.depth, "tau": round(self.tau, 6)}


def greedy_sequences(engine: Engine, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """Each prompt followed by the target's greedy continuation (stops at EOS like `generate`)."""
    out = generate(engine, prompts, SamplingParams(), max_new_tokens=new_tokens)
    return [list(p) + r.output_ids for p, r in zip(prompts, out.results)]


@torch.inference_mode()
def capture_aux(target: LlamaTarget, ids: list[int], chunk: int = 512) -> torch.Tensor:
    """[L, A*H] the target's aux states over a whole sequence (teacher-forced, chunked prefill)."""
    device = next(target.parameters()).device
    seq = torch.tensor(ids, device=device)[None]
    cache = target.new_cache(1, max_length=seq.shape[1], initial_capacity=seq.shape[1])
    parts = []
    for c0 in range(0, seq.shape[1], chunk):
        t = min(chunk, seq.shape[1] - c0)
        meta = cache.prepare(None, causal_mask(torch.tensor([t], device=device), t))
        _, aux = target(seq[:, c0 : c0 + t], meta.write_pos, cache, meta)
        cache.commit(None, torch.tensor([t]))
        parts.append(aux[0])
    return torch.cat(parts)


def chain_roots(prompt_len: int, seq_len: int, positions: int, depth: int) -> list[int]:
    """Root indices: the target's first `positions` generated tokens that leave `depth` tokens to compare."""
    return [r for r in range(prompt_len, prompt_len + positions) if r + depth < seq_len]


def measure_drafter(
    target: LlamaTarget, drafter: Eagle3Drafter, sequences: list[list[int]], prompt_lens: list[int], *, depth: int,
    sink_tokens: int, positions: int,
) -> ChainRecord:  # fmt: skip
    """All chains of one drafter over the sequences (the target captures the drafter's aux layers)."""
    target.set_aux_layers(tuple(drafter.cfg.aux_layer_ids or ()) or None)
    if drafter.embed_tokens is None:
        drafter.attach_target_embedding(target.model.embed_tokens)
    device = next(target.parameters()).device
    records = []
    for ids, n in zip(sequences, prompt_lens):
        roots = chain_roots(n, len(ids), positions, depth)
        if roots:
            seq = torch.tensor(ids, device=device)
            records.append(draft_chains(drafter, seq, capture_aux(target, ids), roots, depth, sink_tokens))
    if not records:
        raise ValueError(
            f"no chain fits: every greedy continuation ended (EOS) within {depth} tokens; "
            "lower --depth or give other prompts"
        )
    return ChainRecord.concat(records)
