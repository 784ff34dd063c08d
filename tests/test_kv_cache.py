import time

import pytest
import torch

from eaglespec.engine import Engine, Request
from eaglespec.kv_cache import ContextLengthError, KVCache, causal_mask
from eaglespec.models.checkpoint import load_target
from eaglespec.speculation.config import TreeShape
from eaglespec.speculation.tree import DraftTree, ancestor_mask
from eaglespec.speculation.verify import accept_greedy
from helpers import hf_tiny, random_drafter, save_hf

TOL = 1e-4


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = hf_tiny("qwen2", layers=3)
    return load_target(save_hf(hf, tmp_path_factory.mktemp("k") / "m")), hf


def _hf_last(hf, seq):
    with torch.no_grad():
        return hf(torch.tensor([seq])).logits[0, -1]


def _prefill(model, cache, slots, prompts):
    b, n = len(prompts), max(map(len, prompts))
    ids = torch.zeros(b, n, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    meta = cache.prepare(slots, causal_mask(lens, n))
    h, _ = model(ids, meta.write_pos, cache, meta, capture_aux=False)
    cache.commit(slots, lens)
    return model.logits(h)


# tree: root(0) -> 1 -> 3 -> 5 ; root -> 2 -> 4 ; 1 -> 6
PARENT = [-1, 0, 0, 1, 2, 3, 1]


def _tree(b, g):
    parent = torch.tensor([PARENT]).expand(b, -1)
    depth = torch.tensor([[0, 1, 1, 2, 2, 3, 2]]).expand(b, -1)
    tokens = torch.randint(0, 96, (b, len(PARENT)), generator=g)
    return DraftTree(tokens, parent, depth, ancestor_mask(parent, 3))


def _path(node):
    out = []
    while node >= 0:
        out.append(node)
        node = PARENT[node]
    return out[::-1]


@pytest.mark.parametrize("slots", [None, torch.tensor([2, 0])])
def test_tree_logits_and_compaction_match_hf(pair, slots):
    model, hf = pair
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 4)]
    cache = model.new_cache(3, initial_capacity=16)
    _prefill(model, cache, slots, prompts)
    tree = _tree(2, g)
    lengths = cache.lengths[:2] if slots is None else cache.lengths[slots]
    positions = lengths[:, None] + tree.depth
    meta = cache.prepare(slots, tree.mask, positions)
    h, _ = model(tree.tokens, positions, cache, meta, capture_aux=False)
    logits = model.logits(h)
    for b in range(2):
        for node in range(len(PARENT)):
            seq = prompts[b] + tree.tokens[b, _path(node)].tolist()
            assert (logits[b, node] - _hf_last(hf, seq)).abs().max() <= TOL, (b, node)
    # keep path root->1->3->5 for row 0 (3 accepted), root->2 for row 1 (1 accepted)
    keep = torch.tensor([[0, 1, 3, 5], [0, 2, 2, 2]])
    counts = torch.tensor([4, 2])
    cache.compact(slots, keep, counts)
    seqs = [prompts[b] + tree.tokens[b, keep[b, : counts[b]]].tolist() for b in range(2)]
    assert (cache.lengths[:2] if slots is None else cache.lengths[slots]).tolist() == [len(s) for s in seqs]
    for _ in range(3):
        nxt = torch.randint(0, 96, (2, 1), generator=g)
        lengths = cache.lengths[:2] if slots is None else cache.lengths[slots]
        meta = cache.prepare(slots, torch.ones(2, 1, 1, dtype=torch.bool))
        h, _ = model(nxt, meta.write_pos, cache, meta, capture_aux=False)
        cache.commit(slots, torch.ones(2, dtype=torch.long))
        for b in range(2):
            seqs[b].append(int(nxt[b]))
            assert (model.logits(h)[b, 0] - _hf_last(hf, seqs[b])).abs().max() <= TOL


def test_accept_greedy_on_tree_with_true_path(pair):
    model, hf = pair
    prompt = [5, 6, 7, 8]
    greedy = []
    seq = list(prompt)
    for _ in range(4):
        greedy.append(int(_hf_last(hf, seq).argmax()))
        seq.append(greedy[-1])
    cache = model.new_cache(1)
    _prefill(model, cache, None, [prompt])
    # root = greedy[0]; nodes 1,3,5 carry the true continuation, others are wrong
    tokens = torch.tensor([[greedy[0], greedy[1], (greedy[1] + 1) % 96, greedy[2], 0, greedy[3],
                            (greedy[2] + 1) % 96]])  # fmt: skip
    tree = DraftTree(tokens, torch.tensor([PARENT]), torch.tensor([[0, 1, 1, 2, 2, 3, 2]]),
                     ancestor_mask(torch.tensor([PARENT]), 3))  # fmt: skip
    positions = cache.lengths[:1, None] + tree.depth
    h, _ = model(tree.tokens, positions, cache, cache.prepare(None, tree.mask, positions), capture_aux=False)
    acc = accept_greedy(tree, model.logits(h), 3)
    assert acc.accepted.tolist() == [3] and acc.path[0].tolist() == [0, 1, 3, 5]
    expect = int(_hf_last(hf, prompt + greedy[:4]).argmax())
    assert acc.next_token.tolist() == [expect]


def test_slots_are_independent(pair):
    model, hf = pair
    cache = model.new_cache(2, initial_capacity=8)
    a, b = cache.allocate(), cache.allocate()
    assert (a, b) == (0, 1)
    _prefill(model, cache, torch.tensor([a]), [[1, 2, 3, 4, 5]])
    _prefill(model, cache, torch.tensor([b]), [[9, 8, 7]])
    snap = [k[a].clone() for k in cache.k + cache.v]
    cache.free(b)
    c = cache.allocate()
    assert c == b and cache.lengths[c] == 0
    _prefill(model, cache, torch.tensor([c]), [list(range(30))])  # grows capacity past 8
    d = cache.allocate()  # no free slot: adds slots
    assert d == 2 and cache.num_slots >= 3
    _prefill(model, cache, torch.tensor([d]), [[4, 4, 4]])
    for old, new in zip(snap, cache.k + cache.v):
        assert torch.equal(old[:, :5], new[a, :, :5])
    assert cache.lengths[a] == 5 and cache.lengths[c] == 30 and cache.capacity >= 30
    # decode from slot a after everything else happened: still equals HF
    meta = cache.prepare(torch.tensor([a]), torch.ones(1, 1, 1, dtype=torch.bool))
    h, _ = model(torch.tensor([[11]]), meta.write_pos, cache, meta, capture_aux=False)
    assert (model.logits(h)[0, 0] - _hf_last(hf, [1, 2, 3, 4, 5, 11])).abs().max() <= TOL
    cache.add_slots(2)
    for old, new in zip(snap, cache.k + cache.v):
        assert torch.equal(old[:, :5], new[a, :, :5])


def test_growth_and_context_limit(pair):
    model, hf = pair
    cache = model.new_cache(1, initial_capacity=4, max_length=300)
    seq = list(range(90))
    logits = _prefill(model, cache, None, [seq])
    assert cache.capacity >= 90
    assert (logits[0, -1] - _hf_last(hf, seq)).abs().max() <= TOL
    with pytest.raises(ContextLengthError, match="300"):
        cache.reserve(301)
    c = KVCache(1, 1, 1, 4, max_length=10, initial_capacity=4)
    with pytest.raises(ContextLengthError):
        c.prepare(None, causal_mask(torch.tensor([11]), 11))
    # engine: generation stops at the context end with finish_reason "length"
    eng = Engine(model, max_length=40)
    r = eng.generate([Request(list(range(30)), 50)]).results[0]
    assert r.finish_reason == "length" and len(r.output_ids) == 10


def _long(tmp_path, n, max_new=4):
    hf = hf_tiny("llama", vocab=64, hidden=32, layers=2, heads=2, kv_heads=1, max_pos=n + 232)
    target = load_target(save_hf(hf, tmp_path / "m"))
    prompt = torch.randint(0, 64, (n,), generator=torch.Generator().manual_seed(0)).tolist()
    t0 = time.perf_counter()
    plain = Engine(target).generate([Request(prompt, max_new)]).results[0].output_ids
    eng = Engine(target, random_drafter(target), mode="tree", tree=TreeShape(3, 2, 5), adaptive=False)
    out = eng.generate([Request(prompt, max_new)])
    assert out.results[0].output_ids == plain and len(plain) == max_new
    assert out.stats.drafts > 0
    return hf, prompt, plain, time.perf_counter() - t0


def test_4k_prompt(tmp_path):
    hf, prompt, plain, _ = _long(tmp_path, 4096)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False)[0, 4096:].tolist()
    assert plain == ref


@pytest.mark.slow
def test_32k_prompt(tmp_path):
    _long(tmp_path, 32768)


def test_batch_64_tree_equals_plain(tmp_path):
    hf = hf_tiny("mistral", vocab=64, hidden=32, layers=2, heads=2, kv_heads=1)
    target = load_target(save_hf(hf, tmp_path / "m"))
    g = torch.Generator().manual_seed(3)
    reqs = [Request(torch.randint(0, 64, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist(),
                    6) for _ in range(64)]  # fmt: skip
    plain = [Engine(target).generate([r]).results[0].output_ids for r in reqs]
    eng = Engine(target, random_drafter(target, draft_vocab=40), mode="tree", tree=TreeShape(3, 3, 8),
                 adaptive=False)  # fmt: skip
    out = eng.generate(reqs, batch_size=64)
    assert [r.output_ids for r in out.results] == plain
    assert eng.generate(reqs, batch_size=64).results[5].output_ids == plain[5]
