"""A target model run by llama.cpp (a GGUF file, any quantization llama.cpp has), with the forward
protocol of models/llama.LlamaTarget, so the engine core, the policy's cost calibration and the
exactness probes use it unchanged.

forward(ids [B, T], positions [B, T], cache, step, capture_aux, last_only) -> (logits [B, T, V], aux
[B, T, A*H]): llama.cpp returns logits, not hidden states, so `logits(h)` is the identity. With
last_only (a prefill chunk) it computes only each row's last submitted token's logits; the result is
that row broadcast over T (a view, no copy). aux: the residual stream at the inputs of the aux layers,
from llama.cpp's layer-input outputs (the states its own EAGLE-3 support reads). The token embedding
the drafter shares comes from the GGUF's converted HF folder (models/gguf.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import nn

from ...machine import cpu_flags
from ..io import load_tensors
from ..llama import TargetConfig
from . import library
from .cache import LlamaCppCache

KV_TYPES = ("f32", "f16", "q8_0", "q8_0/f16")  # "K/V" when they differ
MAX_TREE_TOKENS = 64  # logits rows per slot and forward the context is sized for


class _Embedding(nn.Module):
    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.embed_tokens = nn.Embedding.from_pretrained(weight, freeze=True)


class LlamaCppTarget(nn.Module):
    """A GGUF `path` run by llama.cpp; `folder`: its HF folder (config, tokenizer, embedding)."""

    runtime = "llamacpp"
    quantization = None

    def __init__(self, path, folder, *, threads: int | None = None, kv_type: str = "q8_0/f16",
                 aux_layers: tuple[int, ...] | None = None, repack: bool | None = None,
                 min_rows: int = 1):  # fmt: skip
        super().__init__()
        from transformers import AutoConfig

        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type must be one of {', '.join(KV_TYPES)}, got {kv_type!r}")
        self.path, self.kv_type, self.min_rows = Path(path), kv_type, min_rows
        self.threads = threads or torch.get_num_threads()
        self.hf_config = AutoConfig.from_pretrained(str(folder))
        self.cfg = TargetConfig.from_hf(self.hf_config)
        embed = load_tensors(folder, {"model.embed_tokens.weight"})["model.embed_tokens.weight"]
        self.model = _Embedding(embed.float())
        self.lib = library.load()
        params = self.lib.llama_model_default_params()
        params.n_gpu_layers = 0
        if repack is None:  # llama.cpp's AMX repacking crashed loading q8_0 on our Xeon (llama.cpp#20824): not there
            repack = not any(flag.startswith("amx") for flag in cpu_flags())
        params.use_extra_bufts = self.repack = repack  # weight repacking for this CPU's kernels
        self._model = self.lib.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._model:
            raise ValueError(f"llama.cpp could not load {self.path} (see EAGLESPEC_LLAMACPP_LOG=1 for why)")
        n_embd, n_layer = self.lib.llama_model_n_embd(self._model), self.lib.llama_model_n_layer(self._model)
        n_vocab = self.lib.llama_vocab_n_tokens(self.lib.llama_model_get_vocab(self._model))
        if (n_embd, n_layer, n_vocab) != (self.cfg.hidden_size, self.cfg.num_layers, self.cfg.vocab_size):
            c = self.cfg
            raise ValueError(f"{self.path} has hidden {n_embd}, {n_layer} layers, vocabulary {n_vocab}, but its "
                             f"folder {folder} says {c.hidden_size}, {c.num_layers}, {c.vocab_size}")
        self.set_aux_layers(aux_layers)
        self.eval()

    def __del__(self):
        if getattr(self, "_model", None):
            self.lib.llama_model_free(self._model)
            self._model = None

    def set_aux_layers(self, aux_layers: tuple[int, ...] | None) -> None:
        self.aux_layers = self.cfg.aux_layers(aux_layers)

    def describe(self) -> str:
        rows = ", one-token steps as two rows" if self.min_rows > 1 else ""
        return f"llama.cpp ({self.path.name}, {self.kv_type} KV cache, {self.threads} threads{rows})"

    def new_cache(self, num_slots: int, *, max_length: int | None = None, initial_capacity: int | None = None,
                  max_batch_tokens: int = 2048) -> LlamaCppCache:  # fmt: skip
        return LlamaCppCache(self.lib, self._model, num_slots=num_slots,
                             max_length=max_length or self.cfg.max_position_embeddings, threads=self.threads,
                             kv_type=self.kv_type, max_batch_tokens=max(max_batch_tokens, num_slots * MAX_TREE_TOKENS),
                             max_outputs=num_slots * MAX_TREE_TOKENS, min_rows=self.min_rows)  # fmt: skip

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids)

    def forward(self, ids, positions, cache: LlamaCppCache, step, *, capture_aux: bool = True, last_only=False):
        self._enable_aux(cache, capture_aux)
        outputs = cache.decode(step, ids, positions, last_only)
        batch, t, vocab = ids.shape[0], ids.shape[1], self.cfg.vocab_size
        rows = self._read(self.lib.llama_get_logits(cache.ctx), outputs * vocab).view(outputs, vocab)
        if last_only:
            logits = rows[:, None, :].expand(batch, t, vocab)
        else:
            logits = self._scatter(rows, step, batch, t)
        aux = None
        if capture_aux:
            n = sum(len(tok) for tok in step.tokens)
            hidden = self.cfg.hidden_size
            parts = [self._read(self.lib.llama_get_embeddings_layer_inp(cache.ctx, i), n * hidden).view(n, hidden)
                     for i in self.aux_layers]  # fmt: skip
            aux = self._scatter(torch.cat(parts, dim=1), step, batch, t)
        return logits, aux

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h  # forward already returned logits

    # -- internals -----------------------------------------------------------------------------------
    def _enable_aux(self, cache: LlamaCppCache, capture: bool) -> None:
        wanted = self.aux_layers if capture else ()
        if cache.aux_enabled != wanted:
            for i in set(cache.aux_enabled) | set(wanted):
                self.lib.llama_set_embeddings_layer_inp(cache.ctx, i, i in wanted)
            cache.aux_enabled = wanted

    @staticmethod
    def _read(pointer, count: int) -> torch.Tensor:
        return torch.from_numpy(np.ctypeslib.as_array(pointer, shape=(count,)).copy())

    @staticmethod
    def _scatter(rows: torch.Tensor, step, batch: int, t: int) -> torch.Tensor:
        """[sum of submitted tokens, D] in submission order -> [B, T, D] (unsubmitted padding: zeros)."""
        if batch == 1 and len(step.tokens[0]) == t:
            return rows[None]
        out = rows.new_zeros(batch, t, rows.shape[1])
        at = 0
        for b, own in enumerate(step.tokens):
            out[b, own] = rows[at : at + len(own)]
            at += len(own)
        return out


def load_exact(path, folder, *, threads: int | None = None,
               kv_type: str = "q8_0/f16") -> tuple[LlamaCppTarget, str | None]:  # fmt: skip
    """(target, None) when a token's logits have the same bits in one-token steps and in a 17-row
    verification (models/precision.row_gap == 0, after a short and a 600-token context), trying one-row
    steps first and two-row steps second (see cache.LlamaCppCache); (target, why not) when neither
    holds: plain decoding only then."""
    from ..precision import row_gap

    target = LlamaCppTarget(path, folder, threads=threads, kv_type=kv_type)
    gaps = []
    for min_rows in (1, 2):
        target.min_rows = min_rows
        gaps.append(max(row_gap(target), row_gap(target, prompt_len=600, seed=1)))
        if gaps[-1] == 0.0:
            return target, None
    return target, (f"llama.cpp's logits for {Path(path).name} differ between one-token steps and verification "
                    f"forwards by {gaps[0]:.3g} (and {gaps[1]:.3g} with two-row steps) on this machine")
