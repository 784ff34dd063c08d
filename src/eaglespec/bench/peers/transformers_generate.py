"""transformers' `generate` as bench peers: plain (hf_generate), assisted generation (hf_assisted) and
prompt lookup (prompt_lookup). They run one prompt at a time: assisted generation and prompt lookup support
batch 1 only, and plain `generate` stays at batch 1 too so padding cannot change its numerics.

hf_assisted's assistant is the target truncated to its first ASSISTANT_LAYERS layers plus the final
norm and lm_head (same weights, same tokenizer): a draft model that exists for every target without
training, in the spirit of LayerSkip's early exit. It is a peer baseline, not a tuned draft model.
(Not named transformers.py: speculators_forward.py runs as a script from this folder and imports transformers.)
"""

from __future__ import annotations

import time

import torch

from ..method import Method, MethodRun, tensor_bytes, weight_bytes_per_forward

KINDS = ("hf_generate", "hf_assisted", "prompt_lookup")
ASSISTANT_LAYERS = 2
PROMPT_LOOKUP_TOKENS = 10  # the value transformers' docs use
# transformers' defaults for assisted generation, passed explicitly so the report states them
ASSISTED_SETTINGS = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                     "assistant_confidence_threshold": 0.4}  # fmt: skip


class HFMethod(Method):
    """transformers `generate` (greedy or sampling), optionally with an assistant or prompt lookup."""

    def __init__(self, name, kind, model, stop_ids, pad_id, extra: dict, settings: dict, assistant=None):
        resident = tensor_bytes(model.parameters()) + (tensor_bytes(assistant.parameters()) if assistant else 0)
        super().__init__(name, kind, settings, weight_bytes_per_forward(model), resident)
        self.model, self.stop_ids, self.pad_id = model, list(stop_ids), pad_id
        self.extra = dict(extra, **({"assistant_model": assistant} if assistant is not None else {}))

    @torch.inference_mode()
    def run(self, prompts, max_new_tokens, params, batch_size):
        forwards = [0]
        hook = self.model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
        sample = {} if params.greedy else {"temperature": params.temperature, "top_p": params.top_p,
                                           "top_k": params.top_k}  # fmt: skip
        if params.seed is not None:
            torch.manual_seed(params.seed)
        outputs, latencies = [], []
        try:
            for p in prompts:
                ids = torch.tensor([p])
                t0 = time.perf_counter()
                out = self.model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                    do_sample=not params.greedy, eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
                    **sample, **self.extra,
                )  # fmt: skip
                latencies.append(time.perf_counter() - t0)
                outputs.append(out[0, len(p) :].tolist())
        finally:
            hook.remove()
        return MethodRun(outputs, latencies, forwards[0])


def build_peers(kinds, target_dir, stop_ids, tokenizer, dtype) -> list[Method]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from ...models.io import parse_dtype

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch_dtype = parse_dtype(dtype)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch_dtype).eval()
    pad = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else stop_ids[0]
    out = []
    for kind in kinds:
        if kind == "hf_generate":
            out.append(HFMethod(kind, kind, model, stop_ids, pad, {}, {}))
        elif kind == "hf_assisted":
            assistant = truncated_assistant(target_dir, torch_dtype)
            settings = {"assistant": f"target's first {ASSISTANT_LAYERS} layers + final norm + lm_head",
                        **ASSISTED_SETTINGS}  # fmt: skip
            out.append(HFMethod(kind, kind, model, stop_ids, pad, ASSISTED_SETTINGS, settings, assistant=assistant))
        else:
            extra = {"prompt_lookup_num_tokens": PROMPT_LOOKUP_TOKENS}
            out.append(HFMethod(kind, kind, model, stop_ids, pad, extra, dict(extra)))
    return out


def truncated_assistant(target_dir, torch_dtype):
    """The target with only its first ASSISTANT_LAYERS decoder layers (weights of the rest are not loaded)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(str(target_dir))
    cfg.num_hidden_layers = ASSISTANT_LAYERS
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:ASSISTANT_LAYERS]
    return AutoModelForCausalLM.from_pretrained(str(target_dir), config=cfg, dtype=torch_dtype).eval()
