"""Tensor parallelism on CPU (gloo): TP=2 generates exactly what TP=1 does, and fails loudly.

The checkpoint has MXFP4 experts, so each rank slices its experts out of the dequantised tensors, and an odd
vocabulary (251), so the vocab-parallel LM head's last slice is padded.
Engines with workers start once per module (a spawned worker costs a few seconds to import torch).
"""
from __future__ import annotations

import copy
import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from peagle_core import LLM, SamplingParams
from peagle_core.engine import tp
from peagle_core.engine.allreduce import BUFFER_BYTES, ONE_SHOT_MAX_BYTES, path_for
from peagle_core.engine.graphs import GraphRunner
from peagle_core.engine.memory import weight_bytes
from peagle_core.engine.model_runner import StepResult
from peagle_core.engine.tp import TPError, target_shard
from peagle_core.loading.checkpoint import load_target
from peagle_core.models.gpt_oss import VocabParallelHead
from peagle_core.models.layers import ForwardMeta
from peagle_core.testing import build_drafter, build_target, tiny_target_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7, 7, 7], list(range(100, 113))]
# Small budgets so that TP=2 also sees chunked prefill, requests joining mid-flight and preemption.
TIGHT = dict(max_num_batched_tokens=16, num_gpu_blocks=16, block_size=4, max_num_seqs=3, max_model_len=64)
ODD_VOCAB = dict(vocab_size=251, eos_token_id=[250], pad_token_id=249)  # 2 ranks: 126 + 125 ids and a padding row


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    cfg = tiny_target_config(**ODD_VOCAB)  # heads 4, KV heads 2, intermediate 64: all divide by 2
    build_target(d / "target", cfg, seed=0, mxfp4=True, scale=4.0)
    build_drafter(d / "peagle", cfg, parallel=True)
    build_drafter(d / "eagle3", cfg, parallel=False)
    return {"target": str(d / "target"), "peagle": str(d / "peagle"), "eagle3": str(d / "eagle3"), "config": cfg}


def spec(ckpt, mode: str, k: int = 3) -> dict | None:
    """"none", "peagle", "eagle3", or "peagle-adaptive" (whose start-up profile runs target forwards too)."""
    if mode == "none":
        return None
    head = mode.split("-")[0]
    return {"method": "eagle3", "model": ckpt[head], "num_speculative_tokens": k, "parallel_drafting": head == "peagle",
            "adaptive": mode.endswith("adaptive")}


@pytest.fixture(scope="module")
def reference(ckpt):
    llm = LLM(ckpt["target"], device="cpu")
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))}


def oracle_drafts(llm: LLM, reference: dict, corrupt: float, seed: int = 0) -> None:
    """Rank 0's drafts become the true continuation, randomly corrupted: every acceptance length and
    rollback happens, and the workers (which never see drafts) must still follow."""
    runner, rng = llm.engine.runner, random.Random(seed)
    execute = runner.execute

    def patched(batch, *a, **kw):
        res: StepResult = execute(batch, *a, **kw)
        for i, s in enumerate(batch):
            if s.samples:
                r = s.req
                done = r.token_ids[:r.num_computed + s.num_new] + res.tokens[i]
                ref = list(r.prompt_token_ids) + reference[tuple(r.prompt_token_ids)]
                nxt = (ref[len(done):len(done) + runner.K] + [0] * runner.K)[:runner.K]
                res.drafts[i] = [t if rng.random() > corrupt else (t + 1) % runner.vocab_size for t in nxt]
        return res

    runner.execute = patched


def run_staggered(llm: LLM, params: SamplingParams) -> list[list[int]]:
    eng, reqs, pending = llm.engine, {}, list(enumerate(PROMPTS))
    while pending or eng.has_work():
        if pending and (eng.num_steps % 2 == 0 or not eng.has_work()):
            i, p = pending.pop(0)
            reqs[i] = eng.add_request(f"r{i}", p, params)
        eng.step()
    return [reqs[i].output_ids for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def tp2(ckpt):
    """TP=2 engines by speculation mode, shut down (and checked to be gone) at the end of the module."""
    engines: dict[str, LLM] = {}

    def get(mode: str) -> LLM:
        if mode not in engines:
            engines[mode] = LLM(ckpt["target"], device="cpu", tensor_parallel_size=2,
                                speculative_config=spec(ckpt, mode), **TIGHT)
        return engines[mode]

    yield get
    for llm in engines.values():
        procs = list(llm.engine.tp.workers.procs.values())
        llm.engine.shutdown()
        assert all(p.exitcode == 0 for p in procs), "workers should leave cleanly on shutdown"


# --------------------------------------------------------------------------------------------
# Sharding, in one process
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", [2, 4])
def test_shards_sum_to_the_full_layer(tmp_path, world):
    """Loading each rank's shard from an MXFP4 checkpoint and summing the partial attention and MoE
    outputs over ranks gives the unsharded layer's outputs (biases counted once)."""
    cfg = tiny_target_config(num_attention_heads=8, num_key_value_heads=4)
    build_target(tmp_path, cfg, seed=3, mxfp4=True)
    full = load_target(tmp_path, torch.float32, "cpu")
    shards = [load_target(tmp_path, torch.float32, "cpu", world, target_shard(r)) for r in range(world)]
    assert shards[1].model.layers[0].self_attn.num_heads == 8 // world
    assert shards[1].model.layers[0].mlp.experts.w1.shape[1] == 2 * 64 // world
    x = torch.randn(11, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    meta = ForwardMeta.for_sequences([4, 7])
    for i in range(cfg.num_hidden_layers):
        want_attn = full.model.layers[i].self_attn(x, meta)
        got_attn = sum(s.model.layers[i].self_attn(x, meta) for s in shards)
        torch.testing.assert_close(got_attn, want_attn, rtol=1e-5, atol=1e-5)
        want_moe = full.model.layers[i].mlp(x)
        got_moe = sum(s.model.layers[i].mlp(x) for s in shards)
        torch.testing.assert_close(got_moe, want_moe, rtol=1e-5, atol=1e-5)


def run_ranks(world: int, fn) -> list:
    """fn(rank, all_gather) on `world` threads that meet in a real all-gather ([N, ...], rank order)."""
    barrier, box, out, errors = threading.Barrier(world, timeout=30), [None] * world, [None] * world, []

    def all_gather(rank: int, t: torch.Tensor) -> torch.Tensor:
        box[rank] = t
        barrier.wait()
        gathered = torch.stack(box)
        barrier.wait()  # nobody overwrites its box before every rank has read them all
        return gathered

    def run(rank: int) -> None:
        try:
            out[rank] = fn(rank, lambda t: all_gather(rank, t))
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_vocab_parallel_head_equals_the_full_head(world):
    """Each rank holds and computes only its slice of the head (251 ids: the last slice is padded), yet the gathered
    logits are exactly the full head's, and greedy is exactly torch.argmax over the whole row: ties go to the lowest
    id across ranks, and a padding row never wins even where every real logit is negative."""
    V, H = ODD_VOCAB["vocab_size"], 16
    g = torch.Generator().manual_seed(0)
    W = torch.randint(-2, 3, (V, H), generator=g).float()  # small integers: every dot product exact, so ties are real
    h = torch.randint(-2, 3, (6, H), generator=g).float()
    h[:2, 0] = -1
    W[[125, 126, 250]] = 4 * h[0]  # row 0's maximum three times: ids 125 | 126, 250 at N = 2; three slices at N = 4
    W[[130, 200]] = 4 * h[1]       # row 1's twice: one slice at N = 2, two at N = 4 (neither on rank 0)
    h[2] = 0
    h[2, 0] = 1
    W[:, 0] = -torch.randint(1, 5, (V,), generator=g).float()  # row 2: every logit < 0 = a padding row's
    W[[125, 126, 250, 130, 200], 0] = -4.0  # 4 * h[:2, 0]: the ties above stay exact
    want = h @ W.T
    assert want.argmax(-1)[:2].tolist() == [125, 130] and want[2].max() < 0
    assert (want[0] == want[0].max()).sum() == 3 and (want[1] == want[1].max()).sum() == 2
    rows = torch.tensor([2, 0, 1, 5])
    shard = [target_shard(r) for r in range(world)]

    def rank(r: int, all_gather):
        head = VocabParallelHead(H, V, world)
        assert head.weight.shape[0] == -(-V // world)  # only its slice
        with torch.no_grad():
            head.weight.copy_(shard[r]("lm_head.weight", W, head.weight.shape))
        head.place(r, all_gather)
        return head(h, None, False), head(h, None, True), head(h, rows, True), head(h, rows, False)

    for logits, greedy, greedy_rows, logits_rows in run_ranks(world, rank):
        assert torch.equal(logits, want) and torch.equal(logits_rows, want[rows])
        assert torch.equal(greedy, want.argmax(-1)) and torch.equal(greedy_rows, want[rows].argmax(-1))


# --------------------------------------------------------------------------------------------
# TP=2 == TP=1
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["none", "peagle", "eagle3", "peagle-adaptive"])
def test_tp2_greedy_equals_tp1(ckpt, reference, tp2, mode):
    llm = tp2(mode)
    if mode.endswith("adaptive"):  # its start-up profile ran target forwards on every rank
        assert type(llm.engine.policy).__name__ == "AdaptiveDepth"
    out = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in out] == [reference[tuple(p)] for p in PROMPTS]
    if mode == "none":  # the start-up memory report: each rank's own shard and KV cache
        full, mem = weight_bytes(load_target(Path(ckpt["target"]), torch.float32, "cpu")), llm.engine.memory_per_rank
        assert len(mem) == 2 and mem[0][0] == weight_bytes(llm.engine.target) and full / 2 < mem[1][0] < full
        assert mem[0][1] == mem[1][1] == llm.engine.runner.target_cache.numel() * 4
    if mode in ("peagle", "eagle3"):  # the same drafter on the same inputs: identical proposals and acceptance
        one = LLM(ckpt["target"], device="cpu", speculative_config=spec(ckpt, mode), **TIGHT)
        want = [o.spec_decode_stats for o in one.generate(PROMPTS, GREEDY)]
        assert [o.spec_decode_stats for o in out] == want
        assert want[0].num_drafts > 0


def test_tp2_shipped_tiny_pair_equals_tp1():
    """The shipped tiny pair (8192 ids, 4096 a rank) with P-EAGLE: greedy requests verify from gathered per-rank
    maxima, sampled ones from all-gathered logits, in the same batch; both give TP=1's tokens."""
    prompts = ["def fibonacci(n):", "The capital of France is", "Write a short poem about the sea."]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.9, max_tokens=24, seed=7, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    spec_cfg = {"method": "eagle3", "model": "tiny-peagle", "num_speculative_tokens": 3, "parallel_drafting": True}
    outs = {}
    for n in (1, 2):
        llm = LLM("tiny", speculative_config=spec_cfg, device="cpu", tensor_parallel_size=n, max_num_seqs=4,
                  max_model_len=128)
        try:
            assert llm.engine.target.lm_head.weight.shape[0] == 8192 // n
            outs[n] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
            # greedy alone: every step verifies from the gathered maxima
            outs[n, "greedy"] = [o.outputs[0].token_ids for o in llm.generate(prompts, params[0])]
        finally:
            llm.engine.shutdown()
    assert outs[2] == outs[1] and outs[2, "greedy"] == outs[1, "greedy"]
    assert outs[1, "greedy"][0] == outs[1][0] and outs[1][1] != outs[1, "greedy"][1]


def test_tp4_greedy_equals_tp1(tmp_path):
    """Four ranks, as the 4- and 8-GPU machines run the 120B model: every all-reduce and shard has more than one
    peer. The experts stay packed although 160 / 4 = 40 channels is not whole blocks (as 2880 / 4 = 720 is not):
    2 blocks a rank, rank 2 half padding and rank 3 all padding; 253 ids make 4 slices of 64 with 3 padding rows.
    TP=1 runs the dequantised experts: the padded packed shards must give its tokens."""
    cfg = tiny_target_config(num_attention_heads=8, num_key_value_heads=4, intermediate_size=160, vocab_size=253,
                             eos_token_id=[252], pad_token_id=251)
    build_target(tmp_path / "target", cfg, seed=1, mxfp4=True, scale=4.0)
    build_drafter(tmp_path / "peagle", cfg, parallel=True)
    target = str(tmp_path / "target")
    # fewer tokens: packed experts on CPU dequantise at every call
    prompts, greedy = PROMPTS[:3], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(target, device="cpu").generate(prompts, greedy)]
    llm = LLM(target, device="cpu", tensor_parallel_size=4, quantization="mxfp4", **TIGHT, speculative_config={
        "method": "eagle3", "model": str(tmp_path / "peagle"), "num_speculative_tokens": 3, "parallel_drafting": True})
    try:
        experts = llm.engine.target.model.layers[0].mlp.experts
        assert experts.mxfp4 and tuple(experts.w2_blocks.shape[2:]) == (2, 16)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == want
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("mode", ["none", "peagle", "eagle3"])
def test_tp2_graph_steps_replay_on_every_rank(reference, tp2, mode):
    """The graph path at TP=2, uncaptured (CPU): rank 0's target GraphSet announces each step with its graph key
    and the workers pad it into their own static buffers (built from rank 0's layout at start-up). A worker that
    ran the unpadded forward instead would meet rank 0's all-reduces with other sizes and fail."""
    llm = tp2(mode)
    eng = llm.engine
    graphs = eng.runner.graphs = GraphRunner(eng.runner, TIGHT["max_num_seqs"], capture=False,
                                             max_num_batched_tokens=TIGHT["max_num_batched_tokens"],
                                             mirror=eng.tp.mirror)
    kinds, send = [], eng.tp.comm.send_header
    eng.tp.comm.send_header = lambda *h: (kinds.append(h[0]), send(*h))[1]
    try:
        outs = run_staggered(llm, GREEDY)  # joins mid-flight: mixed-bucket steps as well as decode buckets
    finally:
        eng.runner.graphs = None
        del eng.tp.comm.send_header
    assert outs == [reference[tuple(p)] for p in PROMPTS]
    assert graphs.target.num_replays > 0 and graphs.target.num_padded > 0
    # every step fits a bucket here (16-token budget): each announced once, as a replay, never as an eager step,
    # and followed by its LM-head call where it samples
    forwards = [k for k in kinds if k != tp.HEAD]
    assert forwards == [tp.REPLAY] * graphs.target.num_replays and tp.HEAD in kinds
    assert llm.generate(PROMPTS[:1], GREEDY)[0].outputs[0].token_ids == reference[tuple(PROMPTS[0])]  # eager again


@pytest.mark.parametrize("mode", ["peagle", "eagle3"])
def test_tp2_partial_acceptance_joins_and_preemption(reference, tp2, mode):
    llm = tp2(mode)
    oracle_drafts(llm, reference, corrupt=0.25, seed=1)
    preempted, s0 = llm.engine.scheduler.num_preemptions, copy.deepcopy(llm.engine.stats)
    try:
        outs = run_staggered(llm, GREEDY)
    finally:
        llm.engine.runner.__dict__.pop("execute", None)  # back to the real proposals for other tests
    assert outs == [reference[tuple(p)] for p in PROMPTS]
    assert llm.engine.scheduler.num_preemptions > preempted
    s1 = llm.engine.stats
    assert 1 + (s1.num_accepted_tokens - s0.num_accepted_tokens) / (s1.num_drafts - s0.num_drafts) > 1.5
    assert llm.engine.blocks.num_free == llm.engine.blocks.num_blocks


@pytest.mark.parametrize("mode", ["none", "peagle"])
def test_tp2_seeded_sampling_equals_tp1(ckpt, tp2, mode):
    """Sampling happens on rank 0 only, from the same generator, over the full logits that the vocab-parallel head
    all-gathers: the same tokens as TP=1, and so are the steps that need full logits for greedy requests
    (penalties, log-probabilities)."""
    params = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=s, ignore_eos=True) for s in range(3)]
    params.append(SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, presence_penalty=1.5, logprobs=2))
    # Prompts no other test sends: the reused TP=2 engine's prefix cache then maps none of them, so both engines
    # schedule (and preempt) alike, and seeded samples follow the schedule through preemption.
    prompts = [[200 + i] + p for i, p in enumerate(PROMPTS)]
    want = LLM(ckpt["target"], device="cpu", speculative_config=spec(ckpt, mode), **TIGHT).generate(prompts, params)
    got = tp2(mode).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    lp = lambda o: [{t: (l.logprob, l.rank) for t, l in d.items()} for d in o.outputs[0].logprobs]
    assert len(lp(want[3])) == 16 and [d.keys() for d in lp(got[3])] == [d.keys() for d in lp(want[3])]
    for g, w in zip(lp(got[3]), lp(want[3])):
        assert {t: r for t, (_, r) in g.items()} == {t: r for t, (_, r) in w.items()}
        assert [v for v, _ in g.values()] == pytest.approx([v for v, _ in w.values()], abs=1e-4)


# --------------------------------------------------------------------------------------------
# Bad input and failures
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,needle", [(3, "num_attention_heads=4"), (4, "num_key_value_heads=2")])
def test_tensor_parallel_size_must_divide_the_model(ckpt, n, needle):
    t0 = time.monotonic()
    with pytest.raises(ValueError, match=f"tensor_parallel_size={n} must divide.*{needle}"):
        LLM(ckpt["target"], device="cpu", tensor_parallel_size=n)
    assert time.monotonic() - t0 < 5  # refused before any worker starts


def test_more_ranks_than_gpus_or_bundles_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 needs 4 GPUs .* only 2 are visible"):
        tp.rank_devices(torch.device("cuda"), 4, in_ray=False)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 needs 2 GPUs \(cuda:1..cuda:2\)"):
        tp.rank_devices(torch.device("cuda:1"), 2, in_ray=False)
    assert tp.rank_devices(torch.device("cuda"), 2, in_ray=False) == ["cuda:0", "cuda:1"]
    assert tp.rank_devices(torch.device("cuda"), 2, in_ray=True) == ["cuda", "cuda:0"]
    with pytest.raises(ValueError, match="placement group of 2 bundles"):
        tp.check_bundles([{"CPU": 1}], 2, cuda=False)
    with pytest.raises(ValueError, match="must each hold a GPU"):
        tp.check_bundles([{"GPU": 1}, {"CPU": 1}], 2, cuda=True)


def test_killed_worker_fails_generate_fast_and_for_good(ckpt, monkeypatch):
    monkeypatch.setenv("PEAGLE_TP_TIMEOUT_S", "2")  # bounds collectives, never idling
    llm = LLM(ckpt["target"], device="cpu", tensor_parallel_size=2)
    group = llm.engine.tp
    first = llm.generate([1, 2, 3], GREEDY)[0].outputs[0].token_ids
    time.sleep(3)  # idle for longer than the collective timeout: the workers must still be there
    assert llm.generate([1, 2, 3], GREEDY)[0].outputs[0].token_ids == first
    worker = group.workers.procs[1]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    t0 = time.monotonic()
    with pytest.raises(TPError, match=r"worker rank 1 \(pid \d+\) exited with code -9.*cannot continue"):
        llm.generate([4, 5, 6], GREEDY)
    assert time.monotonic() - t0 < 5
    with pytest.raises(TPError):  # dead for good: every later call says so
        llm.engine.has_work()
    llm.engine.shutdown()


def test_worker_dying_inside_a_collective_is_named(ckpt, monkeypatch):
    """Skip the per-step liveness check: the broadcast to a dead peer fails and the error names it (within the
    collective bound even where the socket's close goes unnoticed)."""
    monkeypatch.setenv("PEAGLE_TP_TIMEOUT_S", "5")
    llm = LLM(ckpt["target"], device="cpu", tensor_parallel_size=2)
    group = llm.engine.tp
    worker = group.workers.procs[1]
    os.kill(worker.pid, signal.SIGKILL)
    worker.join(10)
    monkeypatch.setattr(group, "check_alive", lambda: None)
    t0 = time.monotonic()
    with pytest.raises(TPError, match=r"tensor-parallel step broadcast failed \(rank 1 .*exited with code -9\)"):
        llm.engine.add_request("x", [1, 2, 3], GREEDY)
        llm.engine.step()
    assert time.monotonic() - t0 < 10
    assert not llm.engine.requests  # the batch's requests were finished with an error
    llm.engine.shutdown()


def test_stalled_worker_fails_the_step_within_the_collective_bound(ckpt, monkeypatch):
    """A worker that is alive but never answers (stopped) must not hang rank 0: the step fails after the bound."""
    monkeypatch.setenv("PEAGLE_TP_TIMEOUT_S", "3")
    llm = LLM(ckpt["target"], device="cpu", tensor_parallel_size=2)
    worker = llm.engine.tp.workers.procs[1]
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        with pytest.raises(TPError, match="tensor-parallel .* failed"):
            llm.generate([1, 2, 3], GREEDY)
        assert time.monotonic() - t0 < 20
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        llm.engine.shutdown()


def test_async_engine_reports_a_dead_worker_unhealthy(ckpt):
    """AsyncLLM.check_health fails (so Ray Serve replaces the replica) and open streams end with an error."""
    import asyncio

    from peagle_core.config import parse_engine_config
    from peagle_core.engine.async_llm import AsyncLLM, EngineDeadError

    llm = AsyncLLM(parse_engine_config(model=ckpt["target"], device="cpu", tensor_parallel_size=2))
    try:
        llm.check_health()
        worker = llm.engine.tp.workers.procs[1]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        deadline = time.monotonic() + 5
        with pytest.raises(EngineDeadError, match="worker rank 1"):
            while time.monotonic() < deadline:
                llm.check_health()
                time.sleep(0.05)

        async def one():
            async for _ in llm.generate([1, 2, 3], GREEDY, "after-death"):
                pass

        with pytest.raises(EngineDeadError):
            asyncio.run(asyncio.wait_for(one(), 10))
    finally:
        llm.shutdown()
        llm.engine.shutdown()


def test_parallel_bench_compares_tp1_and_tp2(tmp_path):
    """The GPU benchmark's code path, at the tiny shape on CPU: tokens agree and figures are written."""
    import json

    from peagle_core.parallel_bench import main

    main(["--shape", "tiny", "--layers", "2", "--tp", "2", "--device", "cpu", "--batch-sizes", "1,2", "--context", "8",
          "--steps", "2", "--warmup", "1", "--tokens", "6", "--kv-gb", "0.01", "--out", str(tmp_path)])
    r = json.loads((tmp_path / "summary.json").read_text())
    assert r["greedy_agreement"]["identical"] and r["greedy_agreement"]["agreeing_prefix"] == [6, 6, 6, 6]
    assert [d["batch"] for d in r["runs"]["tp2"]["decode"]] == [1, 2]
    assert r["runs"]["tp2"]["weights_gb_per_rank"] < r["runs"]["tp1"]["weights_gb_per_rank"]
    assert "| 2 |" in (tmp_path / "summary.md").read_text()


def test_allreduce_bench_times_two_all_reduces_a_layer_and_their_share_of_the_step(tmp_path):
    """The all-reduce estimate's code path on CPU (gloo, two processes): one row a batch size, two all-reduces a
    layer of [batch, hidden], and the share of the step where the parallel_bench summary has the batch size."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import allreduce_bench

    steps = tmp_path / "summary.json"
    steps.write_text(json.dumps({"runs": {"tp2": {"decode": [{"batch": 1, "median_ms": 500.0}]}}}))
    assert allreduce_bench.main(["--shape", "tiny", "--tp", "2", "--device", "cpu", "--batch-sizes", "1,3",
                                 "--iters", "3", "--warmup", "1", "--step-times", str(steps),
                                 "--out", str(tmp_path)]) == 0
    from peagle_core.bench import target_config

    r = json.loads((tmp_path / "allreduce.json").read_text())
    cfg = target_config("tiny")  # the shipped tiny target's shape
    assert [row["batch"] for row in r["rows"]] == [1, 3] and r["step_run"] == "tp2"
    one, three = r["rows"]
    assert one["all_reduces"] == 2 * cfg.num_hidden_layers and three["bytes_each"] == 3 * cfg.hidden_size * 4
    assert one["ms_per_step"] > 0 and one["share_of_step"] == pytest.approx(one["ms_per_step"] / 500.0)
    assert "share_of_step" not in three  # no step time for batch 3
    assert "| 1 |" in (tmp_path / "allreduce.md").read_text()


def test_all_reduce_paths_by_message_size():
    """Symmetric memory: one-shot for a decode step's messages, two-shot up to the buffer, the process group beyond,
    for sizes its 16-byte vectors cannot cover, and always without symmetric memory (CPU)."""
    row = 2880 * 2  # one token's hidden state, bf16
    assert path_for(row, True) == path_for(64 * row, True) == "one_shot"
    assert path_for(256 * row, True) == "two_shot" and path_for(ONE_SHOT_MAX_BYTES + 16, True) == "two_shot"
    assert path_for(BUFFER_BYTES + 16, True) == "group" and path_for(row + 2, True) == "group"
    assert path_for(row, False) == "group"


def test_allreduce_benchmark_checks_sums_on_the_fallback(tmp_path):
    """`benchmarks/allreduce.py` on CPU: two gloo ranks, `AllReduce` asked for symmetric memory falls back to the
    process group (which says why), and both sum rank-valued inputs exactly."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import allreduce

    assert allreduce.main(["--tp", "2", "--device", "cpu", "--dtype", "float32", "--hidden", "64", "--tokens", "1,3",
                           "--count", "2", "--warmup", "1", "--iters", "2", "--out", str(tmp_path)]) == 0
    r = json.loads((tmp_path / "allreduce_by_size.json").read_text())
    assert [row["tokens"] for row in r["rows"]] == [1, 3] and all(row["sums_exact"] for row in r["rows"])
    assert {row["path"] for row in r["rows"]} == {"group"} and "needs CUDA" in r["ours"]


# --------------------------------------------------------------------------------------------
# GPUs (skipped here)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_cuda_graphs_give_tp1_greedy_tokens():
    """The shipped pair in fp32 on two GPUs, P-EAGLE K=7: TP=2 with the target's CUDA graphs captured and replayed
    on both ranks in lockstep (NCCL all-reduces inside the graphs) gives TP=1's greedy tokens, as TP=2 eager does.
    (A trained model: its greedy margins are real, so fp32 all-reduce rounding cannot flip a token.) About 40 s
    an engine on an H200 pair."""
    prompts = ["def fibonacci(n):", "The capital of France is", "Write a short poem about the sea."]
    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    spec_cfg = {"method": "eagle3", "model": "tiny-peagle", "num_speculative_tokens": 7, "parallel_drafting": True}
    outs = {}
    for tp_size, eager in ((1, False), (2, False), (2, True)):
        llm = LLM("tiny", speculative_config=spec_cfg, device="cuda", dtype="float32", tensor_parallel_size=tp_size,
                  enforce_eager=eager, max_num_seqs=4, max_model_len=256)
        try:
            graphs = llm.engine.runner.graphs
            assert (graphs is None) == eager
            outs[tp_size, eager] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
            if graphs is not None:
                assert graphs.target.num_replays > 0 and len(graphs.target.graphs) > 0
        finally:
            llm.engine.shutdown()
    assert outs[2, False] == outs[1, False] and outs[2, True] == outs[1, False]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_tp2_symmetric_memory_all_reduce_gives_tp1_greedy_tokens(monkeypatch):
    """`PEAGLE_TP_ALLREDUCE=symm` on two GPUs: the layers' all-reduces go through symmetric memory (one-shot at these
    sizes, inside the CUDA graphs), not the NCCL fallback, and TP=2 still gives TP=1's greedy tokens in fp32."""
    prompts = ["def fibonacci(n):", "The capital of France is"]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    spec_cfg = {"method": "eagle3", "model": "tiny-peagle", "num_speculative_tokens": 7, "parallel_drafting": True}
    outs = {}
    for tp_size in (1, 2):
        monkeypatch.setenv("PEAGLE_TP_ALLREDUCE", "symm")
        llm = LLM("tiny", speculative_config=spec_cfg, device="cuda", dtype="float32", tensor_parallel_size=tp_size,
                  max_num_seqs=4, max_model_len=256)
        try:
            if tp_size == 2:
                assert llm.engine.engine_stats()["tensor_parallel"]["all_reduce"].startswith("symmetric memory")
            outs[tp_size] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        finally:
            llm.engine.shutdown()
    assert outs[2] == outs[1]
