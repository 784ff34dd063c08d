"""Python API mirroring `eaglespec generate`: load models, turn inputs into requests, generate."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from .engine import BatchOutput, Engine, Request
from .models.checkpoint import load_drafter, load_target
from .models.drafter import set_attention_window
from .models.gguf import as_model_folder
from .models.io import CheckpointError
from .sampling import SamplingParams
from .speculation.config import SpecConfig


def load_tokenizer(path):
    """The HF tokenizer stored with a model (or in a .gguf target), or None when the directory has none."""
    path = Path(as_model_folder(path))
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_target_for_speculation(target, *, device: str = "cpu", dtype: str = "auto", quantize: str | None = None,
                                quantize_group: int | None = None):  # fmt: skip
    """(target, dtype, reason). dtype "auto": the fastest precision for the device (models/precision.py),
    kept only if a token's logits in a verification forward match its plain step's there (else fp32),
    so greedy speculation stays identical to plain decoding. quantize: "int8"/"int4" weight-only or
    "w8a8" quantization of the decoder layers (models/quantize.py), applied before that check."""
    from .models.fast_linear import prepare_for_inference
    from .models.io import read_config
    from .models.precision import choose_dtype, exactness_note, max_tree_plain_gap, tree_plain_gap
    from .models.quantize import apply_quantize, parse_quantize

    parse_quantize(quantize)  # bad input fails before anything loads
    target = as_model_folder(target)

    def load(name: str):
        return apply_quantize(load_target(target, device=device, dtype=name), quantize, quantize_group)

    raw = read_config(target)
    dims = {"hidden": raw.get("hidden_size", 1024), "intermediate": raw.get("intermediate_size", 4096),
            "vocab": raw.get("vocab_size", 32000)}  # fmt: skip
    chosen, why = choose_dtype(device, dtype, **dims)
    tgt = load(chosen)
    if dtype == "auto" and chosen != "fp32":
        gap = tree_plain_gap(prepare_for_inference(tgt))
        if gap > max_tree_plain_gap(tgt):  # faster, but verification would round unlike plain steps
            why = (f"{chosen} was faster ({why}) but its verification logits differ from plain steps by "
                   f"{gap:.3g} on this machine, which changes greedy tokens")  # fmt: skip
            chosen = "fp32"
            tgt = load(chosen)
    return tgt, chosen, why + exactness_note(next(tgt.parameters()))


RUNTIMES = ("auto", "torch", "llamacpp")
LLAMACPP_OUTTYPE = {"auto": "f32", "fp32": "f32", "bf16": "bf16", "fp16": "f16"}  # --dtype -> GGUF weights
LLAMACPP_QUANT = {"int8": "q8_0", "int4": "q4_0"}  # --quantize -> GGUF type (w8a8: torch only)


AUTO_LLAMACPP_MAX_ROWS = 16  # rows whose default trees (up to ~15 extra leaves each) fit llama.cpp's 254 sequence ids


def choose_runtime(target, requested: str, *, device: str, quantize: str | None,
                   max_num_seqs: int = 1) -> tuple[str, str]:  # fmt: skip
    """(runtime, why). auto: llama.cpp for a .gguf target on CPU when its library is built (on SmolLM2 its
    plain step is 1.7-3x faster than ours, BENCHMARKS.md "Target runtimes") and at most
    AUTO_LLAMACPP_MAX_ROWS rows decode at once; PyTorch otherwise."""
    from .models.gguf import is_gguf, source_gguf
    from .models.llamacpp.library import missing_reason

    target = source_gguf(target) or target  # a GGUF's converted folder: that GGUF
    if requested not in RUNTIMES:
        raise ValueError(f"--runtime must be one of {', '.join(RUNTIMES)}, got {requested!r}")
    if requested == "torch":
        return "torch", "PyTorch (--runtime torch)"
    why_not = missing_reason()
    if requested == "llamacpp":
        if device != "cpu":
            raise ValueError("--runtime llamacpp runs on the CPU; use --device cpu or --runtime torch")
        if quantize == "w8a8":
            raise ValueError("--quantize w8a8 is a PyTorch scheme; with --runtime llamacpp use int8 (Q8_0) or "
                             "int4 (Q4_0), or a quantized .gguf")  # fmt: skip
        if why_not:
            raise ValueError(f"--runtime llamacpp: {why_not}")
        return "llamacpp", "llama.cpp (--runtime llamacpp)"
    if device != "cpu" or not is_gguf(target) or quantize:
        return "torch", "PyTorch (auto: the target is not a .gguf file on the CPU without --quantize)"
    if why_not:
        return "torch", f"PyTorch (auto: {why_not})"
    if max_num_seqs > AUTO_LLAMACPP_MAX_ROWS:
        return "torch", (f"PyTorch (auto: {max_num_seqs} rows at once; llama.cpp's sequence ids hold the trees of "
                         f"{AUTO_LLAMACPP_MAX_ROWS}; --runtime llamacpp to use it anyway)")  # fmt: skip
    return "llamacpp", "llama.cpp (auto: a .gguf target on the CPU, its library built)"


DRAFT_RUNTIMES = ("auto", "torch", "llamacpp")


def drafter_on_runtime(drafter, target, target_folder, requested: str, target_runtime: str):
    """(drafter, why): the PyTorch drafter as loaded, or its layer run by llama.cpp
    (models/llamacpp/drafter.py; a drafter forward ~0.4 ms instead of ~2 ms on SmolLM2's, 2-vCPU EPYC).
    auto: llama.cpp where the target runs there, PyTorch beside a PyTorch target."""
    if requested not in DRAFT_RUNTIMES:
        raise ValueError(f"--draft-runtime must be one of {', '.join(DRAFT_RUNTIMES)}, got {requested!r}")
    if requested == "torch":
        return drafter, "PyTorch (--draft-runtime torch)"
    if requested == "auto" and target_runtime != "llamacpp":
        return drafter, "PyTorch (auto: as the target)"
    from .models.llamacpp.drafter import LlamaCppDrafter, drafter_gguf, unsupported_reason
    from .models.llamacpp.library import missing_reason

    why_not = missing_reason() or unsupported_reason(drafter)
    if why_not is None and drafter.fc.weight.device.type != "cpu":
        why_not = "llama.cpp runs the drafter on the CPU"
    if why_not:
        if requested == "llamacpp":
            raise ValueError(f"--draft-runtime llamacpp: {why_not}")
        return drafter, f"PyTorch (auto: {why_not})"
    embedding = (drafter.embed_tokens or target.model.embed_tokens).weight
    fast = LlamaCppDrafter(drafter, drafter_gguf(drafter, embedding, target_folder),
                           threads=getattr(target, "threads", None))  # fmt: skip
    return fast, f"llama.cpp ({'--draft-runtime llamacpp' if requested == 'llamacpp' else 'auto: as the target'})"


class NotExactError(ValueError):
    """A runtime whose verification rows do not have the bits of one-token steps on this machine."""


def load_llamacpp_target(target, *, dtype: str = "auto", quantize: str | None = None, speculate: bool = True):
    """(target, label, why) for the llama.cpp runtime: a .gguf file runs as it is; a folder is converted
    with llama.cpp's converter at --dtype (--quantize int8/int4: Q8_0/Q4_0). Speculation needs its
    exactness probe to pass (models/llamacpp/target.load_exact); else ValueError, or plain decoding
    when speculate is False."""
    from .export.llamacpp_convert import convert_target, quantize_gguf
    from .models.gguf import is_gguf, source_gguf
    from .models.llamacpp.library import llamacpp_root
    from .models.llamacpp.target import load_exact

    target = source_gguf(target) or target  # a GGUF's converted folder: that GGUF
    folder = Path(as_model_folder(target))
    if is_gguf(target):
        if quantize:
            raise ValueError(f"--quantize {quantize} with a .gguf target: the file's own quantization runs as "
                             "it is; give a folder to quantize, or another .gguf")  # fmt: skip
        gguf = Path(target)
    else:
        root = llamacpp_root()
        qtype = LLAMACPP_QUANT.get(quantize)
        gguf = convert_target(root, folder, qtype if qtype == "q8_0" else LLAMACPP_OUTTYPE[dtype])
        if qtype == "q4_0":  # the converter writes no 4-bit type: llama.cpp's own quantizer does
            gguf = quantize_gguf(root, gguf, qtype)
    tgt, not_exact = load_exact(gguf, folder)
    if not_exact and speculate:
        raise NotExactError(f"{not_exact}: speculation would not be lossless; use --runtime torch or --mode off")
    why = "its verification rows have the same bits as one-token steps (probe)" if not not_exact else not_exact
    return tgt, tgt.describe(), why


def load_drafter_for(target, draft, *, device: str = "cpu", dtype: str = "fp32", window: int | None = None):
    """A drafter directory loaded for a loaded target (checked against it, on `device` in `dtype`), with
    its attention window set: `window` None keeps its config's draft_attention_window, 0 removes it."""
    drafter = load_drafter(draft, target=target, device=device, dtype=dtype)
    set_attention_window(drafter, window, target.cfg.max_position_embeddings)
    return drafter


def load_engine(
    target: str | os.PathLike,
    draft: str | os.PathLike | None = None,
    *,
    device: str = "cpu",
    dtype: str = "auto",
    draft_window: int | None = None,
    compile: str = "off",
    expected_tokens: int | None = None,
    quantize: str | None = None,
    quantize_group: int | None = None,
    runtime: str = "torch",
    draft_runtime: str = "auto",
    max_num_seqs: int = 1,
    **spec_fields,
) -> Engine:
    """Load a target (and drafter) directory into an Engine, validating that they fit.

    dtype "auto" picks the fastest lossless precision for the device (models/precision.py); the
    choice and its reason are in `engine.precision`. draft_window: the drafter's attention window
    (None: its config's draft_attention_window, 0: none). compile: "on", "off" or "auto"
    (models/compiled.py; `expected_tokens` is the job's size, None for a server); the choice and its
    reason are in `engine.compiled`. quantize: "int8" or "int4" weight-only (or "w8a8") quantization of
    the target's decoder layers (models/quantize.py; speculation is lossless against the quantized
    target), int4 in groups of `quantize_group` input channels. runtime: "auto", "torch" or "llamacpp"
    (choose_runtime, for up to `max_num_seqs` rows at once; the choice and its reason are in `engine.runtime`);
    draft_runtime: the drafter's (drafter_on_runtime; `engine.draft_runtime`).
    spec_fields: how to speculate, the
    fields of speculation/config.SpecConfig (mode, tree, chain_k, adaptive, confidence, ngram_tokens,
    draft_prefill_window), with its defaults."""
    import torch

    spec = SpecConfig(**spec_fields)  # bad settings fail before anything loads
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but no CUDA GPU is available; use --device cpu")
    runtime, runtime_why = choose_runtime(target, runtime, device=device, quantize=quantize, max_num_seqs=max_num_seqs)
    speculates = draft is not None and spec.speculates
    if runtime == "llamacpp":
        try:
            tgt, dtype, why = load_llamacpp_target(target, dtype=dtype, quantize=quantize, speculate=speculates)
            compile, draft_dtype = "off", "fp32"
        except NotExactError as e:
            if not runtime_why.startswith("llama.cpp (auto"):
                raise
            runtime, runtime_why = "torch", f"PyTorch (auto: {e})"
    target = as_model_folder(target)  # a .gguf file: its converted folder (models/gguf.py)
    if runtime == "torch":
        tgt, dtype, why = load_target_for_speculation(target, device=device, dtype=dtype, quantize=quantize,
                                                      quantize_group=quantize_group)  # fmt: skip
        draft_dtype = dtype
    drafter, draft_why = None, "no drafter"
    if speculates:
        drafter = load_drafter_for(tgt, draft, device=device, dtype=draft_dtype, window=draft_window)
        drafter, draft_why = drafter_on_runtime(drafter, tgt, target, draft_runtime, runtime)
    engine = Engine(tgt, drafter, spec, tokenizer=load_tokenizer(target))
    engine.precision = (dtype, why)
    engine.runtime = (runtime, runtime_why)
    engine.draft_runtime = draft_why
    engine.compiled = choose_compile(engine, compile, expected_tokens)
    return engine


COMPILE_MEASURE_MIN_TOKENS = 20_000  # a job this big may pay for measuring compile (tens of seconds)


def choose_compile(engine: Engine, requested: str, expected_tokens: int | None = None) -> tuple[bool, str]:
    """Compile the engine's models or not (models/compiled.py); returns (compiled, reason). "auto" uses
    the measurement cached for this machine and models, measuring it first when the job can pay for that."""
    from .models import compiled
    from .models.precision import max_tree_plain_gap, tree_plain_gap
    from .speculation.costs import cache_key, load_or_calibrate

    if requested not in compiled.CHOICES:
        raise ValueError(f"--compile must be one of {', '.join(compiled.CHOICES)}, got {requested!r}")
    if requested == "off":
        return False, "eager (--compile off, the default; on or auto to compile)"
    models = [m for m in (engine.target, engine.drafter) if m is not None and getattr(m, "runtime", "torch") == "torch"]
    if not models:
        return False, "eager (llama.cpp runs the models)"
    if all(compiled.is_compiled(m) for m in models):
        return True, "compiled (these models were compiled before)"
    key = cache_key(engine.target, engine.drafter, 1)
    if requested == "on":
        why = "compiled (requested)"
    else:
        verdict = compiled.read_verdicts().get(key)
        if isinstance(verdict, dict) and "failed" in verdict:
            return False, f"eager (compiling failed here before: {verdict['failed']})"
        if not compiled.valid_verdict(verdict):
            if expected_tokens is not None and expected_tokens < COMPILE_MEASURE_MIN_TOKENS:
                return False, (f"eager (compiling is not measured on this machine yet and {expected_tokens} "
                               "tokens would not pay for it; a longer job, `eaglespec serve` or `--compile on` "
                               "measures it)")  # fmt: skip
            eager_step = load_or_calibrate(engine.target, engine.drafter, 1).verify_cost(1)
            t0 = time.perf_counter()
            failure = compiled.try_compiled(models, engine.exercise)
            if failure:
                compiled.write_verdict(key, {"failed": failure})
                return False, failure
            compile_s = time.perf_counter() - t0
            compiled_step = load_or_calibrate(engine.target, engine.drafter, 1).verify_cost(1)
            verdict = {"eager_step_s": eager_step, "compiled_step_s": compiled_step, "compile_s": compile_s}
            compiled.write_verdict(key, verdict)
        use, why = compiled.decide(verdict, expected_tokens)
        if not use:
            for m in models:
                compiled.uncompile(m)
            return False, why
    failure = compiled.try_compiled(models, engine.exercise)
    if failure:
        return False, failure
    gap = tree_plain_gap(engine.target)
    if gap > max_tree_plain_gap(engine.target):  # the compiled kernels round a verification unlike a plain step
        for m in models:
            compiled.uncompile(m)
        return False, f"eager (compiled verification logits differ from plain steps by {gap:.3g} here)"
    return True, why


def stop_ids_for(engine: Engine) -> tuple[int, ...]:
    """EOS ids from the tokenizer and the target's generation_config.json."""
    ids = set()
    tok = engine.tokenizer
    if tok is not None and tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    hf = engine.target.hf_config
    eos = getattr(hf, "eos_token_id", None) if hf is not None else None
    ids.update([eos] if isinstance(eos, int) else (eos or []))
    return tuple(sorted(ids))


def parse_inputs(lines: list[dict], tokenizer, *, where: str = "input") -> list[list[int]]:
    """Each item: {"prompt": str}, {"prompt_ids": [int]} or {"messages": [...]} (chat template)."""
    prompts = []
    for i, item in enumerate(lines):
        if not isinstance(item, dict):
            raise ValueError(f"{where} line {i + 1}: expected a JSON object, got {type(item).__name__}")
        if "prompt_ids" in item:
            ids = item["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(x, int) for x in ids):
                raise ValueError(f"{where} line {i + 1}: prompt_ids must be a list of integers")
            prompts.append(ids)
            continue
        if tokenizer is None:
            raise ValueError(f"{where} line {i + 1}: the target has no tokenizer; give prompt_ids instead of text")
        if "messages" in item:
            try:
                ids = tokenizer.apply_chat_template(item["messages"], add_generation_prompt=True, tokenize=True)
            except Exception as e:  # jinja/template errors carry the useful message
                raise ValueError(f"{where} line {i + 1}: cannot apply the chat template: {e}") from None
            if hasattr(ids, "keys"):
                ids = ids["input_ids"]
            prompts.append(list(ids))
        elif "prompt" in item:
            if not isinstance(item["prompt"], str):
                raise ValueError(f"{where} line {i + 1}: prompt must be a string")
            prompts.append(tokenizer.encode(item["prompt"], add_special_tokens=False))
        else:
            raise ValueError(f"{where} line {i + 1}: needs one of 'prompt', 'prompt_ids' or 'messages'")
    return prompts


def read_jsonl(path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"input file {str(path)!r} does not exist")
    items = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                items.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
    if not items:
        raise ValueError(f"input file {path} has no prompts")
    return items


def generate(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams = SamplingParams(),
    *,
    max_new_tokens: int = 128,
    stop_strings: tuple[str, ...] = (),
    batch_size: int = 1,
    on_tokens=None,
) -> BatchOutput:
    reqs = [Request(p, max_new_tokens, stop_ids_for(engine), tuple(stop_strings)) for p in prompts]
    return engine.generate(reqs, params, batch_size=batch_size, on_tokens=on_tokens)


__all__ = ["CheckpointError", "generate", "load_engine", "load_tokenizer", "parse_inputs", "read_jsonl"]
