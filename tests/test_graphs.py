"""CUDA graphs for decode steps: the padded static-buffer path equals the eager runner.

On CPU the graph path runs with `capture=False` (the padded static buffers, no capture): every step
that a GPU would replay from a graph goes through the same buckets, padding and metadata, so these
tests prove that logic step for step against the plain eager runner. The GPU tests compare captured
graphs with eager mode in bf16 (skipped without CUDA).
"""
import copy
import itertools
import random

import pytest
import torch

from peagle_core import LLM, SamplingParams
from peagle_core.engine.drafting import cache_slots
from peagle_core.engine.graphs import GraphRunner, GraphSet, HostForward, graph_buckets, is_uniform_decode, make_graph_runner, token_buckets
from peagle_core.engine.request import Request
from peagle_core.engine.scheduler import Scheduled
from peagle_core.models.layers import ForwardMeta

MAX_SEQS = 6  # buckets 1, 2, 4, 6: three and five running requests are padded
PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [7, 7, 7], list(range(100, 113)), [42] * 9, list(range(200, 206))]
MAX_TOKENS = [40, 22, 33, 12, 36, 28]  # requests leave at different steps
CASES = [("none", 0)] + [(m, k) for m in ("peagle", "eagle3") for k in (1, 3, 7)]


def spec(pair, mode: str, k: int) -> dict | None:
    if mode == "none":
        return None
    return {"method": "eagle3", "model": pair[mode], "num_speculative_tokens": k, "parallel_drafting": mode == "peagle"}


def make_llm(pair, mode: str, k: int, **kw) -> LLM:
    return LLM(pair["target"], speculative_config=spec(pair, mode, k), max_num_seqs=MAX_SEQS, max_model_len=128,
               **({"device": "cpu"} | kw))


@pytest.fixture(scope="module")
def reference(tiny_pair):
    llm = LLM(tiny_pair["target"], device="cpu")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max(MAX_TOKENS), ignore_eos=True))
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, outs)}


def drive(llm: LLM, reference: dict, seed: int) -> tuple[list[list[int]], list]:
    """Requests join every other step and leave at their own lengths; after recording each step's raw
    result (the drafter's own drafts included), the drafts are replaced by the true continuation, partly
    corrupted, so acceptance takes every length. Returns (outputs, [(uniform?, result) per step])."""
    eng, runner, rng = llm.engine, llm.engine.runner, random.Random(seed)
    execute, steps = runner.execute, []

    def patched(batch, **kw):
        res = execute(batch, **kw)
        steps.append((is_uniform_decode(batch), copy.deepcopy(res)))
        for i, s in enumerate(batch):
            if s.samples and runner.drafter is not None:
                r = s.req
                full = r.token_ids[:r.num_computed + s.num_new] + res.tokens[i]
                ref = list(r.prompt_token_ids) + reference[tuple(r.prompt_token_ids)]
                nxt = ref[len(full):len(full) + runner.K] + [0] * runner.K
                res.drafts[i] = [t if rng.random() > 0.4 else (t + 1) % 256 for t in nxt[:runner.K]]
        return res

    runner.execute = patched
    reqs, pending = {}, list(enumerate(PROMPTS))
    while pending or eng.has_work():
        if pending and (eng.num_steps % 2 == 0 or not eng.has_work()):
            i, p = pending.pop(0)
            reqs[i] = eng.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[i],
                                                                  ignore_eos=True))
        eng.step()
    assert eng.blocks.num_free == eng.blocks.num_blocks
    return [reqs[i].output_ids for i in range(len(PROMPTS))], steps


# ---------------------------------------------------------------------------------------------
# Buckets and the graph case
# ---------------------------------------------------------------------------------------------


def test_buckets_cover_every_batch_size_up_to_max_num_seqs():
    assert graph_buckets(1) == [1]
    assert graph_buckets(3) == [1, 2, 3]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert graph_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_buckets(0)
    assert token_buckets(16) == [16]
    assert token_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    assert token_buckets(512) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512]


def test_only_uniform_decode_steps_are_the_graph_case():
    def item(prompt: int, computed: int, new: int, drafts: int) -> Scheduled:
        req = Request("r", list(range(prompt)), SamplingParams())
        req.num_computed = computed
        return Scheduled(req, new, drafts)

    assert is_uniform_decode([item(5, 4, 1, 3), item(9, 8, 1, 3)])
    assert is_uniform_decode([item(5, 4, 1, 0)])
    assert not is_uniform_decode([item(5, 4, 1, 3), item(9, 8, 1, 2)])  # different k
    assert not is_uniform_decode([item(5, 4, 1, 3), item(9, 0, 9, 0)])  # a prefill chunk
    assert not is_uniform_decode([item(9, 3, 1, 0)])                    # one token of a prompt: not sampling
    assert not is_uniform_decode([])


def test_capture_needs_cuda_and_the_engine_stays_eager_on_cpu(tiny_pair):
    llm = make_llm(tiny_pair, "peagle", 3)
    runner = llm.engine.runner
    assert runner.graphs is None  # CPU: eager, whatever enforce_eager says
    assert make_graph_runner(runner, MAX_SEQS, enforce_eager=False) is None
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        GraphRunner(runner, MAX_SEQS, capture=True)


@pytest.mark.parametrize("mode,k,draft_lens,masks", [("none", 0, None, 0), ("peagle", 3, [], 2),
                                                     ("eagle3", 3, [1], 0)])
@pytest.mark.parametrize("budget", [None, 100])
@pytest.mark.parametrize("varies", [False, True])
def test_capture_all_covers_every_step_shape_largest_first(tiny_pair, monkeypatch, mode, k, draft_lens, masks, budget,
                                                           varies):
    graphs = GraphRunner(make_llm(tiny_pair, mode, k).engine.runner, MAX_SEQS, capture=False,
                         max_num_batched_tokens=budget)
    graphs.capture = True  # record what would be captured (capturing needs CUDA)
    order = []
    record = lambda self, key: (order.append((self.name, key)), self.graphs.__setitem__(key, None))
    monkeypatch.setattr("peagle_core.engine.graphs.GraphSet.capture_one", record)
    monkeypatch.setattr("peagle_core.engine.graphs.DraftSteps.capture_one", record)
    depths = range(1, k + 1) if varies else None  # a varying depth drafts any n <= K; a fixed one only K
    assert graphs.capture_all(depths) == len(order)
    buckets = graph_buckets(MAX_SEQS)
    want = {("target", (b, b * q)) for b in buckets for q in range(1, k + 2)}
    want |= {("drafter", (b, b * q)) for b in buckets for q in draft_lens or []}
    if mode != "none":  # every decode step drafts inside one graph, behind the target's
        want |= {("drafter step", (b, b * q, n)) for b in buckets for q in range(1, k + 2)
                 for n in (depths or [k])}
    if budget:  # mixed steps: max_num_seqs + 1 requests, tokens up to the budget (+ P-EAGLE's MASK slots)
        want |= {("target", (MAX_SEQS + 1, t)) for t in token_buckets(budget)}
        if mode != "none":
            want |= {("drafter", (MAX_SEQS + 1, t)) for t in token_buckets(budget + MAX_SEQS * masks)}
    assert set(order) == want and len(order) == len(want)
    forwards = [key[1] for name, key in order if name != "drafter step"]
    assert forwards == sorted(forwards, reverse=True)
    steps = [i for i, (name, _) in enumerate(order) if name == "drafter step"]
    assert steps == list(range(len(forwards), len(order)))  # after every forward: they read the target's outputs
    if not budget:  # the largest: max_num_seqs x (K+1) or 2K
        assert order[0][1] == (MAX_SEQS, MAX_SEQS * (k + 1))
    assert graphs.capture_all(depths) == len(order) and len(order) == len(want)  # nothing captured twice


@pytest.mark.parametrize("policy,varies", [("fixed", False), ("adaptive", True), ("batch_table", True)])
def test_the_engine_captures_every_draft_depth_a_varying_policy_may_ask_for(tiny_pair, monkeypatch, policy, varies):
    """Lazily captured, each new drafter-step shape stalled a step by a capture (and its time taught the
    adaptive policy wrong step costs): every policy but a fixed depth gets all n in 1..K up front."""
    asked = []
    monkeypatch.setattr("peagle_core.engine.llm_engine.make_graph_runner",
                        lambda *a, **kw: asked.append(a[4] if len(a) > 4 else kw.get("draft_depths")))
    extra = {"num_speculative_tokens_per_batch_size": [[1, 4096, 2]]} if policy == "batch_table" else {}
    cfg = spec(tiny_pair, "peagle", 3) | {"depth_policy": policy, **extra}
    LLM(tiny_pair["target"], speculative_config=cfg, max_num_seqs=MAX_SEQS, max_model_len=128, device="cpu")
    assert asked == [range(1, 4) if varies else None]


# ---------------------------------------------------------------------------------------------
# The padded path on CPU (capture=False)
# ---------------------------------------------------------------------------------------------


def uniform_batch(runner, computed: list[int], q: int | list[int], seed: int = 0) -> tuple[torch.Tensor, ForwardMeta]:
    """Requests with `computed` cached tokens each feeding q tokens (or q[b]); request b owns blocks 4b..4b+3."""
    g = torch.Generator().manual_seed(seed)
    B = len(computed)
    qs = torch.tensor(q if isinstance(q, list) else [q] * B)
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, qs.tolist())])
    block_tables = torch.arange(4 * B).view(B, 4)
    req = torch.arange(B).repeat_interleave(qs)
    slots = cache_slots(positions, req, block_tables, runner.block_size, runner.max_model_len)
    meta = ForwardMeta(positions=positions, query_start_loc=torch.cat([torch.zeros(1, dtype=torch.long), qs.cumsum(0)]),
                       seq_lens=torch.tensor(computed) + qs, slot_mapping=slots, block_tables=block_tables)
    return torch.randint(0, 250, (positions.shape[0],), generator=g), meta


def run_padded(gs, ids: torch.Tensor, hidden: torch.Tensor | None, meta: ForwardMeta, uniform: bool = True):
    """The set's forward of the batch: from host lists if the set is staged (the target's), else from tensors."""
    key = gs.key(meta.seq_lens.shape[0], ids.shape[0], uniform, meta.block_tables.shape[1])
    assert key is not None
    if not gs.staged:
        return gs.run(ids, hidden, meta, key)
    assert hidden is None
    step = HostForward(ids.tolist(), meta.positions.tolist(), meta.query_start_loc.tolist(), meta.seq_lens.tolist(),
                       meta.block_tables.tolist(), meta.slot_mapping.tolist())
    return gs.run_host(step, key)


def changed_slots(cache: torch.Tensor, before: torch.Tensor) -> set[int]:
    """Flat cache slots whose K or V changed in any layer: cache is [2, L, blocks, block_size, Hkv, D]."""
    diff = (cache != before).any(dim=5).any(dim=4).any(dim=1).any(dim=0)
    return set(diff.flatten().nonzero().flatten().tolist())


@torch.inference_mode()
@pytest.mark.parametrize("mixed", [False, True])
def test_padded_forward_matches_eager_and_writes_only_real_slots(tiny_pair, mixed):
    llm = make_llm(tiny_pair, "eagle3", 3)  # EAGLE-3 keeps drafter decode graphs of 1 slot (drafter steps: below)
    runner = llm.engine.runner
    graphs = GraphRunner(runner, MAX_SEQS, capture=False, max_num_batched_tokens=64)
    for name, cache, q, run in [
        ("target", runner.target_cache, 4, lambda ids, h, meta: runner.target(ids, meta)),
        ("drafter", runner.drafter_cache, 1, lambda ids, h, meta: runner.drafter(ids, h, meta)),
    ]:
        cache.normal_(generator=torch.Generator().manual_seed(1))
        before = cache.clone()
        # 3 requests: padded to 4 of q tokens each, or (unequal lengths) to 7 requests and a token bucket
        ids, meta = uniform_batch(runner, [5, 17, 9], [q, 11, 2] if mixed else q)
        T = ids.shape[0]
        hidden = torch.randn(T, runner.drafter.config.hidden_size) if name == "drafter" else None
        eager = run(ids, hidden, meta)
        after_eager = cache.clone()
        cache.copy_(before)
        gs = getattr(graphs, name)
        padded = run_padded(gs, ids, hidden, meta, uniform=not mixed)
        Bp, Tp = (MAX_SEQS + 1, next(t for t in token_buckets(64) if t >= T)) if mixed else (4, 4 * q)
        v = gs.views((Bp, Tp))
        assert gs.staged == (name == "target")
        assert gs.num_padded == 1 and (v.seq_lens[3:] == 0).all() and (v.slot_mapping[T:] == -1).all()
        assert v.query_start_loc[Bp] == Tp and (v.query_start_loc[3:].diff() >= 0).all()
        assert (v.input_ids[:T] == ids).all() and (v.block_tables[:3, :4] == meta.block_tables).all()
        for e, p in zip(eager, padded):
            if e is None:
                assert p is None
            else:
                assert p.shape == e.shape
                torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache, after_eager, rtol=1e-5, atol=1e-5)
        assert changed_slots(cache, before) == set(meta.slot_mapping.tolist()), name  # padding wrote nothing
        # A smaller batch next: stale rows of the first one (block tables, hidden) must not matter.
        ids2, meta2 = uniform_batch(runner, [30], q, seed=2)
        hidden2 = hidden[:q] if hidden is not None else None
        for e, p in zip(run(ids2, hidden2, meta2), run_padded(gs, ids2, hidden2, meta2)):
            if e is not None:
                torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-5)


def decode_batch(n: int, k: int, seed: int) -> list[Scheduled]:
    """n requests with 9 + r cached tokens each verifying k drafts; request r owns blocks 4r..4r+3."""
    g, out = torch.Generator().manual_seed(seed), []
    for r in range(n):
        req = Request(f"r{r}", torch.randint(0, 250, (10 + r,), generator=g).tolist(),
                      SamplingParams(temperature=0.0))
        req.num_computed, req.block_table = 9 + r, list(range(4 * r, 4 * r + 4))
        req.drafts = torch.randint(0, 250, (k,), generator=g).tolist()
        out.append(Scheduled(req, 1, k))
    return out


def echo_set(staged: bool, device: str = "cpu", capture: bool = False, **kw) -> GraphSet:
    """A GraphSet whose forward returns what it was given, every input side by side per token or request."""
    def forward(ids, hidden, meta):
        req = torch.arange(meta.seq_lens.shape[0], device=ids.device).repeat_interleave(
            meta.query_start_loc.diff(), output_size=ids.shape[0])
        return (torch.stack([ids, meta.positions, meta.slot_mapping, meta.seq_lens[req], meta.block_tables[req, 0]], 1),)
    return GraphSet("echo", forward, graph_buckets(MAX_SEQS), 4, token_buckets(40), 5, None, torch.device(device),
                    capture, staged=staged, **kw)


def host_step(rng: random.Random, B: int, q: list[int]) -> HostForward:
    """B requests of q[b] tokens each, request b owning 1..5 blocks with ids from 10 * b."""
    tables = [[10 * b + j for j in range(rng.randint(1, 5))] for b in range(B)]
    T = sum(q)
    return HostForward([rng.randrange(1000) for _ in range(T)], [rng.randrange(80) for _ in range(T)],
                       [0] + list(itertools.accumulate(q)), [rng.randint(n, 80) for n in q], tables,
                       [rng.randrange(-1, 500) for _ in range(T)])


@pytest.mark.parametrize("seed", range(6))
def test_a_staged_set_writes_what_a_device_loaded_set_loads(seed):
    """The host's layout and dummies (`GraphSet._write`) against the device path's (`_load`, `_pad`) on the same
    steps, decode-shaped and mixed, a smaller step after a larger one under the same key (stale rows)."""
    rng = random.Random(seed)
    staged, loaded = echo_set(True), echo_set(False)
    for B in (rng.randint(2, MAX_SEQS), 1):
        uniform = rng.random() < 0.5
        q = [rng.randint(1, 4)] * B if uniform else [rng.randint(1, 6) for _ in range(B)]
        step = host_step(rng, B, q)
        width = max(map(len, step.block_tables))
        key = staged.key(B, sum(q), uniform, width)
        assert key == loaded.key(B, sum(q), uniform, width) and key is not None
        ids = torch.tensor(step.input_ids)
        meta = ForwardMeta(positions=torch.tensor(step.positions), query_start_loc=torch.tensor(step.query_start_loc),
                           seq_lens=torch.tensor(step.seq_lens), slot_mapping=torch.tensor(step.slot_mapping),
                           block_tables=torch.tensor([t + [0] * (width - len(t)) for t in step.block_tables]))
        (out,) = staged.run_host(step, key)
        assert out.tolist() == loaded.run(ids, None, meta, key)[0].tolist()
        assert out[:, 0].tolist() == step.input_ids and out[:, 4].tolist() == [t[0] for t, n in zip(step.block_tables, q)
                                                                               for _ in range(n)]
        a, b = staged.views(key), loaded.views(key)
        for name in ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens"):
            assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
        assert a.block_tables[:B, :width].tolist() == b.block_tables[:B, :width].tolist()
        assert a.query_start_loc[-1] == key[1] and (a.slot_mapping[sum(q):] == -1).all() and (a.seq_lens[B:] == 0).all()
    with pytest.raises(RuntimeError, match="run_host"):
        staged.run(ids, None, meta, key)


@torch.inference_mode()
@pytest.mark.parametrize("mode", ["peagle", "eagle3"])
@pytest.mark.parametrize("draft_len", [None, 2])
def test_padded_drafter_step_equals_eager_and_its_dummies_write_nothing(tiny_pair, mode, draft_len):
    """A decode step of 3 requests after one of 4: the drafter step's dummy (row 3) keeps request 3's stale
    block-table row, yet writes no K/V there; drafts and caches equal the eager runner's (K drafts, or fewer as
    an adaptive depth asks)."""
    k = 3
    eager, padded = make_llm(tiny_pair, mode, k).engine.runner, make_llm(tiny_pair, mode, k).engine.runner
    graphs = padded.graphs = GraphRunner(padded, MAX_SEQS, capture=False)
    for runner in (eager, padded):
        runner.target_cache.normal_(generator=torch.Generator().manual_seed(1))
        runner.drafter_cache.normal_(generator=torch.Generator().manual_seed(2))
    results = {}
    for n in (4, 3):
        before = padded.drafter_cache.clone()
        results[n] = [r.execute(decode_batch(n, k, seed=n), draft_len=draft_len) for r in (eager, padded)]
        assert results[n][0] == results[n][1]
        assert all(len(d) == (draft_len or k) for d in results[n][1].drafts)
        for cache, want in ((padded.drafter_cache, eager.drafter_cache), (padded.target_cache, eager.target_cache)):
            torch.testing.assert_close(cache, want, rtol=1e-5, atol=1e-5)  # padded GEMMs: rounding only
        # the drafter writes its verified and drafted slots (blocks of requests 0..n-1) and nothing else
        assert {s // (4 * padded.block_size) for s in changed_slots(padded.drafter_cache, before)} == set(range(n))
    assert graphs.draft_steps.num_replays == 2 and graphs.draft_steps.num_padded == 1
    assert (graphs.target.views((4, 4 * (k + 1))).block_tables[3, :4] == torch.arange(12, 16)).all()  # stale: request 3's


@pytest.mark.parametrize("mode,k", CASES)
@pytest.mark.parametrize("budget", [None, 512])
def test_padded_graph_path_gives_the_eager_runners_steps(tiny_pair, reference, mode, k, budget):
    """Token for token, acceptance for acceptance and draft for draft, every step equals the eager runner;
    without a token budget only decode steps take the graph path, with one every step does."""
    expected = [reference[tuple(p)][:n] for p, n in zip(PROMPTS, MAX_TOKENS)]
    eager_out, eager_steps = drive(make_llm(tiny_pair, mode, k), reference, seed=k)
    llm = make_llm(tiny_pair, mode, k)
    graphs = llm.engine.runner.graphs = GraphRunner(llm.engine.runner, MAX_SEQS, capture=False,
                                                    max_num_batched_tokens=budget)
    out, steps = drive(llm, reference, seed=k)
    assert eager_out == expected
    assert out == expected
    assert [r for _, r in steps] == [r for _, r in eager_steps]
    num_uniform = sum(u for u, _ in steps)
    assert 0 < num_uniform < len(steps)  # some steps hold prefill chunks
    assert graphs.target.num_replays == (len(steps) if budget else num_uniform) and graphs.target.num_padded > 0
    if mode != "none":  # every decode step drafts in one (padded) graph of its own; mixed steps through the drafter's
        assert graphs.draft_steps.num_replays == num_uniform and graphs.draft_steps.num_padded > 0
        if budget:
            assert graphs.drafter.num_replays >= len(steps) - num_uniform and graphs.drafter.num_padded > 0
        accepted = [a for u, r in steps if u for a in r.num_accepted]
        assert max(accepted) > 0 and len(set(accepted)) > 1  # drafts accepted and rejected inside graph steps


# ---------------------------------------------------------------------------------------------
# GPU: captured graphs
# ---------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_a_staged_graph_reads_its_step_when_it_replays_and_the_next_write_waits_for_it():
    """Replays queued behind a busy device: each must see its own step (its graph copies the pinned buffer in when
    it runs), so a write into that buffer while a replay is pending must wait; it would not without the wait."""
    gs = echo_set(True, "cuda", capture=True, pool=torch.cuda.graph_pool_handle())
    rng = random.Random(0)
    steps = [host_step(rng, 3, [2, 2, 2]) for _ in range(3)]
    key = gs.key(3, 6, True, max(len(t) for st in steps for t in st.block_tables))
    gs.capture_one(key)
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of device time: every replay below queues behind it
    outs = [gs.run_host(st, key)[0].clone() for st in steps]
    torch.cuda.synchronize()
    for st, out in zip(steps, outs):
        assert out[:, 0].tolist() == st.input_ids and out[:, 2].tolist() == st.slot_mapping
    gs.device_idle()
    assert gs.run_host(steps[0], key)[0][:, 1].tolist() == steps[0].positions


@pytest.mark.gpu
@cuda
def test_pdl_changes_no_step_and_no_graph_output(tiny_pair, reference, monkeypatch):
    """PEAGLE_PDL=1 (every Triton kernel launched with programmatic dependent launch, kernels/dispatch.py; the
    graphs are captured with it, so each LLM is built after setting it) against it off: every engine step
    (tokens, drafts, acceptance, the P-EAGLE drafter's graphed steps included), then a replayed target decode
    graph's outputs and the KV cache it wrote, bit for bit. (First of the GPU tests here, so that the timed GPU
    run of benchmarks/gpu_run.sh reaches it.)"""
    from peagle_kernels.dispatch import use_pdl

    mode, k, got = "peagle", 3, {}
    for pdl in ("0", "1"):
        monkeypatch.setenv("PEAGLE_PDL", pdl)
        if pdl == "1" and torch.cuda.get_device_capability()[0] >= 9:
            assert use_pdl(torch.empty(0, device="cuda")), "PEAGLE_PDL=1 on sm_90+, but Triton cannot launch with PDL"
        llm = make_llm(tiny_pair, mode, k, device="cuda", dtype="bfloat16")  # captures every graph now
        out, steps = drive(llm, reference, seed=k)
        runner = llm.engine.runner
        with torch.inference_mode():
            runner.target_cache.normal_(generator=torch.Generator(device="cuda").manual_seed(1))
            ids, meta = uniform_batch(runner, [5, 17, 9], k + 1)
            ids, meta = ids.cuda(), ForwardMeta(**{f: getattr(meta, f).cuda() for f in
                                                  ("positions", "query_start_loc", "seq_lens", "slot_mapping",
                                                   "block_tables")})
            outs = [None if o is None else o.clone() for o in run_padded(runner.graphs.target, ids, None, meta)]
        got[pdl] = out, [r for _, r in steps], outs, runner.target_cache.clone()
        assert runner.graphs.target.num_replays > 0
        del llm, runner
    (out0, steps0, outs0, cache0), (out1, steps1, outs1, cache1) = got["0"], got["1"]
    assert out1 == out0 and steps1 == steps0
    assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(outs0, outs1))
    assert torch.equal(cache1, cache0)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode,k", [("none", 0), ("peagle", 3), ("peagle", 7), ("eagle3", 3)])
def test_cuda_graphs_give_eager_greedy_tokens_bf16(tiny_pair, reference, mode, k):
    outs = {}
    for eager in (True, False):
        llm = make_llm(tiny_pair, mode, k, device="cuda", dtype="bfloat16", enforce_eager=eager)
        graphs = llm.engine.runner.graphs
        assert (graphs is None) == eager
        outs[eager], steps = drive(llm, reference, seed=k)
        if not eager:  # target decode graphs, drafter steps behind them, EAGLE-3's drafter decode graphs
            per_bucket = (k + 1) * (1 if mode == "none" else 2) + (mode == "eagle3")
            mixed = sum(len(s.mixed_buckets) for s in graphs.sets())
            assert graphs.num_graphs == len(graph_buckets(MAX_SEQS)) * per_bucket + mixed and mixed > 0
            assert graphs.target.num_replays == len(steps) and graphs.target.num_padded > 0  # every step
            if mode != "none":
                assert graphs.draft_steps.num_replays == sum(u for u, _ in steps) > 0
    assert outs[False] == outs[True]


@pytest.mark.gpu
@cuda
@torch.inference_mode()
def test_replayed_graph_equals_the_uncaptured_padded_forward_exactly(tiny_pair):
    llm = make_llm(tiny_pair, "eagle3", 3, device="cuda", dtype="bfloat16", enforce_eager=True)
    runner = llm.engine.runner
    captured, plain = GraphRunner(runner, MAX_SEQS, capture=True), GraphRunner(runner, MAX_SEQS, capture=False)
    for name, cache, q in [("target", runner.target_cache, 4), ("drafter", runner.drafter_cache, 1)]:
        cache.normal_(generator=torch.Generator(device="cuda").manual_seed(1))
        before = cache.clone()
        ids, meta = uniform_batch(runner, [5, 17, 9], q)
        ids, meta = ids.cuda(), ForwardMeta(**{f: getattr(meta, f).cuda() for f in
                                              ("positions", "query_start_loc", "seq_lens", "slot_mapping",
                                               "block_tables")})
        hidden = (torch.randn(ids.shape[0], runner.drafter.config.hidden_size, device="cuda", dtype=torch.bfloat16)
                  if name == "drafter" else None)
        want = [None if o is None else o.clone() for o in run_padded(getattr(plain, name), ids, hidden, meta)]
        want_cache = cache.clone()
        cache.copy_(before)
        for _ in range(2):  # the first call captures, the second replays
            got = run_padded(getattr(captured, name), ids, hidden, meta)
            for w, g in zip(want, got):
                assert (w is None and g is None) or torch.equal(w, g), name
            assert torch.equal(cache, want_cache), name
            cache.copy_(before)
        assert (4, 4 * q) in getattr(captured, name).graphs


@pytest.mark.gpu
@cuda
@torch.inference_mode()
@pytest.mark.parametrize("mode", ["peagle", "eagle3"])
@pytest.mark.parametrize("draft_len", [None, 2])
def test_captured_drafter_step_equals_the_uncaptured_one_exactly(tiny_pair, mode, draft_len):
    """Whole decode steps (3 requests padded to 4) with the drafter step replayed from its graph and run
    on the same static buffers uncaptured: the same drafts and the same caches, bit for bit. With 2 drafts
    (not captured up front) the graph is captured mid-run, before the step's inputs load."""
    k, state = 3, {}
    for capture in (False, True):
        runner = make_llm(tiny_pair, mode, k, device="cuda", dtype="bfloat16", enforce_eager=True).engine.runner
        runner.graphs = GraphRunner(runner, MAX_SEQS, capture=capture)
        runner.graphs.capture_all()
        for cache, seed in ((runner.target_cache, 1), (runner.drafter_cache, 2)):
            cache.normal_(generator=torch.Generator(device="cuda").manual_seed(seed))
        results = [runner.execute(decode_batch(n, k, seed=n), draft_len=draft_len) for n in (4, 3)]
        state[capture] = results, runner.target_cache.clone(), runner.drafter_cache.clone()
        assert runner.graphs.draft_steps.num_replays == 2
    assert state[True][0] == state[False][0]
    assert torch.equal(state[True][1], state[False][1]) and torch.equal(state[True][2], state[False][2])


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("mode,k", [("none", 0), ("peagle", 7), ("eagle3", 3)])
def test_triton_kernels_with_graphs_give_the_reference_greedy_tokens(mode, k):
    """The shipped pair on CUDA in fp32: Triton kernels + CUDA graphs against the PyTorch references run
    eagerly. (A trained model: greedy margins are real, not the near-ties of random weights.)"""
    from peagle_kernels.dispatch import set_triton_enabled, triton_enabled

    sp = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    prompts = ["def fibonacci(n):", "The capital of France is", "Write a short poem about the sea."]
    spec_cfg = None if mode == "none" else {"method": "eagle3", "model": f"tiny-{mode}", "num_speculative_tokens": k,
                                            "parallel_drafting": mode == "peagle"}
    outs, previous = {}, triton_enabled()
    try:
        for kernels_on in (True, False):
            set_triton_enabled(kernels_on)
            llm = LLM("tiny", speculative_config=spec_cfg, device="cuda", dtype="float32",
                      enforce_eager=not kernels_on, max_num_seqs=4, max_model_len=256)
            outs[kernels_on] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    finally:
        set_triton_enabled(previous)
    assert outs[True] == outs[False]


@pytest.mark.gpu
@cuda
def test_live_steps_compile_no_new_triton_variants_whatever_their_sizes(tiny_pair, reference):
    """Prompt chunks (mixed steps) and the verify's sampling run their Triton kernels outside the graphs, at
    sizes and buffer offsets that change step by step. A kernel specialised on those compiled a new variant in
    the middle of a run, 0.1-0.4 s each on an H200; now none compiles more than one variant
    in such a run, a sampled request at its end included."""
    from peagle_kernels.dispatch import compiled_variants
    from peagle_core.depth.policy import DepthPolicy

    class Cycle(DepthPolicy):  # every depth 0..K in turn: every draft count in mixed and decode steps
        i = 0

        def choose(self, info):
            self.i += 1
            return self.i % (info.max_k + 1)

    llm = make_llm(tiny_pair, "peagle", 7, device="cuda", dtype="bfloat16")  # every graph captured here
    llm.engine.policy = Cycle()
    before = compiled_variants()
    drive(llm, reference, seed=3)  # joins every other step: mixed steps of many sizes, batches of 1-6
    llm.generate([PROMPTS[0]], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8))  # sampled, filtered
    new = {name: n - before.get(name, 0) for name, n in compiled_variants().items() if n > before.get(name, 0)}
    assert sum(new.values()) <= 3 and all(n == 1 for n in new.values()), new
