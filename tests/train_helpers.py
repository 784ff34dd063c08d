"""Tiny real models and data for the training tests.

`learnable_target` is a random Llama whose attention output is switched off, so its greedy next token is
a fixed function of the current token's hidden state: a drafter can learn it in seconds, which
makes "trained tau clearly above untrained tau" a meaningful, fast test.
"""

from __future__ import annotations

import json

import torch

from eaglespec.engine import Engine, Request
from eaglespec.models.checkpoint import load_target
from eaglespec.sampling import SamplingParams
from eaglespec.train.shards import Sample, write_json_atomic, write_shard
from helpers import hf_tiny, save_hf


def learnable_target(path, *, vocab=64, attn_scale=0.0, seed=0):
    hf = hf_tiny("llama", vocab=vocab, hidden=64, layers=4, seed=seed, init_range=0.3)
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.self_attn.o_proj.weight.mul_(attn_scale)
    d = save_hf(hf, path)
    return load_target(d), d


def generated_samples(target, n, *, prompt_len=6, new_tokens=24, seed=0) -> list[Sample]:
    """Random prompts continued greedily by the target; the continuation is the 'assistant' part."""
    g = torch.Generator().manual_seed(seed)
    vocab = target.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(n)]
    out = Engine(target, None, mode="off").generate([Request(p, new_tokens) for p in prompts], SamplingParams(),
                                                    batch_size=16)  # fmt: skip
    return [Sample(torch.tensor(p + r.output_ids), torch.tensor([False] * len(p) + [True] * len(r.output_ids)))
            for p, r in zip(prompts, out.results)]  # fmt: skip


def write_data(root, samples, target_dir, shard_size=64) -> str:
    from eaglespec.train.regen import target_fingerprint

    root.mkdir(parents=True, exist_ok=True)
    shards = [samples[i : i + shard_size] for i in range(0, len(samples), shard_size)]
    for i, s in enumerate(shards):
        write_shard(root, i, s)
    manifest = {"num_shards": len(shards), "complete": True, "target_fingerprint": target_fingerprint(target_dir)}
    write_json_atomic(manifest, root / "manifest.json")
    return str(root)


def read_metrics(run_dir) -> list[dict]:
    return [json.loads(ln) for ln in (run_dir / "metrics.jsonl").read_text().splitlines()]
