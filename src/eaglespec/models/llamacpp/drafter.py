"""An EAGLE-3 / EAGLE-3.1 drafter whose decoder layer runs in llama.cpp, with the forward protocol of
models/drafter.Eagle3Drafter, so the proposer and the engine core use it unchanged.

Why: beside a target step of a few milliseconds, PyTorch's per-op overhead makes a drafter forward cost
~2 ms on 2 cores (an extend and a chain of 4: 8-9 ms, measured on SmolLM2's drafter), while llama.cpp runs
the same layer in ~0.4 ms. llama.cpp's EAGLE-3 graph takes the fused input state g and the token for each
position, and returns the draft logits (over the target vocabulary, -inf outside the draft vocabulary)
and the pre-norm state. What it lacks of EAGLE-3.1 stays in PyTorch, around it: `project` (fc_norm's
per-state norms and fc) runs before, and norm_output's final norm on the returned state after. Its
weights are the PyTorch drafter's, written once as an EAGLE-3 GGUF (f16) by llama.cpp's own converter,
with the target's token embedding in the file, and cached by content.
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..drafter import Eagle3Drafter
from ..io import save_tensors, write_json
from . import library
from .draft_cache import LlamaCppDraftCache

OUTTYPE = "f16"  # as fast as q8_0 here (0.41 ms a one-token forward on SmolLM2's drafter, 2-vCPU EPYC), closer to bf16
UNSUPPORTED = ("attention_bias", "mlp_bias", "draft_attention_window")  # llama.cpp's EAGLE-3 graph has none of these


def unsupported_reason(drafter: Eagle3Drafter) -> str | None:
    flags = [f for f in UNSUPPORTED if getattr(drafter.cfg, f)]
    return f"llama.cpp's EAGLE-3 layer has no {', '.join(flags)}" if flags else None


class LlamaCppDrafter(nn.Module):
    """`drafter` (loaded in PyTorch, fp32) with its layer run by llama.cpp from `gguf`."""

    runtime = "llamacpp"

    def __init__(self, drafter: Eagle3Drafter, gguf: Path, *, threads: int | None = None):
        super().__init__()
        why = unsupported_reason(drafter)
        if why:
            raise ValueError(f"this drafter cannot run in llama.cpp: {why}; use --draft-runtime torch")
        self.torch = drafter
        self.cfg = drafter.cfg
        self.gguf, self.threads = Path(gguf), threads or torch.get_num_threads()
        self.lib = library.load()
        params = self.lib.llama_model_default_params()
        params.n_gpu_layers = 0
        self._model = self.lib.llama_model_load_from_file(str(self.gguf).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load the drafter {self.gguf} (EAGLESPEC_LLAMACPP_LOG=1 says why)")
        self.n_vocab = self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(self._model))
        self._draft_ids = drafter.draft_to_target.numpy()

    def __del__(self):
        if getattr(self, "_model", None):
            self.lib.llama_model_free(self._model)
            self._model = None

    # -- what the engine reads from a drafter ----------------------------------------------------------
    @property
    def fc(self) -> nn.Linear:
        return self.torch.fc

    @property
    def embed_tokens(self):
        return self.torch.embed_tokens

    @property
    def _target_embed(self):
        return self.torch._target_embed

    @property
    def draft_to_target(self) -> torch.Tensor:
        return self.torch.draft_to_target

    def attach_target_embedding(self, embed: nn.Embedding) -> None:
        self.torch.attach_target_embedding(embed)  # unused here: the GGUF holds the embedding

    def describe(self) -> str:
        return f"llama.cpp ({self.gguf.name}, {self.threads} threads)"

    def new_cache(self, num_slots: int, max_length: int, initial_capacity: int = 256) -> LlamaCppDraftCache:
        return LlamaCppDraftCache(self.lib, self._model, num_slots=num_slots, max_length=max_length,
                                  threads=self.threads, max_batch_tokens=max(512, num_slots * 64))  # fmt: skip

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        return self.torch.project(aux)

    # -- math ------------------------------------------------------------------------------------
    def forward(self, ids, hidden, positions, cache: LlamaCppDraftCache, step, *, at: torch.Tensor | None = None):
        """As Eagle3Drafter.forward: (draft logits [B, T, Vd], state [B, T, H]), or with `at` [B] the ones
        at token at[b] of each row ([B, Vd], [B, H])."""
        batch, t = ids.shape
        # every submitted token is an output: llama.cpp's EAGLE-3 graph does not select output rows, so with
        # fewer its outputs are the batch's first rows, not the ones asked for (measured; it computes all anyway)
        outputs = [[i for i, p in enumerate(places) if p is not None] for places in step.places]
        index = cache.decode(step, ids, hidden, positions, outputs)
        if at is not None:  # keep only token at[b] of each row
            wanted = at.tolist()
            flat = [(b, i) for b, own in enumerate(outputs) for i in own]
            keep = [j for j, (b, i) in enumerate(flat) if i == wanted[b]]
            outputs = [[wanted[b]] if wanted[b] in own else [] for b, own in enumerate(outputs)]
            index = [index[j] for j in keep]
        n_out, width = len(index), self.cfg.hidden_size
        logits = np.zeros((n_out, self._draft_ids.size), np.float32)
        prenorm = np.zeros((n_out, width), np.float32)
        for j, i in enumerate(index):
            row = np.ctypeslib.as_array(self.lib.llama_get_logits_ith(cache.ctx, i), (self.n_vocab,))
            logits[j] = row[self._draft_ids]
            prenorm[j] = np.ctypeslib.as_array(self.lib.llama_get_embeddings_nextn_ith(cache.ctx, i), (width,))
        logits, state = torch.from_numpy(logits), torch.from_numpy(prenorm)
        if self.cfg.norm_output:  # EAGLE-3.1 feeds the post-norm state back
            state = self.torch.norm(state)
        if at is not None:
            full = [bool(o) for o in outputs]
            if all(full):
                return logits, state
            out_l, out_s = logits.new_zeros(batch, logits.shape[1]), state.new_zeros(batch, width)
            out_l[full], out_s[full] = logits, state
            return out_l, out_s
        out_l, out_s = logits.new_zeros(batch, t, logits.shape[1]), state.new_zeros(batch, t, width)
        j = 0
        for b, own in enumerate(outputs):
            out_l[b, own], out_s[b, own] = logits[j : j + len(own)], state[j : j + len(own)]
            j += len(own)
        return out_l, out_s


# -- the GGUF ------------------------------------------------------------------------------------------
def eagle3_view(drafter: Eagle3Drafter, embedding: torch.Tensor) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config, tensors) of the drafter as the EAGLE-3 layer llama.cpp runs: no fc_norm / norm_output (they
    run in PyTorch around it) and the token embedding in the file."""
    cfg = dataclasses.replace(drafter.cfg, fc_norm=False, norm_output=False, norm_before_fc=False,
                              fc_bias=False, extra={}).to_dict()  # fmt: skip
    cfg["torch_dtype"] = "float32"
    skip = ("fc_norm.", "input_norm.", "_target_embed", "embed_tokens.", "fc.")
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in drafter.state_dict().items()
               if not k.startswith(skip)}  # fmt: skip
    tensors["fc.weight"] = drafter.fc.weight.float()  # the converter wants it; llama.cpp's decoder never reads it
    tensors["d2t"], tensors["t2d"] = drafter.d2t.long(), drafter.t2d.bool()
    tensors["embed_tokens.weight"] = embedding.float()
    return cfg, tensors


def drafter_gguf(drafter: Eagle3Drafter, embedding: torch.Tensor, target_folder, root: Path | None = None) -> Path:
    """The drafter as an EAGLE-3 GGUF for llama.cpp, written once per content (weights, embedding,
    converter) into llama.cpp's gguf cache. target_folder: the target's HF folder (tokenizer, layer count)."""
    from ...export.llamacpp_convert import run_converter

    root = Path(root or library.llamacpp_root())
    cfg, tensors = eagle3_view(drafter, embedding)
    digest = hashlib.blake2b(digest_size=8)
    converter = root / "src" / "convert_hf_to_gguf.py"
    digest.update(repr((sorted(cfg.items()), OUTTYPE, converter.stat().st_mtime_ns)).encode())
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(tensors[name].contiguous().numpy().tobytes())
    out = root / "gguf" / f"drafter-{digest.hexdigest()}-{OUTTYPE}.gguf"
    if out.is_file():
        return out
    with tempfile.TemporaryDirectory() as tmp:
        save_tensors(tensors, tmp)
        write_json(cfg, Path(tmp) / "config.json")
        return run_converter(root, Path(tmp), out, OUTTYPE, Path(target_folder))
