"""Quantized targets (models/quantize.py, models/quantized_linear.py): layers against a
dequantize-then-matmul reference, row invariance, speculative output equal to the quantized target's
own plain output for every family, tree/chain/auto, batched, int8 and int4 weight-only and w8a8, and
bad input. The int8 kernels themselves: tests/test_int8_kernels.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from eaglespec.engine import Engine, Request
from eaglespec.models.int8_kernels import quantize_rows
from eaglespec.models.precision import MAX_TREE_PLAIN_GAP, tree_plain_gap
from eaglespec.models.quantize import SCHEMES, parse_quantize, quantize_target
from eaglespec.models.quantized_linear import QuantizedLinear
from eaglespec.speculation.config import TreeShape
from helpers import FAMILIES, random_drafter, tiny_target
from rigged import RiggedProposer
from test_greedy_lossless import _prompts

N_NEW = 16
GROUP = 32  # divides the tiny models' 64 and 128 input channels


def _linear(n, k, bias=False, seed=0):
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    nn.init.normal_(lin.weight, std=0.05)
    return lin


@pytest.mark.parametrize("bits, n, bias", [(8, 96, False), (8, 40, True), (4, 96, True), (4, 40, False)])
def test_layer_matches_dequantized_reference_and_is_row_invariant(bits, n, bias):
    """40 output channels: not a multiple of the int4 kernel's 16-row blocks (zero-padded)."""
    lin = _linear(n, 64, bias)
    q = QuantizedLinear.from_linear(lin, bits, GROUP)
    w = q.dequantized_weight()
    # rounding error: at most half a quantization step per weight (a step per channel, or per group)
    step = q.scales.float()[:, :, None] if bits == 4 else q.scales.float()[:, None, None]
    err = (w - lin.weight.float()).abs().view(n, -1, GROUP if bits == 4 else 64)
    assert (err <= 0.5 * step * 1.01 + 1e-6).all()
    x = torch.randn(2, 17, 64)
    y = q(x)
    assert y.shape == (2, 17, n) and y.dtype == torch.float32
    # the layer computes on bf16 activations (W8A16 / W4A16; the kernels round scales and outputs to bf16):
    # against bf16-rounded activations times the dequantized weight, within bf16 precision (|y| <~ 1)
    ref = torch.nn.functional.linear(x.bfloat16().float(), w, lin.bias)
    assert torch.allclose(y, ref, atol=1e-2, rtol=1e-2), (y - ref).abs().max()
    y16 = q(x.bfloat16())  # bf16 in: the same computation, returned in bf16
    assert y16.dtype == torch.bfloat16 and torch.allclose(y16.float(), y, atol=1e-2, rtol=1e-2)
    flat = x.reshape(-1, 64)
    full = q(flat)
    for rows in (slice(0, 1), slice(0, 5), slice(7, 8)):
        assert torch.equal(q(flat[rows]), full[rows])  # a row's bits do not depend on the rows beside it


@pytest.mark.parametrize("n, bias", [(96, False), (40, True)])
def test_w8a8_layer_is_the_exact_integer_product_of_rounded_activations_and_row_invariant(n, bias):
    lin = _linear(n, 256, bias)
    q = QuantizedLinear.from_linear(lin, 8, activations="int8")
    x = torch.randn(2, 17, 256) * torch.logspace(-2, 1, 17)[:, None]  # rows of very different sizes
    x[0, 3] = 0.0  # an all-zero row: scale clamped, output = bias
    offset, scale = quantize_rows(x.reshape(-1, 256))
    codes = offset.int() - 128
    assert offset.dtype == torch.uint8 and codes.abs().max() == 127 and codes.min() >= -127
    for fmt, dtype in (("s8", torch.int8), ("f32", torch.float32)):  # the other kernels' formats: same codes
        other, same_scale = quantize_rows(x.reshape(-1, 256), fmt)
        assert other.dtype == dtype and torch.equal(other.int(), codes) and torch.equal(same_scale, scale)
    err = (codes.float() * scale - x.reshape(-1, 256)).abs()
    assert (err <= 0.5 * scale * 1.0001).all()  # at most half a step per activation
    # reference in float64: exact integer sums, then the two scales
    ref = (codes.double() @ q.codes.double().T) * q.scales.double() * scale.double()
    if bias:
        ref = ref + lin.bias.double()
    y = q(x)
    assert y.shape == (2, 17, n) and y.dtype == torch.float32
    assert torch.allclose(y.reshape(-1, n).double(), ref, rtol=1e-6, atol=1e-7)
    assert torch.allclose(y, lin(x), rtol=0.05, atol=0.02 * lin(x).abs().max().item())  # close to the dense layer
    flat = x.reshape(-1, 256)
    full = q(flat)
    for rows in (slice(0, 1), slice(0, 5), slice(7, 8), slice(2, 19)):
        assert torch.equal(q(flat[rows]), full[rows])
    assert torch.equal(q(x.bfloat16()).float(), q(x.bfloat16().float()).bfloat16().float())  # bf16 in: same sums


def test_concatenated_layers_compute_the_same_and_hold_the_codes_once():
    from eaglespec.models.quantized_linear import FusedQuantized

    for bits, acts in [(8, None), (4, None), (8, "int8")]:
        parts = [QuantizedLinear.from_linear(_linear(n, 64, seed=n), bits, GROUP, acts) for n in (64, 32, 32)]
        x = torch.randn(5, 64)
        want = torch.cat([p(x) for p in parts], -1)
        fused = FusedQuantized(parts)
        assert torch.equal(fused(x), want)
        assert all(p.codes.untyped_storage().data_ptr() == fused.codes.untyped_storage().data_ptr() for p in parts)
        assert sum(p.codes.numel() for p in parts) == fused.codes.numel()
        assert torch.equal(torch.cat([p(x) for p in parts], -1), want)  # the originals still compute


def test_weight_bytes_meet_the_memory_goals():
    lin = _linear(512, 1024)
    fp32 = lin.weight.numel() * 4
    assert QuantizedLinear.from_linear(lin, 8).weight_bytes() <= 0.3 * fp32
    assert QuantizedLinear.from_linear(lin, 4, 128).weight_bytes() <= 0.17 * fp32


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_speculation_equals_plain_decoding_of_the_quantized_target(tmp_path, family, scheme):
    target, _, _ = tiny_target(tmp_path, family)
    quantize_target(target, *SCHEMES[scheme][:1], GROUP, SCHEMES[scheme][1])
    assert isinstance(target.model.layers[0].mlp.down_proj, QuantizedLinear)
    assert tree_plain_gap(target) <= MAX_TREE_PLAIN_GAP
    reqs = [Request(p, N_NEW) for p in _prompts(3, seed=41)]
    plain = [r.output_ids for r in Engine(target).generate(reqs).results]
    drafter = random_drafter(target, draft_vocab=64)
    for mode in ("tree", "chain", "auto"):
        for bs in (1, 3):
            eng = Engine(target, drafter, mode=mode, tree=TreeShape(4, 3, 10), chain_k=4, adaptive=False)
            eng.proposer = RiggedProposer(eng, plain, 96, break_every=3)  # long accepted paths, varied
            out = eng.generate(reqs, batch_size=bs)
            assert [r.output_ids for r in out.results] == plain, (mode, bs)
            assert out.stats.tau > 1.5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_w8a8_verification_rows_equal_plain_steps_bit_for_bit(tmp_path, family):
    """A W8A8 layer rounds its input to int8 steps, so tree and plain steps must agree exactly, not to
    ~1e-6: each row of one 17-token causal forward equals the plain step for that token (hidden states
    before lm_head, every bit). fp32 attention alone fails this (its sums change order with the row
    count); the target attends with the row-invariant kernel (models/row_attention.py), else in fp64."""
    from eaglespec.kv_cache import causal_mask

    target, _, _ = tiny_target(tmp_path, family)
    quantize_target(target, 8, activations="int8")
    cache = target.new_cache(1, max_length=8)
    assert cache.row_invariant or cache.dtype == torch.float64
    g = torch.Generator().manual_seed(7)
    n, t = 37, 17
    ids = torch.randint(0, target.cfg.vocab_size, (1, n + t), generator=g)

    def prefilled():
        cache = target.new_cache(1, max_length=n + t + 1)
        meta = cache.prepare(None, causal_mask(torch.tensor([n]), n))
        target(ids[:, :n], meta.write_pos, cache, meta, capture_aux=False)
        cache.commit(None, torch.tensor([n]))
        return cache

    cache = prefilled()
    meta = cache.prepare(None, causal_mask(torch.tensor([t]), t))
    tree, _ = target(ids[:, n:], meta.write_pos, cache, meta, capture_aux=False)
    cache = prefilled()
    for i in range(t):
        meta = cache.prepare(None, causal_mask(torch.tensor([1]), 1))
        step, _ = target(ids[:, n + i : n + i + 1], meta.write_pos, cache, meta, capture_aux=False)
        cache.commit(None, torch.tensor([1]))
        assert torch.equal(step[0, 0], tree[0, i]), i


def test_quantization_changes_the_target_it_is_lossless_against(tmp_path):
    """The quantized target is a different model: its plain output may differ from the fp32 one, and
    speculation follows the quantized one (checked above); here: int4 weights really are in use."""
    target, _, _ = tiny_target(tmp_path, "llama")
    x = torch.randn(1, 5, 64)
    before = target.model.layers[0].mlp.gate_proj(x)
    quantize_target(target, 4, GROUP)
    after = target.model.layers[0].mlp.gate_proj(x)
    layer = target.model.layers[0].mlp.gate_proj
    assert not torch.equal(before, after)
    want = x.bfloat16().float() @ layer.dequantized_weight().t()  # the int4 weights on bf16 activations
    assert torch.allclose(after, want, atol=1e-3, rtol=2**-8)


def test_bad_quantization_requests_are_clear(tmp_path):
    with pytest.raises(ValueError, match="int8, int4, w8a8 or none"):
        parse_quantize("int3")
    assert parse_quantize("none") is None and parse_quantize("int4") == (4, None)
    assert parse_quantize("w8a8") == (8, "int8")
    from eaglespec.settings import QUANTIZE_CHOICES

    assert set(QUANTIZE_CHOICES) == {"none", *SCHEMES}  # every command offers exactly the schemes that exist
    with pytest.raises(ValueError, match="needs int8 weights"):
        QuantizedLinear.from_linear(_linear(32, 64), 4, 32, activations="int8")
    with pytest.raises(ValueError, match="does not divide the layer's 64 input channels"):
        QuantizedLinear.from_linear(_linear(32, 64), 4, 128)
    with pytest.raises(ValueError, match="one of 32, 64, 128, 256"):
        QuantizedLinear.from_linear(_linear(32, 64), 4, 48)
    with pytest.raises(ValueError, match="int8, int4 and w8a8"):
        QuantizedLinear.from_linear(_linear(32, 64), 2)
    target, _, _ = tiny_target(tmp_path, "qwen2")
    with pytest.raises(ValueError, match="--quantize-group must be >= 1"):
        quantize_target(target, 4, 0)


def test_cli_generate_with_quantized_target(tmp_path, capsys):
    from eaglespec.cli import main

    _, _, target_dir = tiny_target(tmp_path, "llama")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt_ids": [1, 2, 3]}\n')
    rc = main(["generate", "--target", str(target_dir), "--input", str(prompts), "--max-new-tokens", "4",
               "--quantize", "int4", "--quantize-group", "32", "--json"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 0 and "int4 in the decoder layers, groups of 32, weight-only" in err
    rc = main(["generate", "--target", str(target_dir), "--input", str(prompts), "--max-new-tokens", "4",
               "--quantize", "w8a8", "--json"])  # fmt: skip
    assert rc == 0 and "int8 activations per token (w8a8" in capsys.readouterr().err
    rc = main(["generate", "--target", str(target_dir), "--input", str(prompts), "--quantize", "int4",
               "--quantize-group", "128"])  # fmt: skip
    assert rc == 2 and "does not divide" in capsys.readouterr().err


def round_like_ours(model, w8a8: bool) -> None:
    """Hooks on a transformers model's decoder linears so they see inputs rounded as our quantized layers
    round theirs: per token to int8 steps of amax / 127 (W8A8, as vLLM's scaled_int8_quant), or to bf16
    in and out (weight-only W8A16 / W4A16)."""

    def round_per_token(module, args):
        x = args[0]
        scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-30) / 127
        return (torch.round(x / scale).clamp(-127, 127) * scale,)

    def to_bf16(module, args, out=None):
        return (args[0].bfloat16().float(),) if out is None else out.bfloat16().float()

    for name, module in model.named_modules():
        if name.startswith("model.layers.") and name.endswith("proj"):
            module.register_forward_pre_hook(round_per_token if w8a8 else to_bf16)
            if not w8a8:
                module.register_forward_hook(to_bf16)


@pytest.mark.parametrize("scheme", ["int4", "w8a8"])
def test_sampling_preserves_the_quantized_target_distribution(tmp_path, scheme):
    """Chi-square against an oracle we did not write: transformers running the dequantized weights on
    inputs rounded as ours are."""
    import copy

    from eaglespec.models.checkpoint import load_target
    from eaglespec.sampling import SamplingParams
    from helpers import hf_tiny, save_hf
    from test_sampling_lossless import PROMPT, V, _chi2, _exact

    hf = hf_tiny("llama", vocab=V, hidden=32, layers=3, heads=4, kv_heads=2, init_range=0.08, seed=4)
    bits, activations = SCHEMES[scheme]
    target = quantize_target(load_target(save_hf(hf, tmp_path / "m")), bits, 32, activations)
    oracle = copy.deepcopy(hf)
    round_like_ours(oracle, w8a8=activations is not None)
    with torch.no_grad():
        for ours, theirs in zip(target.model.layers, oracle.model.layers):
            for part in ("self_attn", "mlp"):
                for name, layer in getattr(ours, part).named_children():
                    if isinstance(layer, QuantizedLinear):
                        getattr(getattr(theirs, part), name).weight.copy_(layer.dequantized_weight())
    params = SamplingParams(temperature=1.0, seed=21)
    drafter = random_drafter(target, draft_vocab=12, scale=0.3)
    eng = Engine(target, drafter, mode="tree", tree=TreeShape(3, 3, 8), adaptive=False)
    out = eng.generate([Request(PROMPT, 3)] * 3000, params, batch_size=750)
    toks = torch.tensor([r.output_ids for r in out.results])
    assert out.stats.accepted > 0.02 * out.stats.drafts
    p1, m2, m3, _ = _exact(oracle, params)
    counts = [torch.bincount(toks[:, i], minlength=V) for i in range(3)]
    pvals = [_chi2(counts[0], p1), _chi2(counts[1], m2), _chi2(counts[2], m3)]
    assert min(pvals) > 1e-3, pvals
    # power: the same counts against a distorted distribution, and against the first token's, are rejected
    assert _chi2(counts[1], m2**1.5 / (m2**1.5).sum()) < 1e-3 and _chi2(counts[1], p1) < 1e-3


@pytest.mark.parametrize("bits, activations", [(8, "none"), (4, "none"), (8, "int8")])
def test_saved_quantized_target_loads_without_requantizing_and_decodes_the_same(tmp_path, bits, activations):
    import json

    from eaglespec.cli import main
    from eaglespec.models.checkpoint import load_target

    target, _, target_dir = tiny_target(tmp_path, "qwen2")
    out = tmp_path / f"q{bits}"
    assert main(["quantize", "--target", str(target_dir), "--out", str(out), "--bits", str(bits),
                 "--group", "32", "--activations", activations]) == 0  # fmt: skip
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    acts = None if activations == "none" else activations
    assert config["quant_method"] == "eaglespec" and config["bits"] == bits and config["activations"] == acts
    loaded = load_target(out)
    assert loaded.quantization["activations"] == acts
    fresh = quantize_target(target, bits, GROUP, acts)
    for a, b in zip(loaded.model.layers[0].mlp.children(), fresh.model.layers[0].mlp.children()):
        if isinstance(b, QuantizedLinear):
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
            assert a.scales.dtype == torch.bfloat16
    reqs = [Request(p, N_NEW) for p in _prompts(2, seed=43)]
    want = [r.output_ids for r in Engine(fresh).generate(reqs).results]
    assert [r.output_ids for r in Engine(loaded).generate(reqs).results] == want
    with pytest.raises(ValueError, match="already quantized"):
        quantize_target(loaded, bits, GROUP)


def test_corrupt_or_foreign_quantized_checkpoints_are_refused(tmp_path):
    import json

    from safetensors.torch import load_file, save_file

    from eaglespec.models.checkpoint import load_target
    from eaglespec.models.io import CheckpointError
    from eaglespec.models.quantize import save_quantized

    target, _, target_dir = tiny_target(tmp_path, "llama")
    out = save_quantized(quantize_target(target, 4, GROUP), target_dir, tmp_path / "q")
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.scales"
    save_file({k: v for k, v in tensors.items() if k != name}, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="missing tensors.*up_proj.scales"):
        load_target(out)
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    bad_configs = [({"quant_method": "gptq", "bits": 4}, "'gptq' is not supported"),
                   ({"quant_method": "eaglespec", "bits": 3}, "int8, int4 and w8a8"),
                   ({"quant_method": "eaglespec", "bits": 4, "activations": "int8"}, "needs int8 weights"),
                   ({"quant_method": "eaglespec", "bits": 8, "group_size": 32}, "unexpected tensors.*zeros")]
    for bad, needle in bad_configs:
        (out / "config.json").write_text(json.dumps({**config, "quantization_config": bad}))
        with pytest.raises(CheckpointError, match=needle):
            load_target(out)


@pytest.mark.parametrize("fmt, bits, w8a8", [("pack-quantized", 4, False), ("pack-quantized", 8, False),
                                             ("int-quantized", 8, False), ("int-quantized", 8, True)])
def test_compressed_tensors_checkpoint_loads_and_decodes_like_transformers_on_its_weights(tmp_path, fmt, bits, w8a8):
    """A checkpoint written with compressed-tensors' own compressors (what vLLM loads): our layers equal
    the library's decompressed weights, and greedy decoding equals transformers running those weights on
    inputs rounded as ours are: to bf16 (weight-only), or per token to int8 steps of amax / 127 (W8A8, as
    vLLM's scaled_int8_quant does)."""
    import json

    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from safetensors.torch import load_file, save_file

    from eaglespec.models.checkpoint import load_target
    from helpers import hf_tiny, save_hf

    hf = hf_tiny("llama", seed=5)
    src = Path(save_hf(hf, tmp_path / "dense"))
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy="group" if bits == 4 else "channel",
                            group_size=32 if bits == 4 else None)  # fmt: skip
    inputs = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True) if w8a8 else None
    scheme = QuantizationScheme(targets=["Linear"], weights=args, input_activations=inputs)
    compressor = BaseCompressor.load_from_registry(fmt)
    tensors, dense = load_file(str(src / "model.safetensors")), {}
    for name in [k for k in tensors if k.startswith("model.layers.") and k.endswith("proj.weight")]:
        w, prefix = tensors.pop(name).float(), name[: -len(".weight")]
        levels = 7.5 if bits == 4 else 127.0
        amax = w.view(w.shape[0], -1, 32).abs().amax(-1) if bits == 4 else w.abs().amax(1, keepdim=True)
        scale = (amax / levels).to(torch.bfloat16)
        zero = torch.zeros_like(scale, dtype=torch.int8)
        packed = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)
        exact = {**packed, "weight_scale": packed["weight_scale"].float()}  # code x scale without bf16 rounding
        dense[name] = compressor.decompress(exact, scheme)["weight"].float()
        tensors.update({f"{prefix}.{k}": v for k, v in packed.items()})
    out = tmp_path / "ct"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
                                     "config_groups": {"group_0": scheme.model_dump()}}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    target = load_target(out)
    layer = target.model.layers[1].mlp.down_proj
    assert isinstance(layer, QuantizedLinear) and layer.bits == bits
    assert layer.activations == ("int8" if w8a8 else None) and target.quantization["activations"] == layer.activations
    assert torch.equal(layer.dequantized_weight(), dense["model.layers.1.mlp.down_proj.weight"])
    oracle = hf_tiny("llama", seed=5)
    oracle.load_state_dict({**oracle.state_dict(), **dense})
    round_like_ours(oracle, w8a8)
    prompt = _prompts(1, seed=44)[0]
    ours = Engine(target).generate([Request(prompt, N_NEW)]).results[0].output_ids
    with torch.no_grad():
        ids = torch.tensor([prompt])
        for _ in range(N_NEW):
            ids = torch.cat([ids, oracle(ids).logits[:, -1:].argmax(-1)], 1)
    assert ours == ids[0, len(prompt):].tolist()


def test_unsupported_compressed_tensors_configs_are_refused(tmp_path):
    import json

    from eaglespec.models.checkpoint import load_target
    from eaglespec.models.io import CheckpointError

    src = Path(tiny_target(tmp_path, "llama")[2])
    config = json.loads((src / "config.json").read_text())
    int8 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    static = {"weights": int8,
              "input_activations": {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False}}
    output = {"weights": int8, "output_activations": {"num_bits": 8, "type": "int", "dynamic": True}}
    w4a8 = {"weights": {**int8, "num_bits": 4, "strategy": "group", "group_size": 32},
            "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}
    fp8 = {"weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel"}}
    for fmt, group, needle in [("int-quantized", static, "input activation quantization .*'dynamic': False"),
                               ("int-quantized", output, "output activation quantization is not supported"),
                               ("pack-quantized", w4a8, "int8 input activations with pack-quantized 4-bit"),
                               ("float-quantized", fp8, "float symmetric weights")]:
        qcfg = {"quant_method": "compressed-tensors", "format": fmt, "config_groups": {"g": group}}
        (src / "config.json").write_text(json.dumps({**config, "quantization_config": qcfg}))
        with pytest.raises(CheckpointError, match=needle):
            load_target(src)
