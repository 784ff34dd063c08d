"""Drafter training: vocabulary, TTT mask and loss, end-to-end learning, resume, DDP, offline states."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys

import pytest
import torch

from eaglespec.kv_cache import causal_mask
from eaglespec.models.checkpoint import load_drafter
from eaglespec.train.config import TrainConfig
from eaglespec.train.shards import DataError, Sample, load_samples, read_shard, write_shard
from eaglespec.train.trainer import Trainer
from eaglespec.train.ttt import (
    Batch,
    Targets,
    collate,
    target_features,
    targets_from_logits,
    targets_from_topk,
    ttt_forward,
    ttt_loss,
)
from eaglespec.train.vocab import choose_draft_vocab, coverage_report, mapping, token_counts
from helpers import random_drafter
from train_helpers import generated_samples, learnable_target, read_metrics, write_data


# -- vocabulary ---------------------------------------------------------------------------------------
def test_draft_vocab_from_known_histogram():
    # assistant tokens: 7 x5, 2 x4, 9 x4, 4 x1; token 3 appears only outside the loss mask
    ids = torch.tensor([3, 3, 3] + [7] * 5 + [2] * 4 + [9] * 4 + [4])
    mask = torch.tensor([False] * 3 + [True] * 14)
    counts = token_counts([Sample(ids, mask)], 12)
    assert counts[3] == 0 and counts[7] == 5
    used = choose_draft_vocab(counts, 3)
    assert used.tolist() == [2, 7, 9]  # top 3 by count, sorted ascending; 2 and 9 tie and both fit
    used2 = choose_draft_vocab(counts, 2)
    assert used2.tolist() == [2, 7]  # tie between 2 and 9 goes to the smaller id
    d2t, t2d = mapping(used, 12)
    assert d2t.tolist() == [2, 6, 7]  # offsets: draft i -> target i + d2t[i]
    assert (torch.arange(3) + d2t).tolist() == [2, 7, 9]
    assert t2d.nonzero().flatten().tolist() == [2, 7, 9]
    rep = coverage_report(counts, used)
    assert rep["coverage"] == pytest.approx(13 / 14) and rep["tokens_outside"] == 1 and rep["distinct_outside"] == 1
    # fewer distinct tokens than Vd: padded with the smallest unseen ids
    assert choose_draft_vocab(counts, 6).tolist() == [0, 1, 2, 4, 7, 9]


# -- loss and mask ------------------------------------------------------------------------------------
def test_loss_matches_hand_computation():
    # one sample, T=4, Vd=2, depth 2; logits chosen by hand
    lg0 = torch.tensor([[[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [0.0, 0.0]]])
    lg1 = torch.tensor([[[2.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]]])
    probs = torch.tensor([[[0.5, 0.5], [0.9, 0.1], [0.2, 0.8], [0.3, 0.7]]])
    in_vocab = torch.tensor([[True, True, True, False]])
    batch = Batch(torch.zeros(1, 4, dtype=torch.long), torch.tensor([[True, True, True, True]]), torch.tensor([4]))
    loss, stats = ttt_loss([lg0, lg1], batch, Targets(probs, in_vocab), decay=0.8)

    def ce(p, logits):
        lq = torch.log_softmax(logits, -1)
        return -float((p * lq).sum())

    # step 0: row t uses p[t+1], mask loss_mask[t+2] & in_vocab[t+1] -> rows 0, 1 (row 1: in_vocab[2])
    step0 = (ce(probs[0, 1], lg0[0, 0]) + ce(probs[0, 2], lg0[0, 1])) / 4
    # step 1: row t uses p[t+2], mask loss_mask[t+3] & in_vocab[t+2] -> row 0 only
    step1 = ce(probs[0, 2], lg1[0, 0]) / 4
    assert float(loss[0]) == pytest.approx(step0 + 0.8 * step1, rel=1e-6)
    assert [s["count"] for s in stats] == [2, 1]
    # accuracy: row0 step0 argmax 0 vs p[1] argmax 0 -> right; row1 argmax 0 vs p[2] argmax 1 -> wrong
    assert [s["correct"] for s in stats] == [1, 0]


def test_targets_from_topk_with_full_k_equal_online_targets():
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 16)
    used = torch.tensor([1, 3, 4, 8, 15])
    t2d = torch.zeros(16, dtype=torch.bool)
    t2d[used] = True
    t2d_map = torch.full((16,), -1)
    t2d_map[used] = torch.arange(5)
    online = targets_from_logits(logits, used, t2d)
    top = logits.softmax(-1).topk(16, dim=-1)
    offline = targets_from_topk(top.values, top.indices, t2d_map)
    torch.testing.assert_close(offline.probs, online.probs)
    assert torch.equal(offline.in_vocab, online.in_vocab)


@pytest.mark.parametrize("window", [None, 4], ids=["full", "window4"])
@pytest.mark.parametrize("flags", [(False, False), (True, True)], ids=["eagle3", "eagle3.1"])
def test_ttt_steps_equal_cached_inference_chains(tmp_path, flags, window):
    """TTT mask definition: step k at row i must equal inference where the context pairs 0..i sit in the
    drafter's KV cache and the chain's k extra tokens (teacher-forced) follow at positions i+1..i+k.
    With an attention window, training masks exactly what the inference cache leaves out."""
    target, _ = learnable_target(tmp_path / "t", attn_scale=1.0)
    drafter = random_drafter(target, fc_norm=flags[0], norm_output=flags[1], draft_vocab=48)
    drafter.cfg.draft_attention_window = window
    drafter.attach_target_embedding(target.model.embed_tokens)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (1, 9), generator=g)
    batch = collate([Sample(ids[0], torch.ones(9, dtype=torch.bool))])
    aux, _ = target_features(target, batch)
    depth = 3
    with torch.no_grad():
        ttt = ttt_forward(drafter, aux, ids, depth)
        for i in range(0, 9 - depth - 1):
            cache = drafter.new_cache(1, 64)
            cache.allocate()
            n = i + 1  # pairs (aux_t, x_{t+1}) for t = 0..i
            meta = cache.prepare(None, causal_mask(torch.tensor([n]), n))
            logits, state = drafter(ids[:, 1 : n + 1], drafter.project(aux[:, :n]), meta.write_pos, cache, meta)
            cache.commit(None, torch.tensor([n]))
            torch.testing.assert_close(logits[:, i], ttt[0][:, i], atol=1e-5, rtol=1e-4)
            hidden = state[:, i : i + 1]
            for k in range(1, depth):
                meta = cache.prepare(None, torch.ones(1, 1, 1, dtype=torch.bool))
                pos = torch.tensor([[i + k]])
                logits, hidden = drafter(ids[:, i + 1 + k : i + 2 + k], hidden, pos, cache, meta)
                cache.commit(None, torch.tensor([1]))
                torch.testing.assert_close(logits[:, 0], ttt[k][:, i], atol=1e-5, rtol=1e-4)


# -- end to end ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def learn(tmp_path_factory):
    root = tmp_path_factory.mktemp("learn")
    target, tdir = learnable_target(root / "target")
    data = write_data(root / "data", generated_samples(target, 160), tdir)
    return target, tdir, data, root


def _cfg(learn, out, **kw):
    _, tdir, data, _ = learn
    base = dict(target=tdir, data=data, out=str(out), depth=4, lr=3e-3, warmup_steps=5, batch_size=8, micro_batch=4,
                eval_every=0, eval_prompts=12, eval_max_new_tokens=24, eval_chain_k=4, val_fraction=0.1,
                save_every=1000, log_every=1, draft_vocab_size=64)  # fmt: skip
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("flags", [(True, True), (False, False)], ids=["eagle3.1", "eagle3"])
def test_training_learns_a_drafter_with_real_tau(learn, tmp_path, flags):
    trainer = Trainer(_cfg(learn, tmp_path / "run", steps=60, fc_norm=flags[0], norm_output=flags[1]), progress=False)
    untrained = trainer.measure_tau()["tau"]
    res = trainer.train()
    assert res["finished"]
    trained = trainer.evaluate()
    train_losses = [r["loss"] for r in read_metrics(tmp_path / "run") if r["kind"] == "train"]
    # soft cross-entropy cannot fall below the target entropy, so compare against the start, not zero
    assert sum(train_losses[-5:]) / 5 < 0.7 * sum(train_losses[:5]) / 5
    assert untrained < 1.2 and trained["tau"] >= 1.5, (untrained, trained["tau"])
    acc = trained["val_step_accuracy"]
    assert acc[0] > 0.5
    # the saved drafter loads in the engine's portable format with the right EAGLE version
    d = load_drafter(res["drafter"], target=learn[0])
    assert (d.cfg.fc_norm, d.cfg.norm_output) == flags
    assert {p.name for p in (tmp_path / "run" / "plots").iterdir()} == {"loss.png", "step_accuracy.png", "tau.png"}


def test_resume_reproduces_the_uninterrupted_loss_curve(learn, tmp_path):
    full = Trainer(_cfg(learn, tmp_path / "full", steps=8), progress=False)
    full.train()
    first = Trainer(_cfg(learn, tmp_path / "split", steps=8, stop_after=3, save_every=2), progress=False)
    assert not first.train()["finished"]
    ckpts = sorted(p.name for p in (tmp_path / "split" / "checkpoints").iterdir())
    assert ckpts == ["step-000002", "step-000003"]
    second = Trainer(_cfg(learn, tmp_path / "split", steps=8, resume=True), progress=False)
    assert second.step == 3
    assert second.train()["finished"]
    a = [r["loss"] for r in read_metrics(tmp_path / "full") if r["kind"] == "train"]
    b = [r["loss"] for r in read_metrics(tmp_path / "split") if r["kind"] == "train"]
    assert len(a) == len(b) == 8
    assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    # resuming with a changed schedule is refused with a clear message
    with pytest.raises(ValueError, match="lr"):
        Trainer(_cfg(learn, tmp_path / "split", steps=8, resume=True, lr=1e-2), progress=False)
    with pytest.raises(ValueError, match="--resume"):
        Trainer(_cfg(learn, tmp_path / "split", steps=8), progress=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_two_processes_equal_one_process(learn, tmp_path):
    _, tdir, data, _ = learn
    common = ["--target", tdir, "--data", data, "--depth", "3", "--steps", "4", "--batch-size", "8",
              "--micro-batch", "2", "--lr", "3e-3", "--warmup-steps", "2", "--eval-every", "0", "--log-every", "1",
              "--draft-vocab-size", "64", "--val-fraction", "0.1", "--save-dtype", "fp32", "--no-progress"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "eaglespec.cli", "train", "--out", str(tmp_path / "one"), *common],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(_free_port()),
                          "-m", "eaglespec.cli", "train", "--out", str(tmp_path / "two"), *common],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert two.returncode == 0, two.stderr[-3000:]
    la = [r["loss"] for r in read_metrics(tmp_path / "one") if r["kind"] == "train"]
    lb = [r["loss"] for r in read_metrics(tmp_path / "two") if r["kind"] == "train"]
    assert len(la) == len(lb) == 4
    assert la == pytest.approx(lb, rel=1e-4)
    wa = load_drafter(tmp_path / "one" / "final").state_dict()
    wb = load_drafter(tmp_path / "two" / "final").state_dict()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-5, rtol=1e-4)


@pytest.mark.slow
def test_ddp_two_nodes_rendezvous_equal_one_process(learn, tmp_path):
    """The multi-machine launch of docs/scale-out.md (torchrun --nnodes 2 with a c10d rendezvous), with two
    "nodes" on this machine: same losses as one process."""
    _, tdir, data, _ = learn
    common = ["--target", tdir, "--data", data, "--depth", "3", "--steps", "3", "--batch-size", "8",
              "--micro-batch", "2", "--lr", "3e-3", "--warmup-steps", "2", "--eval-every", "0", "--log-every", "1",
              "--draft-vocab-size", "64", "--val-fraction", "0.1", "--save-dtype", "fp32", "--no-progress"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    one = subprocess.run([sys.executable, "-m", "eaglespec.cli", "train", "--out", str(tmp_path / "one"), *common],
                         capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert one.returncode == 0, one.stderr
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "scaleout",
                               "-m", "eaglespec.cli", "train", "--out", str(tmp_path / "two"), *common],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for _ in range(2)]  # fmt: skip
    outs = [n.communicate(timeout=300)[0] for n in nodes]
    assert all(n.returncode == 0 for n in nodes), "\n".join(o[-2000:] for o in outs)
    la = [r["loss"] for r in read_metrics(tmp_path / "one") if r["kind"] == "train"]
    lb = [r["loss"] for r in read_metrics(tmp_path / "two") if r["kind"] == "train"]
    assert len(la) == len(lb) == 3 and la == pytest.approx(lb, rel=1e-4)


def test_offline_states_train_like_online(learn, tmp_path):
    from eaglespec.train.states import build_states, estimate_bytes

    target, tdir, data, _ = learn
    res = build_states(data, tmp_path / "states", target=tdir, topk=64, progress=False)
    n_tok = sum(len(s.input_ids) for s in load_samples(data))
    assert res["bytes"] == estimate_bytes(n_tok, 64 * 3, 64)
    on = Trainer(_cfg(learn, tmp_path / "on", steps=3), progress=False)
    off = Trainer(_cfg(learn, tmp_path / "off", steps=3, states=str(tmp_path / "states")), progress=False)
    on.train()
    off.train()
    a = [r["loss"] for r in read_metrics(tmp_path / "on") if r["kind"] == "train"]
    b = [r["loss"] for r in read_metrics(tmp_path / "off") if r["kind"] == "train"]
    # top-k = V keeps the whole distribution; aux states are stored in bf16, so close but not bit-equal
    assert a == pytest.approx(b, rel=2e-2)


def test_state_cache_checks_disk_space_first(learn, tmp_path, monkeypatch):
    import shutil

    from eaglespec.train import states

    _, tdir, data, _ = learn
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000))
    with pytest.raises(DataError, match="GiB free"):
        states.build_states(data, tmp_path / "states", target=tdir, progress=False)
    assert not list((tmp_path / "states").glob("states-*"))


# -- bad input ----------------------------------------------------------------------------------------
def test_truncated_shard_and_missing_files_give_clear_errors(learn, tmp_path):
    target, tdir, _, _ = learn
    samples = generated_samples(target, 4, new_tokens=4)
    root = tmp_path / "d"
    write_data(root, samples, tdir, shard_size=2)
    assert len(read_shard(root / "shard-00000.safetensors")) == 2
    blob = (root / "shard-00001.safetensors").read_bytes()
    (root / "shard-00001.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(DataError, match="not a readable shard"):
        load_samples(root)
    (root / "shard-00001.safetensors").unlink()
    with pytest.raises(DataError, match="shard-00001.safetensors is missing"):
        load_samples(root)
    with pytest.raises(DataError, match="does not exist"):
        load_samples(tmp_path / "nowhere")


def test_data_for_another_target_is_refused(learn, tmp_path):
    target, tdir, data, _ = learn
    other, odir = learnable_target(tmp_path / "other", vocab=80)
    with pytest.raises(DataError, match="another target"):
        Trainer(_cfg(learn, tmp_path / "run", steps=2, target=odir), progress=False)


def test_samples_with_tokens_outside_the_draft_vocab_are_masked_not_broken(learn, tmp_path):
    # a tiny draft vocabulary: most target tokens are outside it; training and generation still work
    trainer = Trainer(_cfg(learn, tmp_path / "run", steps=2, draft_vocab_size=8), progress=False)
    assert trainer.vocab_report["coverage"] < 1.0
    trainer.train()
    assert trainer.measure_tau()["tau"] >= 1.0
    rec = trainer.evaluate()
    assert all(0.0 <= a <= 1.0 for a in rec["val_step_accuracy"]) and math.isfinite(rec["val_loss"])


def test_write_shard_is_atomic_and_round_trips(tmp_path):
    s = [Sample(torch.tensor([1, 2, 3]), torch.tensor([False, True, True])),
         Sample(torch.tensor([4]), torch.tensor([True]))]  # fmt: skip
    write_shard(tmp_path, 0, s)
    assert not list(tmp_path.glob("*.tmp"))
    back = read_shard(tmp_path / "shard-00000.safetensors")
    assert [b.input_ids.tolist() for b in back] == [[1, 2, 3], [4]]
    assert [b.loss_mask.tolist() for b in back] == [[False, True, True], [True]]


def test_drafter_fine_tunes_against_a_saved_quantized_target(learn, tmp_path):
    """The recipe for a quantized target (README): `eaglespec quantize`, regenerate the replies with the
    quantized target, train with `--target` the quantized directory. The drafter learns its outputs."""
    from eaglespec.models.checkpoint import load_target
    from eaglespec.models.quantize import quantize_target, save_quantized
    from eaglespec.models.quantized_linear import QuantizedLinear

    target, tdir, _, _ = learn
    qdir = save_quantized(quantize_target(load_target(tdir), 4, 32), tdir, tmp_path / "q4")
    qtarget = load_target(qdir)
    assert isinstance(qtarget.model.layers[0].mlp.up_proj, QuantizedLinear)
    data = write_data(tmp_path / "data", generated_samples(qtarget, 160), qdir)
    trainer = Trainer(_cfg(learn, tmp_path / "run", target=str(qdir), data=data, steps=60), progress=False)
    assert isinstance(trainer.target.model.layers[0].mlp.up_proj, QuantizedLinear)
    trainer.train()
    assert trainer.evaluate()["tau"] >= 1.5


def test_train_quantize_flag_trains_against_the_quantized_target(learn, tmp_path):
    """`eaglespec train --quantize w8a8` (no saved copy needed): the target is quantized at load, the
    features the drafter learns from are the quantized target's, and the flag is fixed on --resume."""
    from eaglespec.models.checkpoint import load_target
    from eaglespec.models.quantize import apply_quantize
    from eaglespec.models.quantized_linear import QuantizedLinear

    target, tdir, _, _ = learn
    qtarget = apply_quantize(load_target(tdir), "w8a8")
    data = write_data(tmp_path / "data", generated_samples(qtarget, 160), tdir)
    cfg = _cfg(learn, tmp_path / "run", data=data, steps=60, quantize="w8a8", save_every=30)
    trainer = Trainer(cfg, progress=False)
    layer = trainer.target.model.layers[0].mlp.up_proj
    assert isinstance(layer, QuantizedLinear) and layer.activations == "int8"
    trainer.train()
    assert trainer.evaluate()["tau"] >= 1.5
    card = json.loads((tmp_path / "run" / "final" / "config.json").read_text())["eaglespec_training"]
    assert card["quantize"] == "w8a8"
    with pytest.raises(ValueError, match="quantize"):
        Trainer(_cfg(learn, tmp_path / "run", data=data, steps=60, resume=True), progress=False).train()


def test_long_context_options_window_crop_and_warm_start(learn, tmp_path):
    """--draft-window is saved and honoured, --draft-context trains on each sample's tail with the whole
    sample's features, and --init-from continues from a trained drafter (its loss, not a fresh one's)."""
    first = Trainer(_cfg(learn, tmp_path / "a", steps=40, draft_window=8, draft_context=16), progress=False)
    assert first.drafter.cfg.draft_attention_window == 8
    res = first.train()
    d = load_drafter(res["drafter"], target=learn[0])
    assert d.cfg.draft_attention_window == 8
    losses = [r["loss"] for r in read_metrics(tmp_path / "a") if r["kind"] == "train"]
    assert sum(losses[-5:]) < 0.8 * sum(losses[:5])
    batch, aux, _ = first._features(first.train_idx[:4])
    assert batch.input_ids.shape[1] == 16 and int(batch.lengths.max()) == 16 and aux.shape[1] == 16
    warm = Trainer(_cfg(learn, tmp_path / "b", steps=2, init_from=res["drafter"], draft_window=8,
                        draft_context=16), progress=False)  # fmt: skip
    fresh = Trainer(_cfg(learn, tmp_path / "c", steps=2, draft_window=8, draft_context=16), progress=False)
    assert torch.equal(warm.drafter.draft_to_target, d.draft_to_target)
    warm.train(), fresh.train()
    warm_loss = [r["loss"] for r in read_metrics(tmp_path / "b") if r["kind"] == "train"][0]
    fresh_loss = [r["loss"] for r in read_metrics(tmp_path / "c") if r["kind"] == "train"][0]
    assert warm_loss < 0.8 * fresh_loss
    with pytest.raises(ValueError, match="must exceed the TTT depth"):
        Trainer(_cfg(learn, tmp_path / "d", steps=2, draft_window=3), progress=False)
    with pytest.raises(ValueError, match="fc_norm=True"):
        Trainer(_cfg(learn, tmp_path / "e", steps=2, init_from=res["drafter"], fc_norm=False, norm_output=False),
                progress=False)  # fmt: skip


def test_config_refuses_bad_values_when_made(tmp_path):
    """Values that used to fail only when used (a save dtype at the run's end) fail at construction."""
    from eaglespec.train.config import TrainConfig

    base = {"target": str(tmp_path), "data": str(tmp_path), "out": str(tmp_path / "run")}
    for bad, needle in [({"save_dtype": "fp8"}, "save-dtype"), ({"eval_mode": "beam"}, "eval-mode"),
                        ({"micro_batch": 0}, "micro-batch"), ({"eval_every": -1}, "eval-every"),
                        ({"steps": 0}, "steps")]:  # fmt: skip
        with pytest.raises(ValueError, match=needle):
            TrainConfig(**base, **bad)
    assert TrainConfig(**base, eval_every=0, save_every=0).eval_every == 0  # 0: never
