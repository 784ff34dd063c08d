"""Decoding methods measured side by side: our engine (plain / chain / tree per drafter) and peers.

Every method maps token-id prompts to token-id outputs with the same stop ids, so outputs compare
token for token. Peers run one prompt at a time: transformers' assisted generation and prompt lookup
support batch 1 only, and plain `generate` stays at batch 1 too so padding cannot change its numerics.

hf_assisted's assistant is the target truncated to its first ASSISTANT_LAYERS layers plus the final
norm and lm_head (same weights, same tokenizer): a draft model that exists for every target without
training, in the spirit of LayerSkip's early exit. It is a peer baseline, not a tuned draft model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..api import load_tokenizer, stop_ids_for
from ..engine import AUTO_MAX_DEPTH, AUTO_MAX_NODES, AUTO_WIDTHS, Engine, Request
from ..models.drafter import load_drafter
from ..sampling import SamplingParams
from ..speculation.proposer import TreeShape
from ..stats import SpecStats

OUR_KINDS = ("plain", "auto", "chain", "tree")  # auto: the cost-aware policy (generate's default)
PEER_KINDS = ("hf_generate", "hf_assisted", "prompt_lookup")
ALL_KINDS = OUR_KINDS + PEER_KINDS
SPEC_KINDS = ("auto", "chain", "tree")
LLAMACPP_KINDS = ("llamacpp_plain", "llamacpp_eagle3")  # opt-in (not in "all"): needs scripts/llamacpp/build.sh
ASSISTANT_LAYERS = 2
RANDOM_WEIGHTS = "random weights, near-tied logits"  # why --shape peers are left out of the lossless check
PROMPT_LOOKUP_TOKENS = 10  # the value transformers' docs use
# transformers' defaults for assisted generation, passed explicitly so the report states them
ASSISTED_SETTINGS = {"num_assistant_tokens": 20, "num_assistant_tokens_schedule": "constant",
                     "assistant_confidence_threshold": 0.4}  # fmt: skip


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


def parse_kinds(text: str | None) -> list[str]:
    from ..suites import parse_choices

    return list(ALL_KINDS) if text in (None, "all") else parse_choices(text, ALL_KINDS + LLAMACPP_KINDS, "methods")


def tensor_bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def weight_bytes_per_forward(model) -> int:
    """Bytes of weights one forward reads: every parameter once, except an untied input embedding
    (a forward gathers only a few of its rows). Same for our LlamaTarget and HF Llama-family models."""
    from ..models.quantize import QuantizedLinear

    embed = model.model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    quantized = sum(m.weight_bytes() for m in model.modules() if isinstance(m, QuantizedLinear))  # buffers
    return tensor_bytes(p for p in model.parameters() if tied or p is not embed) + quantized


class EngineMethod(Method):
    """Our engine; mode off for plain. Shares one loaded target with the other engine methods."""

    def __init__(self, name, kind, engine: Engine, settings: dict):
        tgt = engine.target
        drafter_bytes = 0
        if engine.drafter is not None:
            drafter_bytes = tensor_bytes(p for n, p in engine.drafter.named_parameters() if "embed_tokens" not in n)
        super().__init__(name, kind, settings, weight_bytes_per_forward(tgt),
                         tensor_bytes(tgt.parameters()) + drafter_bytes)  # fmt: skip
        self.engine = engine

    def prepare(self, max_batch: int) -> None:
        self.engine.prepare_policies(max_batch)  # step costs per batch bucket: cached on disk, else measured now

    def run(self, prompts, max_new_tokens, params, batch_size):
        eng = self.engine
        if eng.drafter is not None:  # engines share the target: select this drafter's aux layers again
            eng.target.set_aux_layers(tuple(eng.drafter.cfg.aux_layer_ids or ()) or None)
        stop = stop_ids_for(eng)
        out = eng.generate([Request(p, max_new_tokens, stop) for p in prompts], params, batch_size=batch_size)
        return MethodRun(
            [r.output_ids for r in out.results], [r.stats.wall_time for r in out.results],
            out.stats.target_forwards, out.stats,
        )  # fmt: skip


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


def drafter_labels(drafts: list) -> list[str]:
    """Short names: the EAGLE version when it tells drafters apart, else the folder name."""
    from ..models.drafter import DrafterConfig
    from ..models.io import read_config

    versions = [DrafterConfig.from_dict(read_config(d)).eagle_version for d in drafts]
    if len(set(versions)) == len(versions):
        return versions
    names = [Path(d).name for d in drafts]
    return names if len(set(names)) == len(names) else [f"{n}#{i}" for i, n in enumerate(names)]


@dataclass
class Models:
    """The target (loaded once, shared by every engine method) and the drafters, with short labels."""

    target_dir: Path
    target: object
    tokenizer: object
    drafters: list[tuple[str, Path, object]]  # (label, path, Eagle3Drafter)
    dtype: str = "fp32"
    compiled: str = "eager"
    quantize: str | None = None  # our target's --quantize (the llama.cpp peer picks its nearest GGUF type)
    draft_prefill_window: int | None = None  # prompt tokens the drafters read at prefill (None: the default)


def load_models(target_dir, drafts: list, dtype: str = "auto", quantize: str | None = None,
                quantize_group: int | None = None, draft_window: int | None = None) -> Models:  # fmt: skip
    from ..api import load_target_for_speculation
    from ..models.drafter import set_attention_window

    target, dtype, _why = load_target_for_speculation(target_dir, dtype=dtype, quantize=quantize,
                                                      quantize_group=quantize_group)  # fmt: skip
    drafters = [(label, Path(d), load_drafter(d, target=target, dtype=dtype))
                for d, label in zip(drafts, drafter_labels(drafts))]  # fmt: skip
    for _, _, drafter in drafters:
        set_attention_window(drafter, draft_window, target.cfg.max_position_embeddings)
    return Models(Path(target_dir), target, load_tokenizer(target_dir), drafters, dtype,
                  quantize=quantize if quantize != "none" else None)  # fmt: skip


def compile_models(models: Models, requested: str, expected_tokens: int) -> tuple[bool, str]:
    """Compile the shared target and every drafter (models/compiled.py) as `requested` ("auto": as
    `generate` would for a job of `expected_tokens`). Returns (compiled, reason)."""
    from ..api import choose_compile

    engines = [Engine(models.target, d, mode="auto") for _, _, d in models.drafters] or \
        [Engine(models.target, None, mode="off")]  # fmt: skip
    use, why = choose_compile(engines[0], requested, expected_tokens)
    for engine in engines[1:] if use else []:
        ok, reason = choose_compile(engine, "on")
        if not ok:
            raise RuntimeError(f"compiling a second drafter failed after the first worked: {reason}")
    models.compiled = why
    return use, why


def plain_method(models: Models) -> EngineMethod:
    return EngineMethod("plain", "plain", Engine(models.target, None, mode="off", tokenizer=models.tokenizer), {})


def spec_method(models: Models, label: str, path, drafter, kind: str, *, tree: TreeShape | None = None,
                chain_k: int = 4, adaptive: bool = True, name: str | None = None) -> EngineMethod:  # fmt: skip
    window = {} if models.draft_prefill_window is None else {"draft_prefill_window": models.draft_prefill_window}
    engine = Engine(models.target, drafter, mode=kind, tree=tree, chain_k=chain_k, tokenizer=models.tokenizer,
                    adaptive=adaptive, **window)  # fmt: skip
    settings = {"drafter": str(path), "eagle_version": drafter.cfg.eagle_version, "adaptive": adaptive,
                "draft_attention_window": drafter.cfg.draft_attention_window,
                "draft_prefill_window": engine.draft_prefill_window, **shape_settings(kind, engine.shape)}
    return EngineMethod(name or f"{kind}[{label}]", kind, engine, settings)


def use_synthetic_acceptance(methods: list[Method], profile: list[float]) -> None:
    """Make our chain/tree methods accept by `profile` (speculation/synthetic.py): a cost benchmark whose rows are
    not lossless, so the lossless check leaves them out."""
    for m in methods:
        if isinstance(m, EngineMethod) and m.kind in SPEC_KINDS:
            m.engine.synthetic_acceptance = list(profile)
            m.lossless = False
            m.settings["synthetic_acceptance"] = list(profile)


def shape_settings(kind: str, shape: TreeShape) -> dict:
    """The settings `eaglespec generate` takes (what --auto saves)."""
    if kind == "chain":
        return {"mode": "chain", "chain_k": shape.depth}
    if kind == "auto":
        return {"mode": "auto", "tree_depth": shape.depth}
    return {"mode": "tree", "tree_depth": shape.depth, "tree_topk": shape.top_k, "tree_tokens": shape.num_nodes}


def engine_methods(models: Models, kinds: list[str], *, tree: TreeShape, chain_k: int,
                   adaptive: bool = True) -> list[Method]:  # fmt: skip
    """plain, then chain and tree per drafter, as requested in `kinds`."""
    if any(k in SPEC_KINDS for k in kinds) and not models.drafters:
        raise ValueError("auto/chain/tree methods need a drafter: pass --draft DIR "
                         "(or --methods plain,hf_generate,...)")
    methods: list[Method] = [plain_method(models)] if "plain" in kinds else []
    for label, path, drafter in models.drafters:
        for kind in SPEC_KINDS:
            if kind in kinds:
                shape = tree if kind != "auto" else TreeShape(AUTO_MAX_DEPTH, max(AUTO_WIDTHS), AUTO_MAX_NODES)
                methods.append(spec_method(models, label, path, drafter, kind, tree=shape, chain_k=chain_k,
                                           adaptive=adaptive))  # fmt: skip
    return methods


def build_methods(kinds: list[str], models: Models, *, tree: TreeShape, chain_k: int, adaptive: bool = True,
                  gguf_source=None) -> list[Method]:  # fmt: skip
    """Our engine's methods, then the peers. gguf_source: a --shape target's folder for llama.cpp's converter
    (random weights: its rows stay out of the lossless check, near-tied logits round either way)."""
    methods = engine_methods(models, kinds, tree=tree, chain_k=chain_k, adaptive=adaptive)
    peers = [k for k in kinds if k in PEER_KINDS]
    llama = [k for k in kinds if k in LLAMACPP_KINDS]
    if peers or llama:
        stop_ids = stop_ids_for(Engine(models.target, None, mode="off", tokenizer=models.tokenizer))
    if peers:
        methods += build_peers(peers, models.target_dir, stop_ids, models.tokenizer, models.dtype)
    if llama:
        from .peers.llamacpp import llamacpp_methods

        methods += llamacpp_methods(llama, models.target_dir, [(lb, p) for lb, p, _ in models.drafters], stop_ids,
                                    threads=torch.get_num_threads(), dtype=models.dtype, chain_k=chain_k,
                                    source_dir=gguf_source,
                                    not_lossless=RANDOM_WEIGHTS if gguf_source else None,
                                    quantize=models.quantize)  # fmt: skip
    return methods


def build_peers(kinds, target_dir, stop_ids, tokenizer, dtype) -> list[Method]:
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from ..models.io import parse_dtype

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
