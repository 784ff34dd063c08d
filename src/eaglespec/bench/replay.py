"""Acceptance by replay: the target's greedy continuation of a prompt, computed once, stands in for the
target while drafters are measured, so a drafter's tau costs drafter forwards only (SmolLM2, 122 prompts x 3
shapes, one thread: ~370 s a drafter instead of ~1,900 s through the target; greedy only).

Why it is exact for greedy decoding: a drafted token is accepted only when it equals the target's argmax
after an already accepted prefix, and every accepted prefix lies on the target's own greedy sequence. So
the engine reads a row's logits and aux states only at positions of that sequence, and the replay answers
every row by its position alone: logits one-hot on the recorded next token, aux the recorded states. Rows
off the sequence get the same answer, and they are never accepted. The states come from one forward over
prompt + continuation rather than from verification steps, so they may differ in the last bits; the test
(tests/test_replay.py) compares tau by replay with tau through the target.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..engine import Engine
from ..kv_cache import KVCache, causal_mask
from ..request import Request

MARGIN = 16  # tokens recorded past max_new_tokens: a draft (tree depth or copied chain, <= 15) may be accepted past it


@dataclass
class Record:
    ids: torch.Tensor  # [N] the prompt then the target's greedy continuation (no stop token applied)
    aux: torch.Tensor  # [N, A*H] the target's aux states at each position
    aux_layers: tuple[int, ...]


def record(target, prompt_ids: list[int], new_tokens: int, *, chunk: int = 512) -> Record:
    """The target's greedy continuation of `prompt_ids` (plain one-token steps, as the engine decodes
    without a drafter) and its aux states at every position (for the aux layers the target has set)."""
    out = Engine(target, None, mode="off").generate([Request(list(prompt_ids), max_new_tokens=new_tokens)])
    ids = list(prompt_ids) + out.results[0].output_ids
    cache = target.new_cache(1, max_length=len(ids))
    parts = []
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            piece = torch.tensor([ids[s : s + chunk]])
            t = piece.shape[1]
            meta = cache.prepare(None, causal_mask(torch.tensor([t]), t))
            _, aux = target(piece, meta.write_pos, cache, meta, capture_aux=True)
            cache.commit(None, torch.tensor([t]))
            parts.append(aux[0].float())
    return Record(torch.tensor(ids), torch.cat(parts), tuple(target.aux_layers))


class RecordStore(dict):
    """Records by key, kept as safetensors files in `folder` too, so that another process (or a resumed
    run) measuring more drafters on the same prompts records nothing again."""

    def __init__(self, folder):
        super().__init__()
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)

    def _path(self, key) -> Path:
        return self.folder / (hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24] + ".safetensors")

    def __contains__(self, key) -> bool:
        return super().__contains__(key) or self._path(key).is_file()

    def __getitem__(self, key) -> Record:
        if not super().__contains__(key):
            from safetensors.torch import load_file

            t = load_file(self._path(key))
            super().__setitem__(key, Record(t["ids"], t["aux"], tuple(t["aux_layers"].tolist())))
        return super().__getitem__(key)

    def __setitem__(self, key, rec: Record) -> None:
        from safetensors.torch import save_file

        path = self._path(key)
        tmp = path.with_suffix(".tmp")  # written whole, then renamed: a killed run leaves no half record
        save_file({"ids": rec.ids, "aux": rec.aux.contiguous(), "aux_layers": torch.tensor(rec.aux_layers)}, tmp)
        tmp.replace(path)
        super().__setitem__(key, rec)


class ReplayTarget(nn.Module):
    """The target protocol of models/llama.LlamaTarget answered from a Record (set with `play`), one
    sequence at a time. `forward` returns each row's position as its hidden state; `logits` turns a
    position into a one-hot row on the recorded next token (all zeros past the record's end)."""

    runtime = "replay"
    quantization = None

    def __init__(self, base):
        super().__init__()
        self.base = base  # the real target: its config, embedding (shared with the drafter) and device
        self.cfg, self.hf_config, self.model = base.cfg, base.hf_config, base.model
        self.current: Record | None = None

    @property
    def aux_layers(self):
        return self.base.aux_layers

    def set_aux_layers(self, aux_layers) -> None:
        self.base.set_aux_layers(aux_layers)

    def play(self, rec: Record, prompt_ids: list[int] | None = None) -> None:
        if prompt_ids is not None and rec.ids[: len(prompt_ids)].tolist() != list(prompt_ids):
            raise ValueError("the record was made for another prompt: delete the records folder and record again")
        if rec.aux_layers != tuple(self.base.aux_layers):
            raise ValueError(f"the record holds aux layers {rec.aux_layers}, the drafter reads "
                             f"{tuple(self.base.aux_layers)}: record again for this drafter")  # fmt: skip
        self.current = rec

    def new_cache(self, num_slots: int, *, max_length: int | None = None, initial_capacity: int = 256):
        # the core's bookkeeping (lengths, tree masks, compaction) without keys or values
        return KVCache(1, num_slots, 1, 1, max_length=max_length or self.cfg.max_position_embeddings,
                       initial_capacity=initial_capacity)  # fmt: skip

    def forward(self, ids, positions, cache, meta, *, capture_aux: bool = True, last_only: bool = False):
        rec = self.current
        if rec is None:
            raise RuntimeError("ReplayTarget.play(record) first")
        if ids.shape[0] != 1:
            raise ValueError("a replay answers one sequence at a time (batch size 1)")
        aux = rec.aux[positions.clamp(max=len(rec.ids) - 1)] if capture_aux else None
        return positions[..., None].float(), aux

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        ids = self.current.ids
        nxt = h[..., 0].long() + 1
        known = nxt < len(ids)
        out = torch.zeros(*nxt.shape, self.cfg.vocab_size)
        out.scatter_(-1, ids[nxt.clamp(max=len(ids) - 1)][..., None], known[..., None].float())
        return out
