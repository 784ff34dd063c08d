"""External checks of exported drafters, run with the other tools' own code.

- speculators (vLLM's drafter library, in its own venv: it pins transformers <= 5.19): our speculators
  export is loaded by `Eagle3DraftModel.from_pretrained` and run through speculators' own forward
  (training-time test, several steps) on real target states; its draft logits must equal ours within
  fp32 tolerance, and the tensors it loaded must equal the ones we exported, bit for bit.
- llama.cpp: our GGUF export (target + EAGLE-3 drafter) runs in llama-server; its greedy text must equal
  `eaglespec generate`'s on the same prompts, and its acceptance is reported next to ours at the same
  draft length (chain of k).
Each returns a JSON-able record with the versions it ran.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import torch

SPECULATORS_FORWARD = Path(__file__).with_name("speculators_forward.py")
FP32_ATOL = 1e-4  # logits of order 10: fp32 rounding across two implementations stays far below this


def speculators_python() -> Path:
    env = os.environ.get("EAGLESPEC_SPECULATORS_PYTHON")
    return Path(env) if env else Path.home() / ".cache" / "eaglespec" / "venv-speculators" / "bin" / "python"


def speculators_unavailable() -> str | None:
    """None when the speculators venv is there, else why not (with the fix)."""
    py = speculators_python()
    if not py.is_file():
        return (f"no speculators environment at {py}: run scripts/interop/build_envs.sh "
                "(or set EAGLESPEC_SPECULATORS_PYTHON)")
    return None


def target_states(target_dir, ids: torch.Tensor):
    """(aux [1, T, A*H] captured by our target on `ids` [1, T], the target), fp32."""
    from ...models.checkpoint import load_target
    from ...train.ttt import Batch, target_features

    target = load_target(target_dir)
    batch = Batch(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([ids.shape[1]]))
    aux, _ = target_features(target, batch)
    return aux, target


def check_speculators(drafter_dir, target_dir, work, *, ids: torch.Tensor, steps: int = 3) -> dict:
    """Export `drafter_dir` as speculators under work/, run both forwards on the same inputs, compare."""
    from safetensors.torch import load_file, save_file

    from ...export import export_drafter
    from ...models.checkpoint import load_drafter
    from ...train.ttt import shift, ttt_forward

    work = Path(work)
    out = work / "speculators"
    export_drafter(drafter_dir, "speculators", out, target_dir=target_dir)
    aux, target = target_states(target_dir, ids)
    drafter = load_drafter(out, target=target)
    drafter.cfg.draft_attention_window = None  # speculators runs full attention; the inputs are short anyway
    with torch.no_grad():
        ours = ttt_forward(drafter, aux, ids, steps)
    inputs = work / "inputs.safetensors"  # speculators' step 0 reads token t+1 at row t: shift once
    save_file({"hidden_states": aux.contiguous(), "input_ids": shift(ids, 1).contiguous(),
               "position_ids": torch.arange(ids.shape[1])[None].contiguous()}, str(inputs))  # fmt: skip
    result = work / "speculators-out.safetensors"
    proc = subprocess.run([str(speculators_python()), str(SPECULATORS_FORWARD), str(out), str(inputs), str(result),
                           str(steps)], capture_output=True, text=True)  # fmt: skip
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"speculators could not load or run the export (exit {proc.returncode}):\n{tail}")
    theirs = load_file(str(result))
    info = json.loads(Path(str(result) + ".json").read_text())
    exported = load_file(str(out / "model.safetensors"))
    loaded_equal = all(torch.equal(v, theirs[f"loaded.{k}"].to(v.dtype)) for k, v in exported.items())
    diffs = [float((ours[k] - theirs[f"logits.{k}"]).abs().max()) for k in range(steps)]
    agree = [float((ours[k].argmax(-1) == theirs[f"logits.{k}"].argmax(-1)).float().mean()) for k in range(steps)]
    return {"drafter": str(drafter_dir), "eagle_version": drafter.cfg.eagle_version, "tokens": ids.shape[1],
            "ttt_steps": steps, "max_abs_logit_diff_per_step": diffs, "argmax_agreement_per_step": agree,
            "logit_scale": float(ours[0].abs().max()), "loaded_tensors_bit_exact": loaded_equal,
            "tensors": len(exported), "passed": loaded_equal and max(diffs) <= FP32_ATOL, **info}  # fmt: skip


def check_llamacpp(drafter_dir, target_dir, work, prompts: list[list[int]], *, max_new_tokens: int = 48,
                   k: int = 4, threads: int | None = None) -> dict:  # fmt: skip
    """Our GGUF export in llama-server vs `eaglespec generate` (fp32, greedy), plain and EAGLE-3 chain k."""
    from ...api import generate, load_engine, stop_ids_for
    from ...export import export_drafter
    from ...sampling import SamplingParams
    from ...stats import SpecStats
    from .llamacpp import gguf_methods

    threads = threads or torch.get_num_threads()
    files = export_drafter(drafter_dir, "gguf", Path(work) / "gguf", target_dir=target_dir, outtype="f32")
    target_gguf, drafter_gguf = files
    plain_engine = load_engine(target_dir, None, mode="off", dtype="fp32")
    stop_ids = stop_ids_for(plain_engine)
    ours = [generate(plain_engine, [p], max_new_tokens=max_new_tokens).results[0].output_ids for p in prompts]
    chain = load_engine(target_dir, drafter_dir, mode="chain", chain_k=k, adaptive=False, dtype="fp32")
    spec_stats, spec_out = SpecStats(), []
    for p in prompts:
        out = generate(chain, [p], max_new_tokens=max_new_tokens)
        spec_out.append(out.results[0].output_ids)
        spec_stats = spec_stats.merge(out.stats)
    settings = {"outtype": "f32", "lossless_check": "yes"}
    methods = gguf_methods(target_gguf, [("export", drafter_gguf, str(drafter_dir))], stop_ids, threads=threads,
                           kv="f32", chain_k=k, plain=True, settings=settings)  # fmt: skip
    greedy = SamplingParams(0.0, 1.0, 0, 0)
    try:
        runs = {m.kind: m.run(prompts, max_new_tokens, greedy, 1) for m in methods}
    finally:
        for m in methods:
            m.server.stop()
    theirs_plain, theirs_spec = runs["llamacpp_plain"], runs["llamacpp_eagle3"]
    same = lambda a, b: sum(x == y for x, y in zip(a, b))
    acc = lambda s: {"tau": round(s.tau, 3), "acceptance_rate": round(s.acceptance_rate, 3),
                     "per_position": [round(a, 3) for a in s.per_position_acceptance]}  # fmt: skip
    return {"drafter": str(drafter_dir), "target_gguf": str(target_gguf), "drafter_gguf": str(drafter_gguf),
            "prompts": len(prompts), "max_new_tokens": max_new_tokens, "draft_tokens_per_step": k,
            "plain_equal_prompts": same(theirs_plain.outputs, ours),
            "eagle3_equal_prompts": same(theirs_spec.outputs, ours),
            "ours_chain_equal_prompts": same(spec_out, ours),
            "acceptance_llamacpp": acc(theirs_spec.stats), "acceptance_eaglespec": acc(spec_stats),
            "llamacpp_build": llamacpp_build_info(),
            "passed": same(theirs_plain.outputs, ours) == same(theirs_spec.outputs, ours) == len(prompts)}  # fmt: skip


def llamacpp_build_info() -> str:
    from .llamacpp import llamacpp_root

    bin_dir = llamacpp_root() / "build" / "bin"
    try:
        proc = subprocess.run([str(bin_dir / "llama-server"), "--version"], capture_output=True, text=True, timeout=30)
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("version")]
        return lines[0] if lines else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
