"""The speculative engine is lossless, batches continuously, preempts safely and frees every block."""
import random

import pytest
import torch

from peagle_core import LLM, SamplingParams
from peagle_core.engine.model_runner import StepResult

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7, 7, 7], list(range(100, 113))]


def spec(pair, mode: str, k: int) -> dict:
    return {"method": "eagle3", "model": pair[mode], "num_speculative_tokens": k, "parallel_drafting": mode == "peagle"}


@pytest.fixture(scope="module")
def reference(tiny_pair):
    llm = LLM(tiny_pair["target"], device="cpu")
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))}


def with_oracle_drafts(llm: LLM, reference: dict, corrupt: float, seed: int = 0) -> LLM:
    """Replace the drafter's proposals with the true greedy continuation, randomly corrupted.

    The drafter still runs every step (shapes, KV writes); only its proposals change, so
    acceptance exercises every prefix length and rollback while the oracle stays exact.
    """
    runner, rng = llm.engine.runner, random.Random(seed)
    execute = runner.execute

    def patched(batch, **kw):
        res: StepResult = execute(batch, **kw)
        for i, s in enumerate(batch):
            if not s.samples:
                continue
            r = s.req
            full = r.token_ids[:r.num_computed + s.num_new] + res.tokens[i]
            ref = list(r.prompt_token_ids) + reference[tuple(r.prompt_token_ids)]
            nxt = ref[len(full):len(full) + runner.K] + [0] * runner.K
            res.drafts[i] = [t if rng.random() > corrupt else (t + 1) % 256 for t in nxt[:runner.K]]
        return res

    runner.execute = patched
    return llm


@pytest.mark.parametrize("mode", ["peagle", "eagle3"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_speculative_greedy_equals_plain_greedy(tiny_pair, reference, mode, k):
    llm = LLM(tiny_pair["target"], device="cpu", speculative_config=spec(tiny_pair, mode, k))
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [reference[tuple(p)] for p in PROMPTS]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert outs[0].spec_decode_stats.num_drafts > 0


@pytest.mark.parametrize("mode", ["peagle", "eagle3"])
@pytest.mark.parametrize("k", [1, 3, 7])
def test_lossless_with_partial_acceptance_joins_and_preemption(tiny_pair, reference, mode, k):
    """Requests join at different steps, prefill is chunked and blocks are scarce enough to preempt."""
    llm = LLM(tiny_pair["target"], device="cpu", speculative_config=spec(tiny_pair, mode, k),
              max_num_batched_tokens=16, num_gpu_blocks=16, block_size=4, max_num_seqs=3, max_model_len=64)
    with_oracle_drafts(llm, reference, corrupt=0.25, seed=k)
    eng = llm.engine
    reqs, pending = {}, list(enumerate(PROMPTS))
    while pending or eng.has_work():
        if pending and (eng.num_steps % 2 == 0 or not eng.has_work()):
            i, p = pending.pop(0)
            reqs[i] = eng.add_request(f"r{i}", p, GREEDY)
        eng.step()
    for i, p in enumerate(PROMPTS):
        assert reqs[i].output_ids == reference[tuple(p)], f"request {i}"
    assert eng.scheduler.num_preemptions > 0
    assert eng.stats.acceptance_length > 1.5
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_plain_greedy_equals_transformers_generate(tiny_pair, reference):
    transformers = pytest.importorskip("transformers")
    hf = transformers.GptOssForCausalLM.from_pretrained(tiny_pair["target"], torch_dtype=torch.float32,
                                                        attn_implementation="eager")
    for p in PROMPTS[:3]:
        out = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert out[0, len(p):].tolist() == reference[tuple(p)]


def test_blocks_all_free_after_finish_abort_and_preemption(tiny_pair):
    llm = LLM(tiny_pair["target"], device="cpu", speculative_config=spec(tiny_pair, "peagle", 3),
              num_gpu_blocks=18, block_size=4, max_num_seqs=4, max_model_len=72)
    eng = llm.engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"a{i}", p, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for _ in range(6):
        eng.step()
    assert eng.blocks.num_used > 0
    eng.abort("a1")
    while eng.has_work():
        eng.step()
    assert eng.blocks.num_free == eng.blocks.num_blocks
    assert eng.scheduler.num_preemptions > 0


def test_seeded_sampling_repeats_and_differs_across_seeds(tiny_pair):
    llm = LLM(tiny_pair["target"], device="cpu", speculative_config=spec(tiny_pair, "peagle", 3))
    sp = lambda seed: SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16, seed=seed, ignore_eos=True)
    a = llm.generate(PROMPTS[0], sp(1))[0].outputs[0].token_ids
    b = llm.generate(PROMPTS[0], sp(1))[0].outputs[0].token_ids
    c = llm.generate(PROMPTS[0], sp(2))[0].outputs[0].token_ids
    assert a == b and a != c


def test_stop_token_ids_and_max_tokens(tiny_pair, reference):
    llm = LLM(tiny_pair["target"], device="cpu", speculative_config=spec(tiny_pair, "peagle", 3))
    ref = reference[tuple(PROMPTS[1])]
    stop = ref[5]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == ref[:ref.index(stop) + 1] and out.finish_reason == "stop"
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ref[:3] and out.finish_reason == "length"


def test_a_request_near_max_tokens_verifies_every_draft_and_stops_at_the_limit(tiny_pair, reference):
    """Drafts are not cut to the tokens a request has left: a decode step stays uniform (the CUDA-graph case; a
    request's last step verifying fewer drafts than the others made the step run eagerly, ~2x a graphed step on
    the H200) and what is accepted past max_tokens is dropped, so the output still ends exactly at the limit."""
    from peagle_core.engine.graphs import is_uniform_decode

    llm = with_oracle_drafts(LLM(tiny_pair["target"], device="cpu", speculative_config=spec(tiny_pair, "peagle", 7)),
                             reference, corrupt=0.0)
    runner, decode_steps = llm.engine.runner, []
    execute = runner.execute

    def recording(batch, **kw):
        if all(s.num_new == 1 and s.num_drafts for s in batch):
            decode_steps.append(is_uniform_decode(batch))
        return execute(batch, **kw)

    runner.execute = recording
    limits = [9, 13, 24, 5]  # none a multiple of the 8 tokens a fully accepted step emits
    outs = llm.generate(PROMPTS, [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in limits])
    for p, n, o in zip(PROMPTS, limits, outs):
        assert o.outputs[0].token_ids == reference[tuple(p)][:n] and o.outputs[0].finish_reason == "length"
    assert decode_steps and all(decode_steps)


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"), ({"top_k": 2**63}, "top_k"), ({"seed": 2**64}, "seed"),
    ({"seed": -2**63 - 1}, "seed"), ({"temperature": float("inf")}, "temperature"),
    ({"temperature": float("nan")}, "temperature")])
def test_bad_sampling_params(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_request_whose_sampling_setup_fails_ends_alone_and_the_others_go_on(tiny_pair, reference):
    """A value that passed admission but breaks the step's packing (top_k beyond int64, as a request built
    without checks would carry) ends its own request with an error; the others decode exactly as alone."""
    from peagle_core.engine.llm_engine import StepError

    llm = LLM(tiny_pair["target"], device="cpu", speculative_config=spec(tiny_pair, "peagle", 3))
    eng = llm.engine
    good = [eng.add_request(f"ok{i}", p, GREEDY) for i, p in enumerate(PROMPTS[:3])]
    bad = eng.add_request("bad", PROMPTS[3], SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True))
    eng.step()
    bad.params.top_k = 2**63
    failures = []
    while eng.has_work():
        try:
            eng.step()
        except StepError as e:
            failures.append([r.request_id for r in e.requests])
    assert failures == [["bad"]] and bad.finish_reason == "error"
    for r, p in zip(good, PROMPTS):
        assert r.token_ids[len(p):] == reference[tuple(p)] and r.finish_reason == "length"
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_sampling_values_the_engine_cannot_use_are_refused_at_admission_naming_the_field(tiny_pair):
    eng = LLM(tiny_pair["target"], device="cpu").engine
    vocab = eng.target.config.vocab_size
    with pytest.raises(ValueError, match="vocabulary") as e:
        eng.add_request("a", [1, 2], SamplingParams(top_k=vocab + 1))
    assert e.value.param == "top_k"
    eng.add_request("b", [1, 2], SamplingParams(top_k=vocab, seed=2**64 - 1, max_tokens=2))  # the bounds themselves
    params = SamplingParams(seed=1)
    params.seed = 2**70  # past validation: the generator refuses it, the request alone fails
    with pytest.raises(ValueError) as e:
        eng.add_request("c", [1, 2], params)
    assert e.value.param == "seed"
    # Token ids the step indexes the logits with: min_tokens masks the stop ids, logit_bias adds to its ids.
    for name, kw in (("stop_token_ids", {"stop_token_ids": [vocab], "min_tokens": 1}),
                     ("logit_bias", {"logit_bias": {vocab: 1.0}})):
        with pytest.raises(ValueError, match=name) as e:
            eng.add_request(name, [1, 2], SamplingParams(max_tokens=2, **kw))
        assert e.value.param == name
    while eng.has_work():
        eng.step()
    assert eng.blocks.num_free == eng.blocks.num_blocks


def test_bad_requests_and_configs(tiny_pair, tmp_path):
    llm = LLM(tiny_pair["target"], device="cpu", max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([1] * 40, GREEDY)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([1, 999], GREEDY)
    with pytest.raises(ValueError, match="unknown key 'speculative_config.bogus'"):
        LLM(tiny_pair["target"], device="cpu", speculative_config={"model": tiny_pair["peagle"], "bogus": 1})
    with pytest.raises(ValueError, match="unknown key 'max_num_seq'"):
        LLM(tiny_pair["target"], device="cpu", max_num_seq=3)
    from peagle_core.testing import build_drafter, tiny_target_config
    build_drafter(tmp_path / "wide", tiny_target_config(hidden_size=32, head_dim=8))
    with pytest.raises(ValueError, match="hidden size"):
        LLM(tiny_pair["target"], device="cpu", speculative_config={"model": str(tmp_path / "wide"), "parallel_drafting": True})
    with pytest.raises(ValueError, match="cannot draft in parallel"):
        LLM(tiny_pair["target"], device="cpu", speculative_config=spec(tiny_pair, "eagle3", 3) | {"parallel_drafting": True})


@pytest.mark.parametrize("start,end", [(0, 1), (5, 6), (14, 40), (16, 48), (60, 70), (64, 66), (70, 75)])
def test_host_slots_equal_the_device_rule(start, end):
    """The host's slots (a run per block) equal the drafter's per-token rule on the device, -1 from max_model_len
    on."""
    from peagle_core.engine.drafting import cache_slots
    from peagle_core.engine.model_runner import host_slots

    table = [7, 2, 9, 4, 11]  # 5 blocks of 16 cover positions 0..79; max_model_len 64 stops writes at 64
    p = torch.arange(start, end)
    want = cache_slots(p, torch.zeros_like(p), torch.tensor([table]), 16, 64)
    assert host_slots(table, start, end, 16, 64) == want.tolist()


def test_streamed_text_and_counts_follow_the_output_as_it_grows():
    """The engine's per-step text deltas (only the new ids are detokenized each step) join to the decode of the
    whole output, and `num_output` (read every step, without copying the output) counts it, step by step,
    with several tokens a step from speculation."""
    llm = LLM(model="tiny", device="cpu", dtype="float32", max_model_len=256, max_num_seqs=2,
              speculative_config={"method": "eagle3", "model": "tiny-peagle", "num_speculative_tokens": 3,
                                  "parallel_drafting": True})
    engine = llm.engine
    reqs = [engine.add_request(f"s{i}", p, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
            for i, p in enumerate(["def fibonacci(n):", "Once upon a time"])]
    texts = {r.request_id: "" for r in reqs}
    while engine.has_work():
        for u in engine.step():
            texts[u.req.request_id] += u.new_text
            assert u.req.num_output == len(u.req.output_ids) == len(u.req.token_ids) - len(u.req.prompt_token_ids)
    for r in reqs:
        assert r.num_output == 60 and texts[r.request_id] == engine.tokenizer.decode(r.output_ids)
        assert r.stats.acceptance_length > 1  # several tokens a step did happen


def test_host_time_benchmark_runs_the_engine_loop_and_reports_its_host_share():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import host_time

    r = host_time.measure(requests=3, max_tokens=12, policy="adaptive", k=3, max_model_len=256)
    assert r["steps"] >= 12 // 4 and r["policy"] == "adaptive"  # at most K + 1 tokens a step
    assert 0 < r["host_us_per_step"] < 1e6 and r["first_quarter_us"] > 0 and r["last_quarter_us"] > 0
    parts = [r[f"{p}_us_per_step"] for p in ("policy", "schedule", "append", "text")]
    assert all(t > 0 for t in parts) and sum(parts) < r["host_us_per_step"]  # parts of the host time
    from peagle_core.engine.output import OutputState

    assert not hasattr(OutputState.update, "__wrapped__")  # the class's method is unwrapped again
    # --closed-loop: finished requests replaced, so it runs the steps asked for, past the first requests' end
    loop = host_time.measure(requests=2, max_tokens=4, policy="adaptive", k=3, max_model_len=256, closed_loop=12)
    assert loop["steps"] == 12 and loop["closed_loop"]


class _Cycle:
    """Garbage only the collector can free: it points at itself."""

    def __init__(self):
        self.me = self


def test_start_up_freezes_the_heap_a_dropped_engine_is_freed_and_frozen_cycles_are_reclaimed(tiny_pair):
    import gc
    import weakref

    from peagle_core.engine.memory import reclaim_dropped_engines

    engine = LLM(tiny_pair["target"], device="cpu").engine
    # what start-up built is out of the collector's walks: a full collection no longer visits it
    assert gc.get_freeze_count() > 0
    assert not any(o is engine.runner for o in gc.get_objects())
    # a CPU engine has no reference cycle: dropped, reference counting frees it, frozen as it is (a CPU start-up
    # does not unfreeze to collect dropped engines, so an engine with a cycle would stay until `shutdown`)
    gone = weakref.ref(engine.runner)
    gc.disable()
    try:
        del engine
        assert gone() is None
    finally:
        gc.enable()
    # a reference cycle frozen with a dropped engine: a CUDA start-up reclaims it before sizing its KV cache
    cycle = _Cycle()
    gc.freeze()
    gone = weakref.ref(cycle)
    del cycle
    gc.collect()
    assert gone() is not None  # frozen: a collection does not free it ...
    reclaim_dropped_engines()
    assert gone() is None  # ... the reclaim does
    second = LLM(tiny_pair["target"], device="cpu").engine
    assert gc.get_freeze_count() > 0
    second.shutdown()
    assert gc.get_freeze_count() == 0  # a shut-down engine is the collector's again
