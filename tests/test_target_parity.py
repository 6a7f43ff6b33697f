"""Our GPT-OSS equals transformers' GptOssForCausalLM (fp32, tiny random configs)."""
import math

import pytest
import torch

from peagle_core.config import YarnScaling, yarn_inv_freq
from peagle_core.loading.checkpoint import CheckpointError, load_target
from peagle_core.loading.mxfp4 import dequantize, quantize
from peagle_core.models.layers import ForwardMeta
from peagle_core.testing import build_target, tiny_target_config

transformers = pytest.importorskip("transformers")


def hf_logits(path, ids: torch.Tensor) -> torch.Tensor:
    hf = transformers.GptOssForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return hf(ids[None]).logits[0]


def our_logits(path, ids: torch.Tensor) -> torch.Tensor:
    model = load_target(path, torch.float32, "cpu")
    with torch.no_grad():
        h, _ = model(ids, ForwardMeta.for_sequences([len(ids)]))
        return model.compute_logits(h)


@pytest.mark.parametrize("limit", [7.0, 0.5])  # 0.5 makes the SwiGLU clamp bite
def test_logits_match_transformers(tmp_path, limit):
    cfg = tiny_target_config(swiglu_limit=limit)
    build_target(tmp_path, cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (24,), generator=torch.Generator().manual_seed(0))  # 24 > window 8
    ours, ref = our_logits(tmp_path, ids), hf_logits(tmp_path, ids)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_mxfp4_checkpoint_matches_transformers_on_dequantized_weights(tmp_path):
    cfg = tiny_target_config()
    build_target(tmp_path / "q", cfg, seed=5, mxfp4=True)
    ours_model = load_target(tmp_path / "q", torch.float32, "cpu")
    # transformers reads the same weights once we write them dequantized (bf16 layout)
    from peagle_core.loading.checkpoint import save_target
    save_target(ours_model, tmp_path / "dq")
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    assert (our_logits(tmp_path / "q", ids) - hf_logits(tmp_path / "dq", ids)).abs().max().item() <= 1e-4


def test_sharded_checkpoint_with_index_loads_the_same(tmp_path):
    from peagle_core.loading.checkpoint import save_target
    model = build_target(tmp_path / "one")
    save_target(model, tmp_path / "many", max_shard_bytes=200_000)
    assert (tmp_path / "many" / "model.safetensors.index.json").exists()
    ids = torch.arange(12)
    assert torch.equal(our_logits(tmp_path / "one", ids), our_logits(tmp_path / "many", ids))


def test_mxfp4_decode_hand_computed_block():
    # one row, one block: bytes 0x21 -> low nibble 1 (0.5), high 2 (1.0); 0xF8 -> 8 (-0), 15 (-6)
    blocks = torch.zeros(1, 1, 16, dtype=torch.uint8)
    blocks[0, 0, 0], blocks[0, 0, 1] = 0x21, 0xF8
    scales = torch.tensor([[128]], dtype=torch.uint8)  # 2^(128-127) = 2
    w = dequantize(blocks, scales)
    assert w.shape == (1, 32)
    assert w[0, :4].tolist() == [1.0, 2.0, -0.0, -12.0]
    assert w[0, 4:].abs().sum() == 0


def test_mxfp4_quantize_round_trips_representable_values():
    codes = torch.randint(0, 256, (3, 64 // 2), dtype=torch.uint8).view(3, 2, 16)
    scales = torch.randint(120, 130, (3, 2), dtype=torch.uint8)
    w = dequantize(codes, scales)
    assert torch.equal(dequantize(*quantize(w)), w)


def test_yarn_inverse_frequencies_match_direct_formula():
    s = YarnScaling()
    inv, factor = yarn_inv_freq(64, 150000.0, s)
    low = 64 * math.log(4096 / (32 * 2 * math.pi)) / (2 * math.log(150000))
    high = 64 * math.log(4096 / (1 * 2 * math.pi)) / (2 * math.log(150000))
    assert abs(low - 8.0928) < 1e-3 and abs(high - 17.3980) < 1e-3  # truncate=False: no rounding
    for j in range(32):
        base = 150000 ** (2 * j / 64)
        ramp = min(max((j - low) / (high - low), 0), 1)
        expect = (1 / (32 * base)) * ramp + (1 / base) * (1 - ramp)
        assert math.isclose(inv[j], expect, rel_tol=1e-12)
    assert math.isclose(factor, 0.1 * math.log(32) + 1)
    assert inv[0] == 1.0 and math.isclose(inv[31], 1 / (32 * 150000 ** (62 / 64)))


def test_bad_checkpoints_fail_with_one_clear_line(tmp_path):
    import json
    from safetensors.torch import load_file, save_file
    build_target(tmp_path)
    f = tmp_path / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.self_attn.q_proj.weight"] = tensors["model.layers.0.self_attn.q_proj.weight"][:, :8].contiguous()
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match="q_proj.weight.*shape"):
        load_target(tmp_path, torch.float32, "cpu")
    build_target(tmp_path)
    tensors = load_file(f)
    tensors["model.layers.0.extra"] = torch.zeros(2)
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match="unknown tensor 'model.layers.0.extra'"):
        load_target(tmp_path, torch.float32, "cpu")
    del tensors["model.layers.0.extra"], tensors["model.norm.weight"]
    save_file(tensors, f)
    with pytest.raises(CheckpointError, match="missing tensor 'model.norm.weight'"):
        load_target(tmp_path, torch.float32, "cpu")
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported quant_method 'gptq'"):
        load_target(tmp_path, torch.float32, "cpu")
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_target(tmp_path, torch.float32, "cpu")


def test_batched_equal_length_forward_equals_one_by_one(tmp_path):
    cfg = tiny_target_config()
    build_target(tmp_path, cfg, seed=2)
    model = load_target(tmp_path, torch.float32, "cpu")
    a, b = torch.arange(20), torch.arange(50, 70)
    with torch.no_grad():
        both, _ = model(torch.cat([a, b]), ForwardMeta.for_sequences([20, 20]))
        one, _ = model(a, ForwardMeta.for_sequences([20]))
        two, _ = model(b, ForwardMeta.for_sequences([20]))
    assert torch.allclose(both, torch.cat([one, two]), atol=1e-5)


def test_rotary_cos_sin_are_computed_once_per_forward_with_identical_results(tmp_path, monkeypatch):
    """Every layer rotates at the same positions: the forward computes cos/sin once, bit for bit what each
    layer would compute itself."""
    import contextlib

    from peagle_core.models.layers import Rotary

    cfg = tiny_target_config()
    model = build_target(tmp_path / "t", cfg, seed=3).eval()
    ids, meta = torch.randint(0, cfg.vocab_size, (12,)), ForwardMeta.for_sequences([7, 5])
    calls, cos_sin = [], Rotary.cos_sin
    monkeypatch.setattr(Rotary, "cos_sin", lambda self, p, d: calls.append(1) or cos_sin(self, p, d))
    with torch.no_grad():
        shared, _ = model(ids, meta)
        assert len(calls) == 1
        monkeypatch.setattr(Rotary, "once_for", lambda self, p, d: contextlib.nullcontext())
        per_layer, _ = model(ids, meta)
    assert len(calls) == 1 + cfg.num_hidden_layers
    assert torch.equal(shared, per_layer)


def test_packed_qkv_gives_the_same_forward_and_keeps_the_weights_in_place(tmp_path):
    """The engine packs q/k/v into one GEMM: same outputs, same state dict, no second copy of the weights,
    and in-place updates of q_proj still reach the packed weight."""
    from peagle_core.models.layers import pack_qkv

    cfg = tiny_target_config()
    model = build_target(tmp_path / "t", cfg, seed=4).eval()
    ids, meta = torch.randint(0, cfg.vocab_size, (12,)), ForwardMeta.for_sequences([7, 5])
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        plain, _ = model(ids, meta)
        pack_qkv(model)
        packed, _ = model(ids, meta)
    assert torch.allclose(plain, packed, atol=1e-5)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(before[k], after[k]) for k in before)
    attn = model.attention_layers()[0]
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.qkv[0].untyped_storage().data_ptr()
    with torch.no_grad():
        attn.v_proj.weight.zero_()
        assert attn.qkv[0][-attn.v_proj.out_features:].abs().sum() == 0
