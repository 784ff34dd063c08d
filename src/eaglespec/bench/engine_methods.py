"""Our engine as bench methods: plain decoding and auto / chain / tree per drafter, every one on the
same loaded target (Models), and the sweeps' and --auto's settings of a method.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

from ..api import (
    choose_compile,
    choose_runtime,
    drafter_on_runtime,
    load_drafter_for,
    load_llamacpp_target,
    load_target_for_speculation,
    load_tokenizer,
    stop_ids_for,
)
from ..engine import Engine, Request
from ..models.gguf import as_model_folder
from ..speculation.config import TreeShape
from .method import Method, MethodRun, tensor_bytes, weight_bytes_per_forward

OUR_KINDS = ("plain", "auto", "chain", "tree")  # auto: the cost-aware policy (generate's default)
SPEC_KINDS = ("auto", "chain", "tree")


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
        if batch_size > 1:  # its KV caches (GBs at batch 512) go before the next method's are made; at batch 1
            eng.core = None  # the next call empties and reuses them (a llama.cpp context takes 0.3 s to 6 s to make)
        return MethodRun(
            [r.output_ids for r in out.results], [r.stats.wall_time for r in out.results],
            out.stats.target_forwards, out.stats,
        )  # fmt: skip


def drafter_labels(drafts: list) -> list[str]:
    """Short names: the EAGLE version when it tells drafters apart, else the folder name."""
    from ..models.drafter_config import DrafterConfig
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
                quantize_group: int | None = None, draft_window: int | None = None,
                runtime: str = "torch", max_num_seqs: int = 1, draft_runtime: str = "auto") -> Models:  # fmt: skip
    """The target as `generate` loads it (api.choose_runtime; PyTorch: api.load_target_for_speculation, dtype
    "auto" keeps a precision only where verification matches plain steps; llama.cpp: api.load_llamacpp_target,
    its exactness probed) and each drafter for it (api.load_drafter_for, on api.drafter_on_runtime's runtime)."""
    quantize = None if quantize == "none" else quantize
    runtime, _ = choose_runtime(target_dir, runtime, device="cpu", quantize=quantize,
                                max_num_seqs=max_num_seqs)  # fmt: skip
    if runtime == "llamacpp":
        target, label, _ = load_llamacpp_target(target_dir, dtype=dtype, quantize=quantize, speculate=bool(drafts))
        print(f"[bench] target runtime: {label}", file=sys.stderr)
        dtype = "fp32"  # the drafters' precision, and the F32 GGUF the llama.cpp peer converts for comparison
    else:
        target, dtype, _why = load_target_for_speculation(target_dir, dtype=dtype, quantize=quantize,
                                                          quantize_group=quantize_group)  # fmt: skip
    folder = as_model_folder(target_dir)
    drafters = []
    for d, label in zip(drafts, drafter_labels(drafts)):
        drafter, why = drafter_on_runtime(load_drafter_for(target, d, dtype=dtype, window=draft_window), target,
                                          folder, draft_runtime, runtime)  # fmt: skip
        print(f"[bench] drafter {label}: {why}", file=sys.stderr)
        drafters.append((label, Path(d), drafter))
    return Models(Path(target_dir), target, load_tokenizer(target_dir), drafters, dtype,
                  quantize=quantize if quantize != "none" else None)  # fmt: skip


def compile_models(models: Models, requested: str, expected_tokens: int) -> tuple[bool, str]:
    """Compile the shared target and every drafter (models/compiled.py) as `requested` ("auto": as
    `generate` would for a job of `expected_tokens`: api.choose_compile decides on the first engine, the
    other drafters follow). Returns (compiled, reason)."""
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
                "draft_prefill_window": engine.spec.prefill_window, **shape_settings(kind, engine.shape)}
    return EngineMethod(name or f"{kind}[{label}]", kind, engine, settings)


def use_synthetic_acceptance(methods: list[Method], profile: list[float]) -> None:
    """Make our chain/tree methods accept by `profile` (speculation/synthetic.py): a cost benchmark whose rows are
    not lossless, so the lossless check leaves them out."""
    for m in methods:
        if isinstance(m, EngineMethod) and m.kind in SPEC_KINDS:
            m.engine.configure(synthetic_acceptance=tuple(profile))
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
                shape = tree if kind != "auto" else None  # auto: the policy's maxima (speculation/config.py)
                methods.append(spec_method(models, label, path, drafter, kind, tree=shape, chain_k=chain_k,
                                           adaptive=adaptive))  # fmt: skip
    return methods
