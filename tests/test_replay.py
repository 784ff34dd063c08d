"""Acceptance by replay (bench/replay.py) against acceptance measured through the target: the same drafts,
acceptance per position and output on every prompt and shape, on the bundled 8.4M target and its drafter."""

from __future__ import annotations

import pytest
import torch

from eaglespec.settings import DEFAULT_DRAFTERS, TINY_TARGET, default_models_dir

TARGET, DRAFTER = default_models_dir() / TINY_TARGET, default_models_dir() / DEFAULT_DRAFTERS[0]


def test_replayed_acceptance_equals_acceptance_through_the_target():
    from eaglespec.api import load_tokenizer
    from eaglespec.bench.compare import build_prompts, measure_drafter

    prompts = build_prompts(load_tokenizer(TARGET), conversations=1, formats=("chatml",), long_limit=1,
                            max_length=4096)  # fmt: skip
    prompts = prompts[:3] + prompts[-2:]  # standard, perturbed, and the long document (2K tokens)
    shapes = ("chain7", "tree7", "tree+ngram")
    real = measure_drafter(TARGET, DRAFTER, prompts, shapes=shapes, max_new_tokens=16)
    records = {}
    replayed = measure_drafter(TARGET, DRAFTER, prompts, shapes=shapes, max_new_tokens=16, records=records)
    assert len(records) == len(prompts)  # recorded once, shared by every shape
    assert replayed == real
    assert sum(row[1] for rows in real.values() for row in rows.values()) > 0  # something was accepted


def test_records_are_kept_on_disk_and_refused_for_another_prompt_or_aux_layers(tmp_path):
    from eaglespec.bench.replay import RecordStore, ReplayTarget, record
    from eaglespec.models.checkpoint import load_target

    target = load_target(TARGET)
    rec = record(target, [1, 2, 3, 4], 4)
    assert rec.ids.shape[0] == 8 and rec.aux.shape[0] == 8
    RecordStore(tmp_path)[("p", 4)] = rec
    again = RecordStore(tmp_path)  # another process
    assert ("p", 4) in again and ("p", 5) not in again
    assert torch.equal(again[("p", 4)].ids, rec.ids) and torch.equal(again[("p", 4)].aux, rec.aux)
    assert not list(tmp_path.glob("*.tmp"))
    replay = ReplayTarget(target)
    replay.play(again[("p", 4)], [1, 2, 3, 4])
    with pytest.raises(ValueError, match="another prompt"):
        replay.play(rec, [1, 2, 3, 5])
    target.set_aux_layers((0, 1, 2))
    with pytest.raises(ValueError, match="record again"):
        replay.play(rec)
