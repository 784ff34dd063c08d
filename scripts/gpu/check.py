"""The CUDA check: one run that says whether eaglespec's CUDA path is lossless and how fast it is.

Run by `scripts/gpu/check.sh` on a machine with a CUDA GPU and torch installed (the repo's install line
does the rest). Steps, each writing JSON records under --out (one file per step, plus summary.json):

  tests      the test suite's CUDA cases (tests/test_cuda.py), with pytest's summary line
  gap        tree-vs-plain logit gap of the target on the device in fp32, bf16 and fp16, and what
             `--dtype auto` chooses there and why (models/precision.py)
  speed      the target plain vs speculative (its bundled drafter, `auto`) at batch 1, 8 and 64:
             `eaglespec bench --sweep batch` on the chat and code suites
  synthetic  a random Llama-3.2-1B-shaped body with synthetic acceptance at the drafter's per-position
             profile measured by `speed` (`eaglespec bench --shape llama-3.2-1b`)

--quick shrinks every step (CPU smoke runs: `--device cpu --quick`). A failed step is recorded with its
error and the others still run; the exit code is 1 when any step failed or a lossless check failed.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = ("tests", "gap", "speed", "synthetic")
DTYPES = ("fp32", "bf16", "fp16")
# the per-position acceptance used for `synthetic` when `speed` has not measured one (EAGLE-3 papers' range)
FALLBACK_PROFILE = (0.8, 0.6, 0.45, 0.3)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=f"runs/gpu-check-{time.strftime('%Y%m%d-%H%M%S')}",
                   help="folder for the JSON records (default: runs/gpu-check-DATE)")  # fmt: skip
    p.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke runs)")
    p.add_argument("--quick", action="store_true", help="tiny sizes everywhere (a smoke run, not a measurement)")
    p.add_argument("--steps", default=",".join(STEPS), help=f"comma-separated subset of {','.join(STEPS)}")
    p.add_argument("--target", help="target folder or .gguf (default: SmolLM2-135M-Instruct with its drafter)")
    p.add_argument("--draft", help="drafter folder (default: the one bundled for the target)")
    p.add_argument("--batch-sizes", default="1,8,64", help="batch sizes of the speed step (default 1,8,64)")
    args = p.parse_args(argv)
    steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in steps if s not in STEPS]
    if unknown or not steps:
        p.error(f"--steps takes a comma-separated subset of {','.join(STEPS)}; got {args.steps!r}")
    args.steps = steps
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        p.error(f"--batch-sizes takes comma-separated integers, got {args.batch_sizes!r}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        p.error("--batch-sizes must be positive")
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        p.error(f"--device is cuda or cpu, got {args.device!r}")
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            p.error("no CUDA GPU is visible to torch (torch.cuda.is_available() is False); run it on a CUDA "
                    "machine, or smoke-test the script with --device cpu --quick")  # fmt: skip
    if args.quick:
        args.batch_sizes = args.batch_sizes[:2]
    return args


def write(out: Path, name: str, record: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")


def environment(args) -> dict:
    import torch

    rec = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "device": args.device, "quick": args.quick,
           "torch": torch.__version__, "python": platform.python_version(), "host": platform.node()}  # fmt: skip
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    rec["commit"] = rev.stdout.strip() or None
    if torch.cuda.is_available():
        rec["gpu"] = torch.cuda.get_device_name(0)
        rec["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
        rec["cuda"] = torch.version.cuda
    else:
        from eaglespec.machine import cpu_name

        rec["cpu"] = cpu_name()
    return rec


def models(args) -> tuple[Path, Path | None]:
    from eaglespec.settings import resolve_models

    target, drafts = resolve_models(args.target, [args.draft] if args.draft else [])
    return target, drafts[0] if drafts else None


def step_tests(args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests/test_cuda.py",
           f"--junitxml={out / 'tests-junit.xml'}"]  # fmt: skip
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env(args))
    lines = [x for x in r.stdout.splitlines() if x.strip()]
    return {"command": " ".join(cmd), "returncode": r.returncode, "summary": lines[-1] if lines else "",
            "seconds": round(time.perf_counter() - t0, 1), "ok": r.returncode in (0, 5),  # 5: nothing collected
            "output_tail": r.stdout[-4000:] + r.stderr[-2000:]}  # fmt: skip


def step_gap(args, out: Path) -> dict:
    import torch

    from eaglespec.api import load_engine
    from eaglespec.models.precision import max_tree_plain_gap, tree_plain_gap

    target, _ = models(args)
    rows = {}
    for dtype in DTYPES:
        try:
            engine = load_engine(target, None, device=args.device, dtype=dtype, mode="off")
            gap = tree_plain_gap(engine.target, prompt_len=8 if args.quick else 40, tree_len=5 if args.quick else 17)
            rows[dtype] = {"gap": gap, "allowed": max_tree_plain_gap(engine.target),
                           "lossless_by_gap": gap <= max_tree_plain_gap(engine.target)}  # fmt: skip
            del engine
        except Exception as e:  # e.g. fp16 kernels missing on CPU
            rows[dtype] = {"error": f"{type(e).__name__}: {e}"}
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    auto = load_engine(target, None, device=args.device, dtype="auto", mode="off")
    chosen, why = auto.precision
    return {"target": str(target), "gaps": rows, "auto": {"dtype": chosen, "why": why}, "ok": True}


def _bench(args, out: Path, name: str, extra: list[str]) -> dict:
    cmd = [sys.executable, "-m", "eaglespec.cli", "bench", "--device", args.device, "--out", str(out / name), *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env(args))
    rec = {"command": " ".join(cmd), "returncode": r.returncode, "seconds": round(time.perf_counter() - t0, 1),
           "ok": r.returncode == 0, "stderr_tail": r.stderr[-3000:]}  # fmt: skip
    report = out / name / ("sweep_batch.json" if "--sweep" in extra else "bench.json")
    if report.is_file():
        rec["report"] = str(report)
    return rec


def step_speed(args, out: Path) -> dict:
    target, draft = models(args)
    extra = ["--target", str(target), "--sweep", "batch", "--sweep-values", ",".join(map(str, args.batch_sizes)),
             "--methods", "plain,auto", "--categories", "chat,code", "--limit", "1" if args.quick else "8",
             "--max-new-tokens", "8" if args.quick else "96"]  # fmt: skip
    if draft is not None:
        extra += ["--draft", str(draft)]
    rec = _bench(args, out, "speed", extra)
    rec["profile"] = _profile(out / "speed")
    return rec


def _profile(folder: Path) -> list[float] | None:
    """Per-position acceptance (share of drafts with >= i accepted), drafts-weighted over the speculative
    rows of a bench run (bench.json `results` or a sweep's `points`)."""
    drafts, sums = 0, []
    for path in folder.glob("*.json"):
        data = json.loads(path.read_text())
        rows = (data.get("results") or data.get("points") or []) if isinstance(data, dict) else []
        for row in rows:
            n, per = row.get("drafts") or 0, row.get("per_position_acceptance") or []
            if n and per:
                sums = [a + n * b for a, b in zip(sums + [0.0] * (len(per) - len(sums)), per)]
                drafts += n
    if not drafts:
        return None
    profile = [round(min(1.0, x / drafts), 3) for x in sums]
    return [min(profile[: i + 1]) for i in range(len(profile))]  # non-increasing, as bench requires


def step_synthetic(args, out: Path, profile: list[float] | None) -> dict:
    use = list(profile or FALLBACK_PROFILE)
    extra = ["--shape", "llama-3.2-1b", "--synthetic-acceptance", ",".join(map(str, use)),
             "--methods", "plain,chain,tree", "--limit", "1" if args.quick else "4",
             "--max-new-tokens", "8" if args.quick else "128",
             "--prompt-len", "16" if args.quick else "128"]  # fmt: skip
    rec = _bench(args, out, "synthetic", extra)
    rec["profile"] = use
    rec["profile_from"] = "speed step" if profile else "FALLBACK_PROFILE (no measured profile)"
    return rec


def _env(args) -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"environment": environment(args), "steps": {}}
    write(out, "environment", summary["environment"])
    profile = None
    for name in args.steps:
        t0 = time.perf_counter()
        print(f"[gpu-check] {name} ...", file=sys.stderr, flush=True)
        try:
            if name == "synthetic":
                rec = step_synthetic(args, out, profile)
            else:
                rec = {"tests": step_tests, "gap": step_gap, "speed": step_speed}[name](args, out)
        except Exception as e:
            rec = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        rec["step_seconds"] = round(time.perf_counter() - t0, 1)
        profile = rec.get("profile") if name == "speed" else profile
        write(out, name, rec)
        summary["steps"][name] = {"ok": rec.get("ok", False), "seconds": rec["step_seconds"]}
        print(f"[gpu-check] {name}: {'ok' if rec.get('ok') else 'FAILED'} ({rec['step_seconds']} s)", file=sys.stderr)
    summary["ok"] = all(s["ok"] for s in summary["steps"].values())
    write(out, "summary", summary)
    print(f"[gpu-check] records in {out}/ ({'all ok' if summary['ok'] else 'some steps failed'})", file=sys.stderr)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
