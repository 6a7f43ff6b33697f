"""`peagle bench` on the CPU: complete outputs, byte accounting by hand, and the transformers baseline."""
import argparse
import json
import math

import pytest
import torch

from peagle_core import bench
from peagle_core.bench import bars, cli, hf as bench_hf, mxfp4
from peagle_core.bench.batches import Layout, engine_greedy, make_runner
from peagle_core.bench.hf import hf_from_ours, hf_generate
from peagle_core.bench.models import MXFP4_BITS, MXFP4_RMS, meta_model, target_config
from peagle_core.bench.roofline import decode_step_bytes
from peagle_core.bench.session import Bench
from peagle_core.loading.checkpoint import init_random_
from peagle_core.models.gpt_oss import GptOss
from peagle_core.models.layers import ForwardMeta
from peagle_core.testing import tiny_target_config

REQUIRED = ["decode_bs1_roofline_fraction", "draft_time_ratio_k7_over_k1", "draft_time_ratio_k7_over_k1_eagle3",
            "verify_k7_over_decode_bs1", "speedup_vs_hf_transformers_bs1", "decode_tok_s", "gpt_oss_120b"]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(argv)


def strict_json(path) -> dict:
    def bad(c):
        raise ValueError(f"non-standard JSON constant {c}")
    return json.loads(path.read_text(), parse_constant=bad)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    args = parse(["--shape", "tiny", "--device", "cpu", "--out", str(out), "--skip-hf", "--iters", "2",
                  "--layers", "4"])
    assert bench.run(args) == 0
    return out, strict_json(out / "summary.json"), (out / "summary.md").read_text()


def positive(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def test_tiny_run_writes_every_key_with_sane_numbers(tiny_run):
    _, s, _ = tiny_run
    assert s["status"] == "complete"
    for key in REQUIRED:
        assert key in s, key
    for key in ("decode_bs1_roofline_fraction", "draft_time_ratio_k7_over_k1", "draft_time_ratio_k7_over_k1_eagle3",
                "verify_k7_over_decode_bs1"):
        assert positive(s[key]), (key, s[key])
    assert s["speedup_vs_hf_transformers_bs1"] is None and "--skip-hf" in s["hf"]["not_run"]
    assert 0 < s["decode_bs1_roofline_fraction"] < 1
    assert set(s["decode_tok_s"]) == {"1", "8", "32", "64"}
    assert all(positive(v) for v in s["decode_tok_s"].values())
    m = s["machine"]
    assert m["torch"] == torch.__version__ and m["triton"] and s["date"] and s["command"].startswith("peagle bench")
    assert positive(s["bandwidth"]["read_tb_s"]) and positive(s["bandwidth"]["copy_tb_s"])


def test_tiny_run_figures_are_consistent_with_their_parts(tiny_run):
    _, s, _ = tiny_run
    d1 = s["decode"]["1"]
    assert math.isclose(s["decode_tok_s"]["1"], 1e3 / d1["step_ms"], rel_tol=1e-9)
    assert math.isclose(s["decode_tok_s"]["8"], 8e3 / s["decode"]["8"]["step_ms"], rel_tol=1e-9)
    expect_bytes = decode_step_bytes(init_random_(GptOss(target_config("tiny"))), s["settings"]["context"]).total
    assert s["bytes_per_step_bs1"]["total"] == expect_bytes == d1["bytes"]
    roofline_s = expect_bytes / (s["bandwidth"]["tb_s"] * 1e12)
    assert math.isclose(s["roofline_ms_bs1"], roofline_s * 1e3, rel_tol=1e-9)
    assert math.isclose(s["decode_bs1_roofline_fraction"], roofline_s / (d1["step_ms"] * 1e-3), rel_tol=1e-9)
    assert math.isclose(s["verify_k7_over_decode_bs1"], s["verify"]["7"]["step_ms"] / d1["step_ms"], rel_tol=1e-9)
    pe, e3 = s["draft"]["peagle"]["by_k"], s["draft"]["eagle3"]["by_k"]
    assert set(pe) == set(e3) == {str(k) for k in range(1, 8)}
    assert math.isclose(s["draft_time_ratio_k7_over_k1"], pe["7"]["draft_ms"] / pe["1"]["draft_ms"], rel_tol=1e-9)
    assert pe["7"]["drafter_passes"] == 1 and e3["7"]["drafter_passes"] == 7
    assert s["draft"]["peagle"]["layers"] == 4 and s["draft"]["eagle3"]["layers"] == 1


def test_tiny_run_big_shape_is_truncated_and_extrapolated(tiny_run):
    _, s, md = tiny_run
    big = s["gpt_oss_120b"]
    assert big["truncated"] is True and big["layers_run"] == 4 and big["layers_full"] == 9
    t = big["measured_step_ms"]
    assert set(t) == {"4", "2"}
    assert math.isclose(big["step_ms"], t["4"] + 5 * (t["4"] - t["2"]) / 2, rel_tol=1e-9)
    assert "Truncated" in md and "extrapolated" in md


def test_tiny_run_markdown_report(tiny_run):
    out, s, md = tiny_run
    assert s["command"] in md and s["machine"]["torch"] in md
    for key, *_ in bars.BARS:
        assert f"`{key}`" in md
    for title in ("Decode steps", "Verify steps", "Drafter steps", "transformers baseline", "120B shape"):
        assert title in md
    assert ">= 0.60 of the roofline" in md and "<= 1.15" in md and "<= 1.3" in md and ">= 10x" in md


def test_bytes_per_step_equal_a_hand_computation():
    cfg = tiny_target_config()  # H 64, 4 layers, 4 heads x 16, 2 KV heads, 4 experts top-2, I 64, V 256, window 8
    model = init_random_(GptOss(cfg))  # fp32: 4 bytes per value
    H, L, q, kv, I, E, k, V = 64, 4, 4 * 16, 2 * 16, 64, 4, 2, 256
    attention = (H * q + q) + 2 * (H * kv + kv) + (q * H + H) + 4  # q, k, v, o with biases; 4 sinks
    norms = 2 * H
    router = E * H + E
    expert = (2 * I * H + 2 * I) + (H * I + H)
    weights = L * (attention + norms + router + k * expert) + H + V * H + H  # + final norm, LM head, embedding row
    context = 20  # the step attends over 21 positions; sliding layers (0, 2) over 8 of them
    kv_values = 2 * kv * (8 + 21 + 8 + 21)
    b = decode_step_bytes(model, context)
    assert b.weights == 4 * weights
    assert b.kv == 4 * kv_values
    assert b.total == 4 * (weights + kv_values)
    # MXFP4 prices only the expert matrices at 4.25 bits
    mx = decode_step_bytes(model, context, expert_weight_bits=MXFP4_BITS)
    assert mx.weights == round(4 * weights - L * k * (3 * I * H) * (4 - MXFP4_BITS / 8))
    # bs 3: three embedding rows, three requests' K/V, expected distinct experts E(1 - (1 - k/E)^3) = 3.5
    b3 = decode_step_bytes(model, context, batch=3)
    assert b3.kv == 3 * b.kv
    assert b3.parts["experts"] == pytest.approx(4 * L * 3.5 * expert)
    assert b3.parts["embedding"] == 4 * 3 * H
    # a verify step of 1 + 3 tokens for one request: four tokens' experts and rows, K/V over 20 + 4 positions
    v = decode_step_bytes(model, context, tokens_per_req=4)
    assert v.parts["experts"] == pytest.approx(4 * L * E * (1 - (1 - k / E) ** 4) * expert)
    assert v.parts["embedding"] == 4 * 4 * H
    assert v.kv == 4 * 2 * kv * (8 + 24 + 8 + 24)


def test_packed_mxfp4_experts_are_priced_at_their_bytes_and_filled_with_sane_scales():
    cfg = tiny_target_config()
    packed = bench.build_random(lambda: GptOss(cfg, mxfp4_experts=True), torch.device("cpu"), torch.float32, 0)
    H, L, I, k = 64, 4, 64, 2
    b = decode_step_bytes(packed, 20)
    per_expert = 3 * I * H * 17 // 32 + 4 * (2 * I + H)  # 4-bit codes + one scale byte per 32, fp32 biases
    assert b.parts["experts"] == pytest.approx(L * k * per_expert)
    scales = packed.model.layers[0].mlp.experts.w1_scales
    weight_rms = 2.0 ** (scales.float() - 127).mean() * MXFP4_RMS  # E8M0: 2^(s - 127)
    assert 0.5 < weight_rms * H ** 0.5 < 2  # about 1/sqrt(fan_in), like the dense random weights
    assert packed.model.layers[0].mlp.experts.w1_blocks.unique().numel() > 200  # random bytes, not zeros


def test_bytes_per_step_at_the_real_shapes_match_the_issue_calibration():
    """Issue 7: 7.2 GB of weights per bs-1 step at the 20B shape in bf16; gptoss.md: ~3.7 / ~5.0 GB with MXFP4."""
    m20 = meta_model(target_config("20b"), torch.bfloat16)
    assert 7.15e9 < decode_step_bytes(m20, 1024).weights < 7.25e9
    assert 3.6e9 < decode_step_bytes(m20, 1024, expert_weight_bits=MXFP4_BITS).weights < 3.8e9
    m120 = meta_model(target_config("120b"), torch.bfloat16)
    assert 4.9e9 < decode_step_bytes(m120, 1024, expert_weight_bits=MXFP4_BITS).weights < 5.1e9


def test_transformers_model_from_our_weights_gives_our_logits():
    cfg = tiny_target_config()
    ours = init_random_(GptOss(cfg), seed=3)
    ids = torch.randint(0, cfg.vocab_size, (20,), generator=torch.Generator().manual_seed(0))  # 20 > window 8
    with torch.no_grad():
        h, _ = ours(ids, ForwardMeta.for_sequences([20]))
        ref = ours.compute_logits(h)
        hf = hf_from_ours(ours, consume=True)
        got = hf(ids[None]).logits[0]
    assert (got - ref).abs().max().item() <= 1e-4
    assert ours.model.layers[0].mlp.experts.w1.numel() == 0  # consumed: our expert matrices were released
    assert hf.config._attn_implementation == "eager"


def test_transformers_greedy_equals_our_engine_on_the_tiny_shape():
    cfg = target_config("tiny")
    model = init_random_(GptOss(cfg), seed=1)
    with torch.no_grad():
        model.lm_head.weight.mul_(4.0)  # peaked logits: no near-ties between the two implementations
    dev = torch.device("cpu")
    layout = Layout.for_run(context=40, max_k=1, extra_tokens=12)
    prompt = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    runner = make_runner(model, None, "none", 0, 1, layout, dev, torch.float32, seed=0)
    ours, loop_tok_s = engine_greedy(runner, prompt, 12, dev)
    assert len(ours) == 12 and positive(loop_tok_s)
    res = hf_generate(hf_from_ours(model), prompt, 12, dev, reps=1)
    assert res["output_ids"] == ours
    assert positive(res["decode_tok_s"]) and positive(res["end_to_end_tok_s"])


def test_bench_run_with_the_transformers_comparison(tmp_path):
    args = parse(["--shape", "tiny", "--device", "cpu", "--out", str(tmp_path), "--skip-draft", "--skip-120b",
                  "--batch-sizes", "1", "--max-k", "7", "--iters", "1", "--warmup", "0", "--hf-tokens", "6",
                  "--context", "16"])
    assert bench.run(args) == 0
    s = strict_json(tmp_path / "summary.json")
    assert s["hf"]["tokens"] == 6 and s["hf"]["same_greedy_prefix"] >= 1
    assert positive(s["speedup_vs_hf_transformers_bs1"])
    assert math.isclose(s["speedup_vs_hf_transformers_bs1"], s["decode_tok_s"]["1"] / s["hf"]["decode_tok_s"])
    assert s["gpt_oss_120b"] == {"not_run": "skipped with --skip-120b"} and "not_run" in s["draft"]


def test_packed_shape_full_depth_and_not_run(tmp_path):
    b = Bench(parse(["--shape", "tiny", "--device", "cpu", "--out", str(tmp_path), "--layers", "1"]),
              cli.resolve(parse(["--shape", "tiny", "--device", "cpu", "--max-k", "2"])), tmp_path)
    b.summary["bandwidth"] = {"tb_s": 1.0}
    assert "at least 2 layers" in mxfp4.packed_decode(b, "tiny-120b")["not_run"]
    b.args.layers = 0
    assert mxfp4.packed_decode(b, "tiny-120b")["not_run"] == "skipped with --layers 0"
    b.args.layers, b.r["iters"], b.r["warmup"] = 9, 1, 0
    full = mxfp4.packed_shape(b, "tiny-120b")
    assert full["truncated"] is False and full["layers_run"] == 9 and positive(full["tok_s"])
    # the whole model: verify k = 1..max_k against more bytes than a decode step, and the MoE layer alone
    assert list(full["verify"]) == ["1", "2"] and full["verify"]["2"]["bytes"] > full["verify"]["1"]["bytes"]
    assert all(positive(v["roofline_fraction"]) for v in full["verify"].values())
    assert list(full["moe_layer"]) == ["1", "8"] and all(positive(v["tb_s"]) for v in full["moe_layer"].values())
    s = b.summary
    assert s["decode_bs1_roofline_fraction_120b_mxfp4"] == full["roofline_fraction"]
    assert s["moe_mxfp4_tb_s_8_tokens_120b"] == full["moe_layer"]["8"]["tb_s"]
    assert s["verify_k7_roofline_fraction_120b"] is None  # max_k 2: no k = 7 figure, not a made-up one


@pytest.mark.parametrize("argv, message", [
    (["--batch-sizes", "8,32"], "include 1"),
    (["--context", "0"], "--context"),
    (["--max-k", "0"], "--max-k"),
    (["--layers", "-1"], "--layers"),
    (["--context", "5000"], "max_position_embeddings"),
])
def test_bad_arguments_fail_with_a_clear_message(tmp_path, argv, message):
    with pytest.raises(ValueError, match=message):
        bench.run(parse(["--shape", "tiny", "--device", "cpu", "--out", str(tmp_path), *argv]))


def test_cli_reports_a_missing_gpu_in_one_line(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from peagle_core.cli import main
    assert main(["bench", "--shape", "tiny", "--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--batch-sizes", "one"])


def test_a_failing_optional_section_is_recorded_and_the_run_completes(tmp_path, monkeypatch):
    def boom(*a, **kw):
        raise RuntimeError("boom")

    monkeypatch.setattr(bench_hf, "hf_from_ours", boom)
    args = parse(["--shape", "tiny", "--device", "cpu", "--out", str(tmp_path), "--skip-draft", "--skip-120b",
                  "--batch-sizes", "1", "--max-k", "2", "--iters", "1", "--warmup", "0", "--context", "8"])
    assert bench.run(args) == 0
    s = strict_json(tmp_path / "summary.json")
    assert s["status"] == "complete" and s["hf"] == {"not_run": "failed: RuntimeError: boom"}
    assert s["speedup_vs_hf_transformers_bs1"] is None and positive(s["decode_tok_s"]["1"])
    assert s["verify_k7_over_decode_bs1"] is None and set(s["verify"]) == {"1", "2"}  # no k = 7 figure when max-k < 7
    assert "Not run: failed: RuntimeError: boom" in (tmp_path / "summary.md").read_text()


def test_packed_decode_retries_shallower_after_running_out_of_memory(tmp_path, monkeypatch):
    tried = []

    def fake(b, full_cfg, depth, layout):
        tried.append(depth)
        if depth > 4:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return {str(depth): 10.0, str(depth // 2): 6.0}, 1000, {}

    monkeypatch.setattr(mxfp4, "time_depths", fake)
    b = Bench(parse(["--shape", "tiny", "--device", "cpu", "--out", str(tmp_path), "--layers", "6"]),
                    cli.resolve(parse(["--shape", "tiny", "--device", "cpu"])), tmp_path)
    b.summary["bandwidth"] = {"tb_s": 1.0}
    res = mxfp4.packed_decode(b, "tiny-120b")
    assert tried == [6, 4]
    assert res["layers_run"] == 4 and res["truncated"] is True
    assert res["step_ms"] == pytest.approx(10.0 + 5 * (10.0 - 6.0) / 2)  # 9 layers: 5 more at 2 ms each
    assert res["truncated_roofline_fraction"] == pytest.approx(1000 / 1e12 / 10e-3)


def test_profile_script_smoke_run_on_cpu(tmp_path):
    """benchmarks/profile_step.py end to end at the tiny shape (on a CPU: eager cases, no kernel table)."""
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_step.py"
    spec = importlib.util.spec_from_file_location("profile_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--shape", "tiny", "--context", "16", "--steps", "1", "--device", "cpu", "--pdl", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "profile.json").read_text())
    assert [c["step"] for c in res["cases"]] == ["decode", "decode, PDL asked, unavailable", "verify k=7",
                                                 "P-EAGLE draft K=1", "P-EAGLE draft K=7"]  # no PDL on a CPU
    assert not res["cases"][1]["pdl"]
    assert "errors" not in res and all(not c["graphs"] and c["wall_ms"] > 0 for c in res["cases"])
    assert res["cases"][2]["bytes"] > res["cases"][0]["bytes"] > 0  # a verify step reads more experts
    md = (tmp_path / "profile.md").read_text()
    assert "| verify k=7 | no |" in md and "| P-EAGLE draft K=7 | no |" in md
    # --batch: the target steps of that many requests, which read more K/V (and touch more experts) than one
    mod.main(["--shape", "tiny", "--context", "16", "--steps", "1", "--device", "cpu", "--skip-draft", "--batch", "3",
              "--out", str(tmp_path / "b3")])
    b3 = json.loads((tmp_path / "b3" / "profile.json").read_text())
    assert b3["batch"] == 3 and "errors" not in b3
    assert b3["cases"][0]["bytes"] > res["cases"][0]["bytes"]
    assert (tmp_path / "b3" / "profile.md").read_text().startswith("# Step profile (tiny shape, bs 3,")
