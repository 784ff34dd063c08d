"""`eaglespec drift`: the explicit-attention forward is the drafter's own, chains are the engine's
chains, and the per-depth numbers mean what the docs say."""

import json

import pytest
import torch

from eaglespec.cli import main
from eaglespec.drift.chains import ChainRecord, draft_chains
from eaglespec.drift.forward import context_kv, drafter_step
from eaglespec.drift.measure import capture_aux, chain_roots, measure_drafter
from eaglespec.engine import Engine, Request
from eaglespec.kv_cache import causal_mask
from eaglespec.models.checkpoint import save_drafter
from eaglespec.speculation.config import TreeShape
from eaglespec.speculation.proposer import EagleProposer, FixedShape
from helpers import random_drafter, tiny_target

DEPTH = 5


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory.mktemp("drift"))[0]  # GQA: 4 heads over 2 kv heads


@pytest.fixture(params=["eagle3", "eagle3.1"])
def drafter(request, target):
    v31 = request.param == "eagle3.1"
    d = random_drafter(target, fc_norm=v31, norm_output=v31, draft_vocab=48)
    d.attach_target_embedding(target.model.embed_tokens)
    return d


def random_sequence(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 96, (length,), generator=torch.Generator().manual_seed(seed))


@torch.inference_mode()
def test_explicit_attention_forward_equals_the_drafters_forward(target, drafter):
    seq = random_sequence(24)
    aux = capture_aux(target, seq.tolist())
    n = 20  # context pairs (aux t, token t+1), t < n
    ids, hidden, pos = seq[None, 1 : n + 1], drafter.project(aux[None, :n]), torch.arange(n)[None]
    cache = drafter.new_cache(1, 64)
    ref_logits, ref_state = drafter(ids, hidden, pos, cache, cache.prepare(None, causal_mask(torch.tensor([n]), n)))
    cache.commit(None, torch.tensor([n]))
    no_past = torch.zeros(1, drafter.cfg.num_key_value_heads, 0, drafter.cfg.head_size)
    trace = drafter_step(drafter, ids, hidden, pos, no_past, no_past, torch.ones(n, n).tril().bool()[None, None])
    torch.testing.assert_close(trace.logits, ref_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(trace.state, ref_state, atol=1e-5, rtol=0)
    torch.testing.assert_close(trace.probs.sum(-1), torch.ones_like(trace.probs[..., 0]))
    # a chain step after the context: past keys from context_kv, the new token attends to all of it
    past_k, past_v = context_kv(drafter, ids, hidden, pos)
    tok, state, where = seq[None, n + 1 : n + 2], ref_state[:, -1:], torch.tensor([[n]])
    ref_logits, ref_state = drafter(tok, state, where, cache, cache.prepare(None, torch.ones(1, 1, 1).bool()))
    step = drafter_step(drafter, tok, state, where, past_k, past_v, torch.ones(1, 1, 1, n + 1).bool())
    torch.testing.assert_close(step.logits, ref_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(step.state, ref_state, atol=1e-5, rtol=0)


@torch.inference_mode()
def test_chains_are_the_engine_proposers_chains(target, drafter):
    seq = random_sequence(30, seed=1)
    aux = capture_aux(target, seq.tolist())
    roots = [3, 11, 24]
    record = draft_chains(drafter, seq, aux, roots, DEPTH, sink_tokens=4)
    proposer = EagleProposer(drafter)
    for row, r in enumerate(roots):
        cache = drafter.new_cache(1, 64)
        logits, state = proposer.extend(cache, None, seq[None, 1 : r + 1], aux[None, :r], torch.tensor([r]))
        tree = proposer.propose(cache, None, seq[r : r + 1], logits, state, FixedShape(TreeShape.chain(DEPTH)))
        assert record.drafted[row].tolist() == tree.tokens[0, 1:].tolist()
    assert record.expected.tolist() == [seq[r + 1 : r + 1 + DEPTH].tolist() for r in roots]


def test_attention_masses_partition_and_no_own_tokens_at_depth_1(target, drafter):
    seq = random_sequence(30, seed=2)
    record = draft_chains(drafter, seq, capture_aux(target, seq.tolist()), [2, 9, 20], DEPTH, sink_tokens=4)
    total = record.sink + record.context + record.own
    torch.testing.assert_close(total, torch.ones_like(total))
    assert (record.own[:, 0] == 0).all() and (record.own[:, 1:] > 0).all()
    assert (record.sink > 0).all() and (record.context[1:] > 0).all()
    assert (record.context[0, 0] == 0).all()  # root 2: its 2 context pairs are both sinks
    torch.testing.assert_close(record.own_uniform[:, 1], 1 / (torch.tensor([2.0, 9, 20]) + 1))


def test_fed_back_rms_is_the_norm_output_for_eagle31_and_the_layer_output_for_eagle3(target):
    seq = random_sequence(30, seed=3)
    aux = capture_aux(target, seq.tolist())
    v31 = random_drafter(target, fc_norm=True, norm_output=True)
    v31.attach_target_embedding(target.model.embed_tokens)
    record = draft_chains(v31, seq, aux, [4, 12], DEPTH, sink_tokens=4)
    torch.testing.assert_close(record.fed_back_rms, torch.ones_like(record.fed_back_rms), atol=1e-3, rtol=0)
    with torch.no_grad():
        v31.norm.weight.fill_(2.5)  # RMS(norm(x)) = |weight| when the weight is constant
    record = draft_chains(v31, seq, aux, [4, 12], DEPTH, sink_tokens=4)
    torch.testing.assert_close(record.fed_back_rms, torch.full_like(record.fed_back_rms, 2.5), atol=3e-3, rtol=0)
    v3 = random_drafter(target, fc_norm=False, norm_output=False)
    v3.attach_target_embedding(target.model.embed_tokens)
    record = draft_chains(v3, seq, aux, [4, 12], DEPTH, sink_tokens=4)
    assert torch.equal(record.fed_back_rms, record.prenorm_rms)
    assert (record.fed_back_rms[:, -1] > record.fed_back_rms[:, 0]).all()  # pre-norm residual stream grows


def binary_choice_pair(target):
    """Rigged: the target's greedy token is 0 or 7 (sign of one direction) and the drafter drafts only
    0 or 7, so chains are accepted about half the time at each depth, with varied accepted lengths."""
    with torch.no_grad():
        w = torch.randn(target.cfg.hidden_size, generator=torch.Generator().manual_seed(5))
        target.lm_head.weight.zero_()
        target.lm_head.weight[0], target.lm_head.weight[7] = w, -w
    drafter = random_drafter(target, fc_norm=False, norm_output=False, draft_vocab=2)
    drafter.set_draft_vocab(torch.tensor([0, 7]))
    return drafter


def test_acceptance_matches_the_engines_chain_statistics(tmp_path):
    target = tiny_target(tmp_path)[0]
    drafter = binary_choice_pair(target)
    prompt, new = random_sequence(12, seed=4).tolist(), 40
    engine = Engine(target, drafter, mode="chain", chain_k=DEPTH, adaptive=False)
    out = engine.generate([Request(prompt, new + DEPTH)])
    seq = prompt + out.results[0].output_ids
    record = measure_drafter(target, drafter, [seq], [len(prompt)], depth=DEPTH, sink_tokens=4, positions=new)
    accepted = record.accepted_length.tolist()
    acceptance = [(record.accepted_length >= d).float().mean().item() for d in range(1, DEPTH + 1)]
    assert acceptance == sorted(acceptance, reverse=True) and 0 < acceptance[-1] < acceptance[0] < 1
    # the engine drafts at root i, accepts a tokens and drafts next at root i + a + 1
    visited, i = [], 0
    while i + 1 < new:
        visited.append(accepted[i])
        i += accepted[i] + 1
    stats = engine.generate([Request(prompt, new)]).stats
    assert stats.drafts == len(visited)
    expect = [sum(a >= d for a in visited) / len(visited) for d in range(1, DEPTH + 1)]
    assert stats.per_position_acceptance == expect[: len(stats.per_position_acceptance)]
    assert not any(expect[len(stats.per_position_acceptance) :])


def test_chain_roots_stop_where_the_continuation_ends():
    assert chain_roots(prompt_len=5, seq_len=5 + 10, positions=4, depth=3) == [5, 6, 7, 8]
    assert chain_roots(prompt_len=5, seq_len=5 + 6, positions=4, depth=3) == [5, 6, 7]  # EOS after 6 tokens
    with pytest.raises(ValueError, match="roots"):
        draft_chains(None, torch.zeros(10, dtype=torch.long), None, [8], 3, 4)


def test_concat_keeps_every_field():
    rec = ChainRecord(*[torch.ones(2, 3)] * len(ChainRecord.__dataclass_fields__))
    assert ChainRecord.concat([rec, rec]).own.shape == (4, 3)


@pytest.fixture(scope="module")
def pair_on_disk(tmp_path_factory):
    root = tmp_path_factory.mktemp("drift-cli")
    target, _, target_dir = tiny_target(root)
    for name, v31 in (("drafter-eagle3.1", True), ("drafter-eagle3", False)):
        save_drafter(random_drafter(target, fc_norm=v31, norm_output=v31), root / name, dtype="fp32")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": random_sequence(9, s).tolist()}) + "\n" for s in range(2)))
    return root, target_dir, prompts


def test_cli_writes_json_plots_and_verdict(pair_on_disk, tmp_path, capsys):
    root, target_dir, prompts = pair_on_disk
    out = tmp_path / "out"
    rc = main(["drift", "--target", target_dir, "--draft", str(root / "drafter-eagle3.1"), "--draft",
               str(root / "drafter-eagle3"), "--input", str(prompts), "--depth", "3", "--positions", "4",
               "--out", str(out)])  # fmt: skip
    assert rc == 0
    printed = capsys.readouterr().out
    report = json.loads((out / "drift.json").read_text())
    assert [d["eagle_version"] for d in report["drafters"]] == ["EAGLE-3.1", "EAGLE-3"]
    for d in report["drafters"]:
        assert d["chains"] == 8 and d["depth"] == 3
        assert len(d["sink_mass"]) == len(d["fed_back_rms"]) == len(d["acceptance"]) == 3
        assert d["verdict"]["conclusion"] in printed
    assert (out / "verdict.txt").read_text() in printed
    assert "| EAGLE-3 (drafter-eagle3) | 3 |" in (out / "table.md").read_text()
    for name in ("sink_mass", "own_mass", "fed_back_rms", "acceptance", "drift"):
        assert (out / f"{name}.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--draft", "/nonexistent/drafter"], "does not exist"),
        (["--depth", "0"], "--depth must be >= 1"),
        (["--sink-tokens", "0"], "--sink-tokens must be >= 1"),
        (["--positions", "-1"], "--positions must be >= 1"),
        ([], "give --draft DIR"),
    ],
)
def test_cli_bad_input_is_a_clear_error(pair_on_disk, tmp_path, capsys, args, needle):
    root, target_dir, prompts = pair_on_disk
    draft = [] if "--draft" in args or not args else ["--draft", str(root / "drafter-eagle3")]
    rc = main(["drift", "--target", target_dir, "--input", str(prompts), "--out", str(tmp_path), *draft, *args])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("eaglespec: error:") and needle in err and "Traceback" not in err


def test_cli_without_bundled_drafters_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EAGLESPEC_MODELS", str(tmp_path))
    assert main(["drift", "--out", str(tmp_path / "out")]) == 2
    assert "none is bundled for this target" in capsys.readouterr().err


def test_cli_default_prompts_with_a_chat_template(tmp_path, capsys):
    from eaglespec.toy import make_toy_models

    target_dir, draft_dir = make_toy_models(tmp_path / "toy")
    out = tmp_path / "out"
    rc = main(["drift", "--target", str(target_dir), "--draft", str(draft_dir), "--depth", "2", "--positions", "2",
               "--out", str(out)])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    report = json.loads((out / "drift.json").read_text())
    assert report["settings"]["prompts"] == 7 and report["drafters"][0]["chains"] > 0


def test_cli_default_prompts_need_a_tokenizer(pair_on_disk, tmp_path, capsys):
    root, target_dir, _ = pair_on_disk
    rc = main(["drift", "--target", target_dir, "--draft", str(root / "drafter-eagle3"), "--out", str(tmp_path)])
    assert rc == 2 and "no tokenizer" in capsys.readouterr().err


def test_drafter_labels_name_the_training_run(tmp_path):
    from eaglespec.drift.command import drafter_name

    assert drafter_name(tmp_path / "models" / "drafter-eagle3") == "drafter-eagle3"
    assert drafter_name(tmp_path / "run-a" / "final") == "run-a/final"
    assert drafter_name(tmp_path / "run-b" / "checkpoints" / "step-000200") == "run-b/step-000200"
