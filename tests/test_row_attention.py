"""Row-invariant attention (models/row_attention.py): a PyTorch fp32 target's verification rows have the bits of
one-token steps, for every family, for chain and tree rows, short and long (> 4K) contexts, and for rows of
different lengths batched together; and the kernel computes attention (SDPA's values within fp32 rounding).
Skipped with the reason where the kernel cannot be compiled here."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from eaglespec.kv_cache import causal_mask
from eaglespec.models import row_attention
from eaglespec.models.fast_linear import prepare_for_inference
from eaglespec.models.precision import row_gap
from helpers import FAMILIES, tiny_target

pytestmark = pytest.mark.skipif(not row_attention.available(), reason=str(row_attention.unavailable_reason()))


def _target(tmp_path, family, **kw):
    target, _, _ = tiny_target(tmp_path, family, **kw)
    return prepare_for_inference(target)


def _prefill(target, ids):
    n = ids.shape[1]
    cache = target.new_cache(ids.shape[0], max_length=n + 40, initial_capacity=n + 40)
    meta = cache.prepare(None, causal_mask(torch.full((ids.shape[0],), n), n))
    target(ids, meta.write_pos, cache, meta, capture_aux=False)
    cache.commit(None, torch.full((ids.shape[0],), n))
    return cache


def _step(target, cache, ids, mask, rows=None, positions=None):
    meta = cache.prepare(rows, mask)
    h, _ = target(ids, meta.write_pos if positions is None else positions, cache, meta, capture_aux=False)
    return target.logits(h)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chain_rows_have_the_bits_of_one_token_steps(tmp_path, family):
    target = _target(tmp_path, family)
    assert target.new_cache(1, max_length=8).row_invariant
    assert row_gap(target) == 0.0
    assert row_gap(target, prompt_len=300, rows=9, seed=2) == 0.0


def test_long_context_rows_have_the_bits_of_one_token_steps(tmp_path):
    target = _target(tmp_path, "llama", max_pos=8192)
    assert row_gap(target, prompt_len=4300, rows=17, seed=5) == 0.0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tree_rows_have_the_bits_of_their_branchs_one_token_steps(tmp_path, family):
    """A 17-node tree (siblings interleaved, as the proposer lays trees out) against each branch decoded alone."""
    target = _target(tmp_path, family)
    g = torch.Generator().manual_seed(0)
    vocab = target.cfg.vocab_size
    prompt = torch.randint(0, vocab, (1, 50), generator=g)
    parents = [-1, 0, 0, 0, 1, 1, 2, 3, 4, 4, 5, 6, 7, 8, 9, 10, 11]  # breadth first: ancestors come first
    n = len(parents)
    tokens = torch.randint(0, vocab, (1, n), generator=g)
    mask, depth = torch.zeros(1, n, n, dtype=torch.bool), [0] * n
    for i, p in enumerate(parents):
        mask[0, i, i] = True
        depth[i] = depth[p] + 1 if p >= 0 else 0
        while p >= 0:
            mask[0, i, p], p = True, parents[p]
    positions = 50 + torch.tensor([depth])  # a node sits at its depth after the prompt
    tree = _step(target, _prefill(target, prompt), tokens, mask, positions=positions)[0]
    for leaf in (12, 14, 16):
        branch, p = [], leaf
        while p >= 0:
            branch.insert(0, p)
            p = parents[p]
        cache = _prefill(target, prompt)
        for node in branch:
            one = _step(target, cache, tokens[:, node : node + 1], torch.ones(1, 1, 1, dtype=torch.bool))[0, 0]
            cache.commit(None, torch.tensor([1]))
            assert torch.equal(one, tree[node]), (leaf, node, float((one - tree[node]).abs().max()))


def test_batched_rows_of_different_lengths_have_their_own_bits(tmp_path):
    """Two slots 30 and 70 tokens long verify 5 chain rows together; each equals its slot decoded alone."""
    target = _target(tmp_path, "qwen2")
    g = torch.Generator().manual_seed(1)
    vocab = target.cfg.vocab_size
    prompts = [torch.randint(0, vocab, (1, n), generator=g) for n in (30, 70)]
    new = torch.randint(0, vocab, (2, 5), generator=g)
    cache = target.new_cache(2, max_length=120, initial_capacity=120)
    for slot, ids in enumerate(prompts):
        rows = torch.tensor([slot])
        meta = cache.prepare(rows, causal_mask(torch.tensor([ids.shape[1]]), ids.shape[1]))
        target(ids, meta.write_pos, cache, meta, capture_aux=False)
        cache.commit(rows, torch.tensor([ids.shape[1]]))
    both = _step(target, cache, new, causal_mask(torch.tensor([5, 5]), 5))
    for slot, ids in enumerate(prompts):
        alone = _prefill(target, ids)
        for t in range(5):
            one = _step(target, alone, new[slot : slot + 1, t : t + 1], torch.ones(1, 1, 1, dtype=torch.bool))
            alone.commit(None, torch.tensor([1]))
            assert torch.equal(one[0, 0], both[slot, t]), (slot, t)


def test_kernel_computes_attention():
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, length, rows = 6, 2, 32, 90, 7
    k = torch.randn(3, kv_heads, length + 10, dim, generator=g)
    v = torch.randn(3, kv_heads, length + 10, dim, generator=g)
    q = torch.randn(2, heads, rows, dim, generator=g)
    slots = torch.tensor([2, 0])
    mask = torch.rand(2, 1, rows, length - 5, generator=g) < 0.7
    mask[..., 0] = True
    out = row_attention.attend(q, k, v, slots, 5, length, mask)
    ref = F.scaled_dot_product_attention(q, k[slots, :, 5:length], v[slots, :, 5:length], attn_mask=mask,
                                         enable_gqa=True)  # fmt: skip
    assert torch.allclose(out, ref, atol=2e-6, rtol=1e-5), float((out - ref).abs().max())
    all_visible = row_attention.attend(q, k, v, slots, 5, length, None)
    ref = F.scaled_dot_product_attention(q, k[slots, :, 5:length], v[slots, :, 5:length], enable_gqa=True)
    assert torch.allclose(all_visible, ref, atol=2e-6, rtol=1e-5)
