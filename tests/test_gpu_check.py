"""scripts/gpu/check.py on CPU: its arguments and the JSON records a `--device cpu --quick` run writes
(the real run needs a CUDA machine)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from eaglespec.settings import default_models_dir

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu" / "check.py"


@pytest.fixture(scope="module")
def check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, needle", [
    (["--steps", "tests,warp"], "--steps takes a comma-separated subset"),
    (["--steps", ""], "--steps takes a comma-separated subset"),
    (["--batch-sizes", "1,x"], "--batch-sizes takes comma-separated integers"),
    (["--batch-sizes", "0"], "--batch-sizes must be positive"),
    (["--device", "tpu"], "--device is cuda or cpu"),
])  # fmt: skip
def test_bad_arguments_exit_2_with_what_to_fix(check, argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        check.parse_args(["--device", "cpu", *argv] if "--device" not in argv else argv)
    assert e.value.code == 2 and needle in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where no GPU is visible")
def test_cuda_without_a_gpu_says_how_to_smoke_test(check, capsys):
    with pytest.raises(SystemExit):
        check.parse_args([])
    assert "--device cpu --quick" in capsys.readouterr().err


def test_quick_cpu_run_writes_every_record(check, tmp_path):
    models = default_models_dir()
    out = tmp_path / "check"
    rc = check.main(["--device", "cpu", "--quick", "--out", str(out), "--steps", "gap,speed",
                     "--target", str(models / "target"), "--draft", str(models / "drafter-eagle3.1")])  # fmt: skip
    summary = json.loads((out / "summary.json").read_text())
    assert rc == 0 and summary["ok"], summary
    assert set(summary["steps"]) == {"gap", "speed"} and summary["environment"]["device"] == "cpu"
    gap = json.loads((out / "gap.json").read_text())
    assert gap["gaps"]["fp32"]["gap"] < 1e-3 and gap["auto"]["dtype"] == "fp32"
    assert set(gap["gaps"]) == {"fp32", "bf16", "fp16"}
    speed = json.loads((out / "speed.json").read_text())
    assert speed["ok"] and Path(speed["report"]).is_file()
    points = json.loads(Path(speed["report"]).read_text())["points"]
    assert {p["batch_size"] for p in points} == {1, 8} and {p["method"] for p in points} >= {"plain"}
    profile = speed["profile"]  # measured: the synthetic step's acceptance
    assert profile and all(0 <= x <= 1 for x in profile) and profile == sorted(profile, reverse=True)
