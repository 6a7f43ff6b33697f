"""Training end to end: heads trained on a predictable target's own greedy text learn it at every depth,
and the engine serving them accepts well above one token per step while staying exactly greedy."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from peagle_core.loading.checkpoint import init_random_, load_target, save_target
from peagle_core.models.gpt_oss import GptOss
from peagle_core.testing import tiny_target_config
from peagle_core.training.data import regenerate
from peagle_core.training.trainer import TrainConfig, Trainer, init_drafter, save_head

AUX = [1, 2, 3]
K = 4
DAMP = 0.01  # 0 makes the target a pure bigram map; a little context keeps the text less trivial
NUM_PROMPTS = 48



def prompts(count: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (6,), generator=g).tolist() for _ in range(count)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A random GPT-OSS whose attention and expert outputs are damped, so its greedy next token is
    mostly a fixed function of the current one: its own text falls into short cycles that a drafter
    can learn several tokens ahead (a plain random target's text is close to noise). The training set
    is that target's greedy continuations of random prompts, as the paper regenerates responses."""
    d = tmp_path_factory.mktemp("e2e")
    model = init_random_(GptOss(tiny_target_config()), seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(DAMP)
            layer.mlp.experts.w2.mul_(DAMP)
            layer.mlp.experts.b2.mul_(DAMP)
        model.lm_head.weight.mul_(4.0)
    save_target(model, d / "target")
    target = load_target(d / "target", torch.float32, "cpu")
    records = [{"input_ids": p} for p in prompts(NUM_PROMPTS, seed=0)]
    examples = regenerate(records, target, None, max_new_tokens=40, max_len=64, prompt_tokens=6)
    used = {t for e in examples for t in e.input_ids}
    mask_id = max(i for i in range(250) if i not in used)  # an id the text never contains, like a reserved token
    return {"dir": d, "target": target, "examples": examples, "mask_id": mask_id}


def train(setup, method: str, layers: int, steps: int, lr: float) -> tuple[Path, list[dict]]:
    target = setup["target"]
    drafter = init_drafter(target, method, layers, seed=1, aux_layer_ids=AUX,
                           mask_token_id=setup["mask_id"] if method == "peagle" else None, intermediate_size=128)
    cfg = TrainConfig(method=method, num_depths=K, steps=steps, batch_size=4, lr=lr, warmup_ratio=0.05,
                      min_lr_ratio=0.1, sequence_partitions=2 if method == "peagle" else 1, seed=0)
    records = Trainer(target, drafter, setup["examples"], cfg).train(progress=False)
    out = setup["dir"] / method
    save_head(drafter, out, torch.float32)
    return out, records


def mean_acc(records: list[dict]) -> list[float]:
    return [sum(r["acc"][d] for r in records) / len(records) for d in range(K)]


@pytest.fixture(scope="module")
def peagle_head(setup):
    return train(setup, "peagle", layers=2, steps=200, lr=3e-3)


@pytest.fixture(scope="module")
def eagle3_head(setup):
    return train(setup, "eagle3", layers=1, steps=150, lr=5e-3)


@pytest.mark.slow
@pytest.mark.parametrize("head", ["peagle_head", "eagle3_head"])
def test_training_drives_per_depth_accuracy_up(head, request):
    _, records = request.getfixturevalue(head)
    first, last = mean_acc(records[:5]), mean_acc(records[-20:])
    assert all(f < 0.2 for f in first), first
    assert last[0] > 0.75 and all(a > 0.5 for a in last), last
    assert records[-1]["loss"] < 0.3 * records[0]["loss"]


@pytest.mark.slow
@pytest.mark.parametrize("head,parallel", [("peagle_head", True), ("eagle3_head", False)])
def test_engine_with_trained_head_accepts_many_and_stays_greedy(setup, head, parallel, request):
    from peagle_core import LLM, SamplingParams

    path, _ = request.getfixturevalue(head)
    held_out = prompts(6, seed=123)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    plain = LLM(model=str(setup["dir"] / "target"), device="cpu", dtype="float32").generate(held_out, params)
    spec = LLM(model=str(setup["dir"] / "target"), device="cpu", dtype="float32",
               speculative_config={"method": "eagle3", "model": str(path), "num_speculative_tokens": K,
                                   "parallel_drafting": parallel}).generate(held_out, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    drafts = sum(o.spec_decode_stats.num_drafts for o in spec)
    accepted = sum(o.spec_decode_stats.num_accepted_tokens for o in spec)
    acceptance_length = 1 + accepted / drafts
    assert acceptance_length > 2.0, acceptance_length


def test_training_profile_script_smoke_run_on_cpu(setup, tmp_path):
    """benchmarks/profile_training.py records the steps after the skipped ones of a real `peagle train` run."""
    import importlib.util
    import json

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"input_ids": e.input_ids}) for e in setup["examples"][:8]))
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_training.py"
    spec = importlib.util.spec_from_file_location("profile_training", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main(["--skip", "1", "--record", "2", "--out", str(tmp_path / "prof"), "--", "--target", str(setup["dir"] / "target"),
              "--data", str(data), "--method", "peagle", "--num-depths", "3", "--layers", "1",
              "--mask-token-id", str(setup["mask_id"]), "--batch-size", "2", "--device", "cpu", "--out",
              str(tmp_path / "head")])
    res = json.loads((tmp_path / "prof" / "profile_training.json").read_text())
    assert len(res["step_s"]) == 2 and all(s > 0 for s in res["step_s"])
    assert res["host_ops"] and res["op_calls_per_step"] > 0
    assert res["sync_op_calls_per_step"] >= 0 and res["cuda_syncs_per_step"] is None  # counted on CUDA only
    assert "## Host operators" in (tmp_path / "prof" / "profile_training.md").read_text()
