"""The adaptive depth policy picks the goodput-optimal k and never changes the output."""
import pytest

from peagle_core import LLM, SamplingParams
from peagle_core.depth.adaptive import AcceptanceEstimate, AdaptiveDepth, StepTimeModel
from peagle_core.depth.policy import StepInfo, StepOutcome


def policy(K=7, rates=None, times=None, draft=0.0, per_k=False, k_min=0):
    t = StepTimeModel(times or {1: 10e-3, 8: 10.5e-3, 64: 14e-3, 512: 60e-3}, draft_pass=draft, per_k_draft=per_k)
    p = AdaptiveDepth(K, t, k_min=k_min)
    if rates is not None:  # pin the estimate: huge evidence at the given rates
        p.acceptance.reached = [1e9] * K
        p.acceptance.accepted = [r * 1e9 for r in rates]
    return p


def test_all_rejected_chooses_zero_and_all_accepted_chooses_K():
    assert policy(rates=[0.0] * 7).choose(StepInfo(4, 0, 7)) == 0
    assert policy(rates=[1.0] * 7).choose(StepInfo(4, 0, 7)) == 7


def test_choice_is_the_argmax_of_expected_goodput():
    rates = [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    for batch in (1, 8, 32, 64):
        p = policy(rates=rates)
        k = p.choose(StepInfo(batch, 0, 7))
        brute = max(range(8), key=lambda k: p.goodput(batch, k))
        assert k == brute


def test_deeper_at_low_load_shallower_at_high_load():
    """Verification is nearly free at batch 1 and dear at batch 64: k should fall as load rises."""
    rates = [0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2]
    times = {1: 10e-3, 16: 10.5e-3, 64: 13e-3, 128: 20e-3, 256: 40e-3, 512: 80e-3}
    ks = [policy(rates=rates, times=times).choose(StepInfo(b, 0, 7)) for b in (1, 16, 64)]
    assert ks[0] >= 5 and ks[2] < ks[1] < ks[0]


def test_eagle3_draft_cost_per_token_pulls_k_down():
    rates = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    parallel = policy(rates=rates, draft=3e-3).choose(StepInfo(1, 0, 7))
    sequential = policy(rates=rates, draft=3e-3, per_k=True).choose(StepInfo(1, 0, 7))
    assert parallel >= 6 and sequential < parallel


def test_acceptance_estimate_counts_conditional_positions():
    est = AcceptanceEstimate(3, prior_weight=1e-9, decay=1.0)
    est.observe([(3, 3), (3, 1), (3, 0), (2, 2)])
    # position 1 judged 4x, passed 3x; position 2 judged 3x (all but the 0-accept), passed 2x; position 3 judged 1x
    assert est.rates() == pytest.approx([3 / 4, 2 / 3, 1.0])
    assert est.expected_tokens(2) == pytest.approx(1 + 0.75 + 0.75 * 2 / 3)


def test_forgetting_returns_to_prior_so_zero_is_not_absorbing():
    p = policy()
    for _ in range(50):
        p.observe(StepInfo(4, 0, 7), StepOutcome(7, [(7, 0)] * 4, 0.01, 32))
    assert p.choose(StepInfo(4, 0, 7)) == 0
    for _ in range(300):  # no evidence while k = 0: the estimate drifts back toward the prior
        p.observe(StepInfo(4, 0, 7), StepOutcome(0, [], 0.01, 4))
    assert p.choose(StepInfo(4, 0, 7)) > 0


def test_position_one_keeps_its_evidence_through_k_zero_steps_and_deeper_positions_do_not():
    """A k = 0 step judges nothing. Position 1's low rate must outlive a few such steps (leaving k = 0 costs a
    drafter pass and a catch-up, so a fast drift back to the prior made a settled policy probe every ~15 steps);
    a deeper position nobody reaches still drifts back to its neighbour's rate fast."""
    est = AcceptanceEstimate(3)
    for _ in range(50):
        est.observe([(3, 2)] * 4)  # positions 1, 2 always pass, 3 always fails
    for _ in range(30):
        est.observe([])  # k = 0 steps
    a1, _, a3 = est.rates()
    assert a1 > 0.9  # its evidence (~69 of ~127 judgements) still dominates the prior's 4 pseudo-observations
    assert a3 > 0.3  # 127 failures decayed to ~5 at 0.9 a step: the neighbour's rate weighs in again
    low = AcceptanceEstimate(3)
    for _ in range(50):
        low.observe([(3, 0)] * 4)
    for _ in range(30):
        low.observe([])
    assert low.rates()[0] < 0.05


def test_bounds_are_respected():
    assert policy(rates=[0.0] * 7, k_min=2).choose(StepInfo(4, 0, 7)) == 2
    with pytest.raises(ValueError):
        AdaptiveDepth(3, StepTimeModel({1: 1.0}), k_min=5)


@pytest.mark.parametrize("mode", ["peagle", "eagle3"])
def test_adaptive_engine_output_equals_plain_greedy(tiny_pair, mode):
    prompts = [[1, 2, 3, 4, 5], list(range(10, 30))]
    sp = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(tiny_pair["target"], device="cpu").generate(prompts, sp)]
    llm = LLM(tiny_pair["target"], device="cpu", speculative_config={
        "method": "eagle3", "model": tiny_pair[mode], "num_speculative_tokens": 3,
        "parallel_drafting": mode == "peagle", "adaptive": True})
    assert isinstance(llm.engine.policy, AdaptiveDepth)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, sp)] == ref
    assert "k" in llm.engine.engine_stats()["policy"]


def test_a_step_that_captured_a_graph_teaches_the_step_model_nothing(tiny_pair):
    """The engine marks a step during which a CUDA graph was captured (a shape first met): its time is the
    capture's. The adaptive policy keeps its acceptance evidence but not that time."""
    from peagle_core.depth.adaptive import StepGrid
    from peagle_core.depth.policy import FixedDepth

    grid = lambda: StepGrid({1: [1e-3, 1.2e-3], 8: [2e-3, 2.4e-3]})
    p = AdaptiveDepth(1, grid())
    info = StepInfo(1, 0, 1)
    p.choose(info)
    p.observe(info, StepOutcome(1, [(1, 1)], 0.05, 2, timed=False))  # a 50 ms capture
    assert p.times.rows == grid().rows and p.acceptance.reached[0] == 1
    p.choose(info)
    p.observe(info, StepOutcome(1, [(1, 1)], 0.05, 2))  # the same time, not a capture: learnt
    assert p.times.rows != grid().rows

    class Recorder(FixedDepth):
        def observe(self, info, outcome):
            seen.append(outcome.timed)

    class Graphs:  # what the engine reads of its graphs: how many exist (one more after the first step)
        num_graphs = 0

    seen = []
    llm = LLM(tiny_pair["target"], device="cpu", speculative_config={
        "method": "eagle3", "model": tiny_pair["peagle"], "num_speculative_tokens": 2, "parallel_drafting": True})
    engine, runner = llm.engine, llm.engine.runner
    engine.policy = Recorder(2)
    execute = runner.execute

    def capturing_once(batch, draft_len=None):
        runner.graphs = None  # the real step runs eagerly on a CPU
        try:
            return execute(batch, draft_len)
        finally:
            runner.graphs = Graphs
            Graphs.num_graphs = 1

    runner.execute = capturing_once
    runner.graphs = Graphs
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert seen[0] is False and seen[1:] and all(seen[1:])


def budget_policy(rate=0.9):
    """Steps that cost about the same whatever the batch or k (memory-bound), acceptance 0.9 a position: without
    a budget, k = 7."""
    from peagle_core.depth.adaptive import StepGrid

    grid = StepGrid({1: [9.0 + 0.05 * k for k in range(8)], 64: [10.0 + 0.2 * k for k in range(8)]})
    p = AdaptiveDepth(7, grid)
    p.acceptance.reached = [1e9] * 7
    p.acceptance.accepted = [rate * 1e9] * 7
    return p


def test_prompt_share_is_read_from_the_steps():
    p = budget_policy()
    # 4 requests verified 3 drafts and accepted 1 (8 tokens emitted); 4 x 4 decode tokens, the other 100 prompts
    p.observe(StepInfo(4, 0, 7), StepOutcome(3, [(3, 1)] * 4, 0.01, 4 * 4 + 100))
    assert p.prompts.rho == pytest.approx(100 / 8)
    p.observe(StepInfo(0, 0, 7), StepOutcome(7, [], 0.01, 50))  # a prefill-only step: prompts, nothing emitted
    assert p.prompts.rho == pytest.approx((100 * 0.9 + 50) / (8 * 0.9))
    for _ in range(60):  # no more arrivals: the prompts' share of the budget fades
        p.observe(StepInfo(4, 0, 7), StepOutcome(3, [(3, 1)] * 4, 0.01, 16))
    assert p.prompts.rho < 0.01
    assert p.describe()["prompt_tokens_per_output_token"] == p.prompts.rho


def test_a_budget_that_cannot_hold_every_request_at_depth_k_ranks_the_steady_states():
    """At 64 requests and a 512-token budget, k = 7 fills the budget with drafts and prompts wait: with rho
    prompt tokens per emitted token, a steady stream keeps N / ((1 + k) + rho E(k)) requests decoding. The
    choice is the argmax of b_k E(k) / T(b_k, k) over that; with room in the budget, or no prompts coming, the
    choice is the usual one (k = 7 here)."""
    info = lambda budget, requests=64: StepInfo(64, 0, 7, num_requests=requests, token_budget=budget)
    blind = budget_policy()
    assert blind.choose(StepInfo(64, 0, 7)) == 7 and blind.choose(info(512)) == 7  # rho = 0: 64 x 8 fits in 512
    p = budget_policy()
    p.prompts.prompt, p.prompts.output = 2.0, 1.0  # rho = 2
    E = [sum(0.9 ** i for i in range(k + 1)) for k in range(8)]
    b = [max(1, min(64, int(512 / ((1 + k) + 2 * E[k])))) for k in range(8)]
    brute = max(range(8), key=lambda k: b[k] * E[k] / p.times.step(b[k], k))
    k = p.choose(info(512))
    assert k == brute and k < 7
    assert p.describe()["sustained_batch"] == b[k] < 64
    assert p.choose(info(8192)) == 7  # a serving budget has room: the step's own batch decides
    assert p.choose(info(512, requests=16)) == 7  # 16 requests x (8 + 2 E(7)) fit in 512 too


def test_a_step_that_holds_every_waiting_prompt_token_even_at_depth_k_ranks_as_if_unbounded():
    """The steady-state bound reads the prompt share, which a burst of prompts inflates for the steps after it has
    been fed. When the step has room for the whole backlog even at depth K (N - B (1 + K) >= it), no depth keeps a
    prompt out, and the choice is the usual one; with more waiting than that room, or the backlog unknown, the
    steady states are ranked as before."""
    E = [sum(0.9 ** i for i in range(k + 1)) for k in range(8)]

    def choice(budget: int, backlog: int | None) -> int:
        p = budget_policy()
        p.prompts.prompt, p.prompts.output = 2.0, 1.0  # rho = 2: the bound binds at 64 requests for both budgets
        return p.choose(StepInfo(64, 0, 7, num_requests=64, token_budget=budget, prompt_backlog=backlog))

    p = budget_policy()
    for budget in (512, 1024):
        b = [max(1, min(64, int(budget / ((1 + k) + 2 * E[k])))) for k in range(8)]
        brute = max(range(8), key=lambda k: b[k] * E[k] / p.times.step(b[k], k))
        assert brute < 7
        room = budget - 64 * 8  # what the prompts get at k = 7: none of 512, half of 1024
        assert choice(budget, None) == brute  # unknown backlog: the bound, as before
        assert choice(budget, room + 1) == brute  # one token more than k = 7 leaves room for
        assert choice(budget, room) == 7  # all of it fits at k = 7 (nothing waits, at 512)
