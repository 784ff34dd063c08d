"""`eaglespec data regen` and `data vocab` on a tiny target with a real BPE tokenizer and chat template."""

from __future__ import annotations

import json

import pytest
import torch

from eaglespec.api import generate, load_engine
from eaglespec.cli import main
from eaglespec.toy import make_toy_models
from eaglespec.train.regen import regen
from eaglespec.train.shards import DataError, load_samples, read_shard


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    target, _ = make_toy_models(tmp_path_factory.mktemp("toy"))
    return str(target)


def _write(path, items):
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return path


def _masked_spans(sample):
    ids, mask = sample.input_ids.tolist(), sample.loss_mask.tolist()
    spans, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    return spans + ([cur] if cur else [])


def test_regen_masks_exactly_the_regenerated_replies(toy, tmp_path):
    turns = [("user", "def add(a, b):"), ("assistant", "OLD"), ("user", "and sub?"), ("assistant", "OLD2")]
    conv = {"messages": [{"role": r, "content": c} for r, c in turns]}
    items = [conv, {"prompt": "import os", "chat": False}, {"text": "x = 1\ny = 2\n"}]
    out = tmp_path / "data"
    stats = regen(_write(tmp_path / "in.jsonl", items), out, target=toy, max_new_tokens=8, progress=False)
    assert stats["samples"] == 3
    chat, cont, text = load_samples(out)
    engine = load_engine(toy, None, mode="off")
    tok = engine.tokenizer
    # turn 1 is the target's greedy reply to the first user message; turn 2 is conditioned on it
    p1 = tok.apply_chat_template(conv["messages"][:1], add_generation_prompt=True, tokenize=False)
    r1 = generate(engine, [tok.encode(p1, add_special_tokens=False)], max_new_tokens=8).results[0]
    reply1 = tok.decode(r1.output_ids, skip_special_tokens=True)
    msgs2 = [conv["messages"][0], {"role": "assistant", "content": reply1}, conv["messages"][2]]
    p2 = tok.apply_chat_template(msgs2, add_generation_prompt=True, tokenize=False)
    r2 = generate(engine, [tok.encode(p2, add_special_tokens=False)], max_new_tokens=8).results[0]
    reply2 = tok.decode(r2.output_ids, skip_special_tokens=True)
    spans = [tok.decode(s) for s in _masked_spans(chat)]
    assert spans == [reply1 + "<|end|>\n", reply2 + "<|end|>\n"]
    assert "OLD" not in tok.decode(chat.input_ids)
    # plain continuation: prompt unmasked, the 8 generated tokens masked
    prompt_ids = tok.encode("import os", add_special_tokens=False)
    assert cont.loss_mask.tolist() == [False] * len(prompt_ids) + [True] * 8
    assert text.loss_mask.all() and tok.decode(text.input_ids) == "x = 1\ny = 2\n"


def test_regen_resumes_after_interruption(toy, tmp_path):
    items = [{"prompt": f"print({i})"} for i in range(6)]
    src = _write(tmp_path / "in.jsonl", items)
    out = tmp_path / "data"
    regen(src, out, target=toy, max_new_tokens=6, shard_size=2, progress=False)
    before = {p.name: p.read_bytes() for p in out.glob("shard-*")}
    assert len(before) == 3
    (out / "shard-00001.safetensors").unlink()  # as if killed while writing shard 1
    mtime0 = (out / "shard-00000.safetensors").stat().st_mtime_ns
    stats = regen(src, out, target=toy, max_new_tokens=6, shard_size=2, progress=False)
    assert stats["samples"] == 2  # only the missing shard was generated again
    assert (out / "shard-00000.safetensors").stat().st_mtime_ns == mtime0
    after = {p.name: p.read_bytes() for p in out.glob("shard-*")}
    assert [s.input_ids.tolist() for s in read_shard(out / "shard-00001.safetensors")] == [
        s.input_ids.tolist() for s in _shard_from(before["shard-00001.safetensors"], tmp_path)
    ]
    assert after.keys() == before.keys()
    with pytest.raises(DataError, match="max_new_tokens"):
        regen(src, out, target=toy, max_new_tokens=7, shard_size=2, progress=False)


def test_regen_limit_grows_or_shrinks_by_whole_shards_only(toy, tmp_path):
    """--limit moved by whole shards keeps the shards already written (a long regen can ship a prefix and
    grow later); one that cuts a shard is refused, since that shard's prompts would change."""
    src = _write(tmp_path / "in.jsonl", [{"prompt": f"print({i})"} for i in range(6)])
    out = tmp_path / "data"
    regen(src, out, target=toy, max_new_tokens=4, shard_size=2, limit=2, progress=False)
    first = (out / "shard-00000.safetensors").read_bytes()
    stats = regen(src, out, target=toy, max_new_tokens=4, shard_size=2, limit=6, progress=False)
    assert stats["samples"] == 4 and (out / "shard-00000.safetensors").read_bytes() == first
    assert len(load_samples(out)) == 6 and json.loads((out / "manifest.json").read_text())["complete"]
    assert regen(src, out, target=toy, max_new_tokens=4, shard_size=2, limit=4, progress=False)["samples"] == 0
    assert len(load_samples(out)) == 4  # the manifest now lists the first two shards only
    with pytest.raises(DataError, match="num_inputs"):
        regen(src, out, target=toy, max_new_tokens=4, shard_size=2, limit=5, progress=False)


def test_regen_and_states_split_across_machines(toy, tmp_path):
    """--part I/N: N machines sharing one output directory write the same shards one machine would."""
    import json

    from eaglespec.train.shards import load_samples, parse_part
    from eaglespec.train.states import build_states

    items = [{"prompt": f"print({i})"} for i in range(5)]
    src = _write(tmp_path / "in.jsonl", items)
    regen(src, tmp_path / "one", target=toy, max_new_tokens=4, shard_size=2, progress=False)
    shared = tmp_path / "shared"
    first = regen(src, shared, target=toy, max_new_tokens=4, shard_size=2, progress=False, part=parse_part("0/2"))
    assert first["samples"] == 3 and not json.loads((shared / "manifest.json").read_text())["complete"]
    regen(src, shared, target=toy, max_new_tokens=4, shard_size=2, progress=False, part=parse_part("1/2"))
    assert json.loads((shared / "manifest.json").read_text())["complete"]
    one = [s.input_ids.tolist() for s in load_samples(tmp_path / "one")]
    assert [s.input_ids.tolist() for s in load_samples(shared)] == one
    for part in ("1/2", "0/2"):
        build_states(shared, tmp_path / "states", target=toy, topk=4, progress=False, part=parse_part(part))
    build_states(tmp_path / "one", tmp_path / "states-one", target=toy, topk=4, progress=False)
    for i in range(3):
        name = f"states-{i:05d}.safetensors"
        assert (tmp_path / "states" / name).read_bytes() == (tmp_path / "states-one" / name).read_bytes()
    for bad in ("2/2", "1", "a/b", "0/0"):
        with pytest.raises(ValueError, match="part"):
            parse_part(bad)


def _shard_from(blob, tmp_path):
    p = tmp_path / "copy.safetensors"
    p.write_bytes(blob)
    return read_shard(p)


@pytest.mark.parametrize(
    "item, message",
    [({"nothing": 1}, "needs one of"), ({"messages": [{"role": "assistant", "content": "x"}]}, "no user message"),
     ({"prompt": ""}, "non-empty"), ({"messages": "hi"}, "list of")],
)  # fmt: skip
def test_regen_rejects_bad_input_lines(toy, tmp_path, item, message):
    with pytest.raises(ValueError, match=message):
        regen(_write(tmp_path / "in.jsonl", [{"prompt": "ok"}, item]), tmp_path / "d", target=toy, progress=False)


def test_cli_regen_vocab_and_train(toy, tmp_path, capsys):
    src = _write(tmp_path / "in.jsonl", [{"prompt": f"line {i}"} for i in range(12)])
    assert main(["data", "regen", "--target", toy, "--input", str(src), "--out", str(tmp_path / "d"),
                 "--max-new-tokens", "6"]) == 0  # fmt: skip
    assert main(["data", "vocab", "--target", toy, "--data", str(tmp_path / "d"), "--size", "50",
                 "--out", str(tmp_path / "v")]) == 0  # fmt: skip
    report = json.loads((tmp_path / "v" / "vocab_report.json").read_text())
    printed = capsys.readouterr().out
    assert f"covers {report['coverage']:.2%}" in printed and report["draft_vocab_size"] == 50
    assert main(["train", "--target", toy, "--data", str(tmp_path / "d"), "--vocab", str(tmp_path / "v"),
                 "--out", str(tmp_path / "run"), "--steps", "2", "--batch-size", "4", "--depth", "2",
                 "--eval-every", "1", "--eval-prompts", "2", "--val-fraction", "0.2",
                 "--no-progress"]) == 0  # fmt: skip
    cfg = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 50 and cfg["fc_norm"] and cfg["norm_output"]
    evals = [json.loads(ln) for ln in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any("tau" in e for e in evals)
    # a wrong input path is a clear error, not a traceback
    assert main(["data", "regen", "--target", toy, "--input", str(tmp_path / "nope.jsonl"), "--out",
                 str(tmp_path / "x")]) == 2  # fmt: skip
    assert "does not exist" in capsys.readouterr().err
    assert torch.is_tensor(load_samples(tmp_path / "d")[0].input_ids)


def test_cli_regen_and_train_with_quantize(toy, tmp_path, capsys):
    """`--quantize` on regen and train: the replies are the quantized target's (equal to its own plain
    decoding), the manifest and the drafter card say so, and a resume with another scheme is refused."""
    from eaglespec.api import generate, load_engine

    src = _write(tmp_path / "in.jsonl", [{"prompt": f"line {i}", "chat": False} for i in range(4)])
    out = tmp_path / "d"
    assert main(["data", "regen", "--target", toy, "--input", str(src), "--out", str(out), "--max-new-tokens", "6",
                 "--quantize", "w8a8"]) == 0  # fmt: skip
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quantize"] == "w8a8" and manifest["complete"]
    plain = load_engine(toy, None, mode="off", quantize="w8a8")
    first = load_samples(out)[0]
    prompt = plain.tokenizer.encode("line 0", add_special_tokens=False)
    want = generate(plain, [prompt], max_new_tokens=6).results[0].output_ids
    assert first.input_ids.tolist()[len(prompt) : len(prompt) + len(want)] == want
    assert main(["data", "regen", "--target", toy, "--input", str(src), "--out", str(out), "--max-new-tokens", "6",
                 "--quantize", "int4"]) == 2  # fmt: skip
    assert "quantize" in capsys.readouterr().err
    assert main(["train", "--target", toy, "--data", str(out), "--out", str(tmp_path / "run"), "--steps", "2",
                 "--batch-size", "2", "--depth", "2", "--eval-every", "0", "--val-fraction", "0.25",
                 "--quantize", "w8a8", "--no-progress"]) == 0  # fmt: skip
    card = json.loads((tmp_path / "run" / "final" / "config.json").read_text())["eaglespec_training"]
    assert card["quantize"] == "w8a8"
