"""Prefix caching is invisible in the outputs: the shipped tiny pair gives the same tokens, the same drafts (so the
same speculative statistics) and the same seeded samples with the cache on and off; every cached block holds the K/V
a fresh prefill of its tokens writes, in the target's cache and the drafter's; no block leaks."""
from __future__ import annotations


import pytest
import torch

from peagle_core import LLM, SamplingParams
from peagle_core.engine.block_manager import BlockManager
from peagle_core.engine.request import Request

BS = 8
MODES = ["none", "peagle", "eagle3"]
TEXT = ("You are a helpful assistant. Answer the question briefly, then give one example. "
        "The user is a programmer who likes Python and short answers.")
QUESTIONS = ["What is a list?", "How do I sort a dictionary by value?", "def fibonacci(n):", "Explain recursion.",
             "The capital of France is"]


def spec(mode: str, k: int = 3) -> dict | None:
    if mode == "none":
        return None
    return {"method": "eagle3", "model": f"tiny-{mode}", "num_speculative_tokens": k, "parallel_drafting": mode == "peagle"}


def make(mode: str, caching: bool, policy=None, **kw) -> LLM:
    args = dict(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4, block_size=BS) | kw
    return LLM("tiny", speculative_config=spec(mode), enable_prefix_caching=caching, policy=policy, **args)


def prompts(llm: LLM) -> list[list[int]]:
    """A shared system prompt, a prompt diverging exactly at a block boundary (the drafter's last entry of the block
    before depends on the token after it) and chats that extend an earlier prompt."""
    tok = llm.tokenizer
    system = tok.encode(TEXT)
    cut = (len(system) // BS - 1) * BS
    qs = [system + tok.encode(" " + q) for q in QUESTIONS]
    return qs + [system[:cut] + tok.encode(" Hello there! " + QUESTIONS[0]), qs[0] + tok.encode(" And a tuple?")]


def waves(llm: LLM, ps: list[list[int]], params: SamplingParams | list[SamplingParams]):
    """One request first, then the rest in two concurrent waves: later ones find earlier ones' prefixes cached."""
    params = params if isinstance(params, list) else [params] * len(ps)
    out = []
    for lo, hi in ((0, 1), (1, 4), (4, len(ps))):
        out += llm.generate(ps[lo:hi], params[lo:hi])
    return out


def on_and_off(mode: str, params: SamplingParams | list[SamplingParams], **kw) -> tuple[dict, dict]:
    """The waves with the cache off and on: ({caching: outputs}, {caching: LLM})."""
    outs, llms = {}, {}
    for caching in (False, True):
        llms[caching] = llm = make(mode, caching, **kw)
        outs[caching] = waves(llm, prompts(llm), params)
    return outs, llms


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def check_idle_and_cached_blocks(outs: dict, llms: dict, mode: str) -> int:
    """No leaks on either engine; the cache-on engine's cached blocks hold the right K/V (their count)."""
    for llm in llms.values():
        assert_idle(llm)
    toks = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs[True]]
    return assert_cached_blocks_match_a_fresh_prefill(llms[True], toks, mode)


def assert_idle(llm: LLM) -> None:
    blocks = llm.engine.blocks
    assert blocks.num_free == blocks.num_blocks and blocks.num_used == 0
    assert sorted(blocks.free + list(blocks.lru)) == list(range(blocks.num_blocks))  # each block once
    assert set(blocks.lru) == set(blocks.digest_of) and not any(blocks.refs)


def assert_cached_blocks_match_a_fresh_prefill(llm: LLM, token_lists: list[list[int]], mode: str) -> int:
    """Every cached block the engine's own lookup maps for a request's tokens holds, in both caches, what a cache-off
    engine's prefill of those tokens writes there (close, not equal: batches of other shapes round differently).
    Returns the blocks checked."""
    eng, fresh = llm.engine, make(mode, False, max_num_seqs=1).engine
    checked = 0
    for i, toks in enumerate(token_lists):
        probe = Request(f"probe{i}", toks, SamplingParams(temperature=0.0))
        eng.blocks.map_prefix(probe)
        found = list(probe.block_table)
        eng.blocks.release(probe)
        if not found:
            continue
        req = fresh.add_request(f"fresh{i}", toks, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        fresh.step()  # the whole prompt in one prefill; its blocks stay the request's until the abort below
        caches = [("target", eng.runner.target_cache, fresh.runner.target_cache)]
        if mode != "none":
            caches.append(("drafter", eng.runner.drafter_cache, fresh.runner.drafter_cache))
        for b, block in enumerate(found):
            for name, got, want in caches:
                torch.testing.assert_close(got[:, :, block], want[:, :, req.block_table[b]], atol=1e-4, rtol=1e-4,
                                           msg=lambda m: f"{name} K/V of block {b} of request {i}: {m}")
            checked += 1
        fresh.abort(req.request_id)
    return checked


# ----------------------------------------------------------------------------------------------
# The block manager alone
# ----------------------------------------------------------------------------------------------

def _req(tokens: list[int], computed: int) -> Request:
    r = Request("r", tokens, SamplingParams(temperature=0.0))
    r.num_computed = computed
    return r


def test_a_block_is_registered_only_once_final_and_its_next_token_known():
    bm = BlockManager(8, 4, enable_caching=True)
    r = _req(list(range(12)), computed=8)
    assert bm.grow(r.block_table, 12)
    r.token_ids = r.token_ids[:8]  # block 1's last drafter entry needs token 8: not known yet
    bm.commit(r)
    assert bm.num_cached == 1
    r.token_ids = list(range(12))
    r.behind = (3, [])  # the drafter's K/V from position 3 on is not written yet
    bm.commit(r)
    assert bm.num_cached == 1
    r.behind = None
    bm.commit(r)
    assert bm.num_cached == 2


def test_lookup_maps_the_longest_prefix_leaves_a_token_and_evicts_least_recent_first():
    bm = BlockManager(6, 4, enable_caching=True)
    a = _req(list(range(13)), computed=12)
    assert bm.grow(a.block_table, 13)
    bm.commit(a)
    first = list(a.block_table)
    bm.release(a)
    assert bm.num_free == 6 and bm.num_cached == 3
    b = _req(list(range(12)) + [99], computed=0)  # block 2 needs token 12 to be 12: it is 99
    assert bm.map_prefix(b) == 8 and b.block_table == first[:2]
    c = _req(list(range(8)), computed=0)
    assert bm.map_prefix(c) == 4  # 8 tokens: block 1 would leave nothing to compute
    assert bm.refs[first[0]] == 2
    bm.release(c)
    assert bm.grow(c.block_table, 16)  # 3 never-used blocks, then block 2 (the least recently freed)
    assert bm.num_evictions == 1 and first[2] in c.block_table and bm.num_cached == 2
    assert not bm.grow(c.block_table, 24)  # blocks 0 and 1 are b's: in use, never evicted
    bm.release(b)
    bm.release(c)
    assert bm.num_free == 6


# ----------------------------------------------------------------------------------------------
# The engine, cache on against off
# ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_greedy_outputs_and_drafts_are_the_same_with_the_cache(mode):
    outs, llms = on_and_off(mode, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    for off, on in zip(outs[False], outs[True]):
        assert on.outputs[0].token_ids == off.outputs[0].token_ids
        assert on.spec_decode_stats == off.spec_decode_stats  # same drafts: the cached drafter K/V is right
    cached = [o.num_cached_tokens for o in outs[True]]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:]) and all(c % BS == 0 for c in cached)
    assert all(o.num_cached_tokens == 0 for o in outs[False])
    stats = llms[True].engine.engine_stats()
    assert stats["prefix_cache_hits"] == sum(cached) and stats["prefix_cache_queries"] >= sum(
        len(o.prompt_token_ids) for o in outs[True])
    assert check_idle_and_cached_blocks(outs, llms, mode) > 10


@pytest.mark.parametrize("mode", ["peagle", "eagle3"])
def test_seeded_samples_are_the_same_with_the_cache(mode):
    """Rejection sampling draws from each request's generator once per verified row, so the same drafts give the same
    samples. (Not across preemption: a recompute samples one row where the request would have verified its drafts,
    and the cache changes when requests are preempted, as any change of memory does.)"""
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=24, ignore_eos=True, seed=i)
              for i in range(len(QUESTIONS) + 2)]  # one seed per prompt
    outs, llms = on_and_off(mode, params)
    assert tokens(outs[True]) == tokens(outs[False])
    assert sum(o.num_cached_tokens for o in outs[True]) > 0
    assert check_idle_and_cached_blocks(outs, llms, mode) > 10


class Alternating:
    """A depth policy that skips the drafter on some steps (k = 0, nothing drafted), so requests fall behind in the
    drafter's cache and catch up later (`Request.behind`): those blocks must not be cached before the catch-up."""

    def __init__(self, k: int):
        self.k, self.n = k, 0

    def choose(self, info) -> int:
        self.n += 1
        return self.k if self.n % 3 == 0 else 0

    def draft_depth(self, k: int) -> int:
        return k

    def observe(self, info, outcome) -> None:
        pass

    def learn(self, busy=None) -> None:
        pass

    def describe(self) -> dict[str, float]:
        return {}


@pytest.mark.parametrize("mode", ["peagle", "eagle3"])
def test_cached_blocks_are_right_after_steps_that_skip_the_drafter(mode):
    llm = make(mode, True, policy=Alternating(3))
    ps = prompts(llm)
    outs = []
    for p in ps:  # one at a time: every request but the first maps what the earlier ones cached
        outs += llm.generate([p], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    ref = make(mode, False)
    assert [o.outputs[0].token_ids for o in outs] == [
        o.outputs[0].token_ids for o in ref.generate(ps, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))]
    assert sum(o.num_cached_tokens for o in outs) > 0
    toks = [o.prompt_token_ids + o.outputs[0].token_ids for o in outs]
    assert assert_cached_blocks_match_a_fresh_prefill(llm, toks, mode) > 10
    assert_idle(llm)


@pytest.mark.parametrize("mode", MODES)
def test_preemption_and_eviction_under_a_tiny_block_budget(mode):
    """16 blocks of 8 for 3 requests of up to ~90 tokens: requests are preempted, cached prefixes evicted."""
    outs, llms = on_and_off(mode, SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True), num_gpu_blocks=16,
                            max_num_seqs=3, max_model_len=128, max_num_batched_tokens=32)
    assert tokens(outs[True]) == tokens(outs[False])
    eng = llms[True].engine
    assert eng.scheduler.num_preemptions > 0 and eng.blocks.num_evictions > 0 and eng.scheduler.prefix_hits > 0
    assert check_idle_and_cached_blocks(outs, llms, mode) > 0


@pytest.mark.parametrize("mode", ["none", "peagle"])
def test_a_request_whose_cached_prefix_is_evicted_while_it_waits_is_still_right(mode):
    """B maps A's cached prefix, is preempted for C (the newest running request is the victim), C's growth evicts the
    prefix B had mapped, then B resumes by recomputing it."""
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    long = SamplingParams(temperature=0.0, max_tokens=88, ignore_eos=True)
    llm = make(mode, True, num_gpu_blocks=16, max_num_seqs=2, max_model_len=128)  # C alone ends up needing all 16
    ref = make(mode, False)
    ps = prompts(llm)
    a, b, c = ps[0], ps[6], ps[2][-20:] + ps[3][-20:]
    llm.generate([a], greedy)
    eng = llm.engine
    rc = eng.add_request("c", c, long)
    eng.step()
    rb = eng.add_request("b", b, greedy)
    first_digest, evicted_while_waiting = None, False
    while eng.has_work():
        eng.step()
        if first_digest is None and rb.block_digests:
            first_digest = rb.block_digests[0]
        if rb.num_preemptions and not rb.block_table and first_digest not in eng.blocks.cached:
            evicted_while_waiting = True
    assert rb.num_cached_tokens > 0 and rb.num_preemptions > 0 and evicted_while_waiting
    want = ref.generate([b, c], [greedy, long])
    assert [rb.output_ids, rc.output_ids] == [o.outputs[0].token_ids for o in want]
    assert_idle(llm)


def test_aborted_requests_return_their_blocks_and_keep_what_they_computed():
    llm = make("peagle", True)
    eng, ps = llm.engine, prompts(llm)
    reqs = [eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
            for i, p in enumerate(ps[:3])]
    for _ in range(3):
        eng.step()
    for r in reqs:
        eng.abort(r.request_id)  # a client that disconnected
    assert not eng.has_work()
    assert_idle(llm)
    assert eng.blocks.num_cached > 0
    toks = [r.token_ids for r in reqs]
    assert assert_cached_blocks_match_a_fresh_prefill(llm, toks, "peagle") > 0
    again = eng.add_request("again", ps[0], SamplingParams(temperature=0.0, max_tokens=4))
    while eng.has_work():
        eng.step()
    assert again.num_cached_tokens == (len(ps[0]) - 1) // BS * BS


def test_the_cache_can_be_turned_off():
    llm = make("none", False)
    outs = waves(llm, prompts(llm), SamplingParams(temperature=0.0, max_tokens=4))
    assert all(o.num_cached_tokens == 0 for o in outs) and llm.engine.blocks.num_cached == 0
    assert llm.engine.engine_stats()["prefix_cache_queries"] == 0
