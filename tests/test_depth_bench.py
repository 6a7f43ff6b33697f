"""The adaptive-depth benchmarks: acceptance recording and (benchmark-only) replay, the engine sweep on
a tiny grid, and the simulation."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from peagle_core import LLM, SamplingParams
from peagle_core.depth.policy import FixedDepth

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import adaptive_sim  # noqa: E402
import adaptive_sweep as S  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)


def _llm(tiny_pair, k=3, mode="peagle"):
    return LLM(tiny_pair["target"], device="cpu", max_num_seqs=4, speculative_config={
        "method": "eagle3", "model": tiny_pair[mode], "num_speculative_tokens": k,
        "parallel_drafting": mode == "peagle"})


@pytest.mark.parametrize("mode", ["peagle", "eagle3"])
def test_replay_forces_the_recorded_runs(tiny_pair, mode):
    runs = [[3, 0, 2, 1, 3, 3, 0], [1, 1, 0, 2]]
    trace = S.Trace(3, [{"id": f"t{i}", "steps": [[3, L] for L in r]} for i, r in enumerate(runs)])
    llm = _llm(tiny_pair, 3, mode)
    eng = llm.engine
    replay = S.AcceptanceReplay(trace, 3).install(eng.runner)
    seen = S.AcceptanceRecorder().install(eng.runner)  # outside the replay: sees what the engine gets
    from peagle_core.depth.policy import DepthPolicy

    class TwoThree(DepthPolicy):  # k alternates 3, 2: the replay must cap the run at k
        n = 0

        def choose(self, info):
            self.n += 1
            return 3 if self.n % 2 else 2
    eng.policy = TwoThree()
    reqs = [eng.add_request(f"q{i}", p, GREEDY) for i, p in enumerate([[1, 2, 3, 4], list(range(30, 42))])]
    while eng.has_work():
        eng.step()
    for i, r in enumerate(reqs):
        got = seen.steps[r.request_id]
        want = [min(runs[i][j % len(runs[i])], d) for j, (d, _) in enumerate(got)]
        assert [a for _, a in got] == want  # cycled through its trace, capped at the verified depth
        assert {d for d, _ in got} <= {1, 2, 3} and len(r.output_ids) == 20
    assert replay.forced == sum(len(v) for v in seen.steps.values())
    assert eng.stats.num_accepted_tokens == sum(a for v in seen.steps.values() for _, a in v)
    with pytest.raises(ValueError, match="recorded at depth 3"):
        S.AcceptanceReplay(trace, 5)


def test_recorder_keeps_every_verify_step_and_round_trips(tiny_pair, tmp_path):
    prompts = {"a": [[1, 2, 3, 4, 5], list(range(10, 30))], "b": [[9, 8, 7]]}
    tr = S.record_trace(prompts, "peagle", 3, 16, target=tiny_pair["target"], drafter=tiny_pair["peagle"])
    assert [r["id"] for r in tr.requests] == ["a-0", "a-1", "b-0"]
    # The same prompts at K=3 without a recorder: the trace is their acceptance, step by step.
    ref = _llm(tiny_pair, 3)
    outs = ref.generate(prompts["a"] + prompts["b"], SamplingParams(temperature=0.0, max_tokens=16))
    for r, o in zip(tr.requests, outs):
        st = o.spec_decode_stats
        assert len(r["steps"]) == st.num_drafts and sum(a for _, a in r["steps"]) == st.num_accepted_tokens
        assert all(0 <= a <= d <= 3 for d, a in r["steps"])
        assert r["output_tokens"] == len(o.outputs[0].token_ids)
    tr.save(tmp_path / "t.json")
    back = S.Trace.load(tmp_path / "t.json")
    assert back.requests == tr.requests and back.K == 3
    assert back.to_json()["summary"]["acceptance_length"] == pytest.approx(tr.acceptance_length(), abs=1e-4)
    with pytest.raises(ValueError, match="not an acceptance trace"):
        (tmp_path / "x.json").write_text("{}")
        S.Trace.load(tmp_path / "x.json")


def test_synthetic_trace_has_the_asked_conditional_rates():
    tr = S.Trace.load("synthetic:0.8,0.5")
    rates = tr.conditional_rates()
    assert rates[0] == pytest.approx(0.8, abs=0.02) and rates[1] == pytest.approx(0.5, abs=0.03)
    assert tr.source["synthetic"] is True


def test_sweep_runs_a_tiny_grid_on_cpu(tiny_pair, tmp_path):
    pair = str(Path(tiny_pair["target"]).parent)
    out = tmp_path / "sweep"
    rc = S.main(["sweep", "--shape", "tiny", "--pair", pair, "--prompts", "random", "--concurrency", "1,3",
                 "--max-tokens", "6", "--waves", "2", "--policies", "none,K1,K3,adaptive,batch_table,ema_tiers",
                 "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "sweep.json").read_text())
    cells = {(c["policy"], c["concurrency"]): c for c in res["cells"]}
    assert set(cells) == {(p, c) for p in ("none", "K1", "K3", "adaptive", "batch_table", "ema_tiers") for c in (1, 3)}
    for c in cells.values():
        assert c["throughput_tok_s"] > 0 and c["tpot_ms_mean"] > 0 and c["requests"] == 2 * c["concurrency"]
    assert cells[("K3", 1)]["mean_k"] == 3 and cells[("none", 3)]["mean_k"] == 0
    assert res["batch_table"][0][0] == 1 and all(e[2] in (1, 3) for e in res["batch_table"])
    md = (out / "sweep.md").read_text()
    assert "| concurrency | none | K1 | K3 | adaptive | batch_table | ema_tiers |" in md
    assert (out / "sweep.png").stat().st_size > 1000


def test_sweep_runs_the_level_only_adaptive_policy_beside_the_new_one(tmp_path):
    """`adaptive_level` (benchmark only): the adaptive engine with its grid's shape learning and exploration off,
    for before/after cells in one sweep; adaptive cells record their grid as profiled and as learnt."""
    out = tmp_path / "level"
    rc = S.main(["sweep", "--shape", "random-tiny", "--replay", "synthetic:0.9", "--concurrency", "2",
                 "--max-tokens", "10", "--waves", "2", "--prompt-len", "8",
                 "--policies", "K1,K3,adaptive,adaptive_level", "--out", str(out)])
    assert rc == 0
    cells = {c["policy"]: c for c in json.loads((out / "sweep.json").read_text())["cells"]}
    assert cells["adaptive_level"]["explored_share"] == 0.0
    for name in ("adaptive", "adaptive_level"):
        grid = cells[name]["step_grid"]
        assert grid["batch_sizes"] == [1, 2] and len(grid["profiled_ms"][0]) == len(grid["learnt_ms"][0]) == 4  # K = 3
    assert "adaptive_level / best" in (out / "sweep.md").read_text()


def test_rounds_are_interleaved_and_combined_by_median(tmp_path, capsys):
    """--rounds 3: every policy runs once per round (policies interleaved, not one after the other) and each
    cell reports the median of its rounds with every round's throughput kept."""
    out = tmp_path / "rounds"
    rc = S.main(["sweep", "--shape", "random-tiny", "--replay", "synthetic:0.9", "--concurrency", "2",
                 "--max-tokens", "6", "--waves", "1", "--prompt-len", "8", "--policies", "K1,K3", "--rounds", "3",
                 "--out", str(out)])
    assert rc == 0
    lines = capsys.readouterr().err.splitlines()
    built = [line.split(":")[0].split()[-1] for line in lines if "engine built" in line]
    assert built == ["K1", "K3"] * 3
    res = json.loads((out / "sweep.json").read_text())
    assert len(res["cells_by_round"]) == 6 and {c["round"] for c in res["cells_by_round"]} == {0, 1, 2}
    for cell in res["cells"]:
        runs = cell["throughput_by_round"]
        assert cell["rounds"] == 3 and len(runs) == 3 and cell["throughput_tok_s"] == sorted(runs)[1]
    assert "Spread of the 3 rounds" in (out / "sweep.md").read_text()


def test_shared_engine_rounds_build_one_engine_a_round_and_pair_the_ratios(tmp_path, capsys):
    """--shared-engine: each round builds one depth-K engine and swaps every policy into it (a fixed k drafts k
    on it), and the report pairs adaptive with the best fixed K round by round."""
    out = tmp_path / "shared"
    rc = S.main(["sweep", "--shape", "random-tiny", "--replay", "synthetic:0.9", "--concurrency", "2,1",
                 "--max-tokens", "6", "--waves", "1", "--prompt-len", "8", "--policies", "K1,K3,adaptive",
                 "--rounds", "2", "--shared-engine", "--out", str(out)])
    assert rc == 0
    err = capsys.readouterr().err.splitlines()
    builds = [line for line in err if "engine built" in line]
    assert len(builds) == 12 and sum(" 0.0s " not in line for line in builds) <= 2  # one real build a round
    # level by level, the policies' order rotated each round
    ran = [tuple(line.split()[1:3]) for line in err if line.startswith("[sweep]") and " C=" in line]
    assert ran == [(p, f"C={c}") for turn in (["K1", "K3", "adaptive"], ["K3", "adaptive", "K1"])
                   for c in (2, 1) for p in turn]
    res = json.loads((out / "sweep.json").read_text())
    assert res["shared_engine"] is True
    rounds = {(c["policy"], c["round"]): c for c in res["cells_by_round"] if c["concurrency"] == 2}
    assert all(c["K"] == 3 for c in rounds.values())  # every policy on the depth-3 engine
    assert rounds[("K1", 0)]["mean_k"] == 1 and rounds[("K3", 1)]["mean_k"] == 3
    md = (out / "sweep.md").read_text()
    paired = md.split("Paired by round", 1)[1]
    row = next(line for line in paired.splitlines() if line.startswith("| 2 |"))
    best = next(b for b in S.bar_rows(res["cells"], res["fixed"], [2]))["best_fixed"]
    ratios = sorted(rounds[("adaptive", r)]["throughput_tok_s"] / rounds[(best, r)]["throughput_tok_s"] for r in (0, 1))
    assert f"{(ratios[0] + ratios[1]) / 2:.3f}" in row and f"{ratios[0]:.2f} {ratios[1]:.2f}" in row
    rc = S.main(["sweep", "--shape", "random-tiny", "--replay", "synthetic:0.9", "--concurrency", "2",
                 "--max-tokens", "4", "--waves", "1", "--prompt-len", "8", "--policies", "K1,ema_tiers",
                 "--shared-engine", "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert rc != 0 and "not ema_tiers" in err and "engine built" not in err  # refused before any work


def test_combine_rounds_takes_medians_and_keeps_single_cells():
    cells = [{"policy": "K1", "concurrency": 4, "round": r, "status": "ok", "throughput_tok_s": t, "mean_k": 1.0}
             for r, t in enumerate([30.0, 10.0, 20.0])] + [{"policy": "K3", "concurrency": 4, "status": "ok",
                                                           "throughput_tok_s": 5.0, "mean_k": 3.0}]
    for c, ms in zip(cells, [{"1": 8.0}, {"1": 6.0, "2": 9.0}, {"1": 7.0}]):
        c["decode_step_ms_at_k"] = ms
    combined = {c["policy"]: c for c in S.combine_rounds(cells)}
    assert combined["K1"]["throughput_tok_s"] == 20.0 and combined["K1"]["throughput_by_round"] == [30.0, 10.0, 20.0]
    assert combined["K1"]["decode_step_ms_at_k"] == {"1": 7.0, "2": 9.0}  # per k, over the rounds that ran it
    assert combined["K3"]["rounds"] == 1 and combined["K3"]["throughput_tok_s"] == 5.0


def test_the_bar_is_printed_pass_or_fail_per_concurrency():
    """`gpu_run.sh adaptive` prints these lines: at each level adaptive must reach 0.97 x the best fixed K and beat
    K7 where K7 is not best; one failing level (or one without cells) fails the whole bar."""
    def cells(level: dict[int, dict[str, float]]) -> list[dict]:
        return [{"policy": p, "concurrency": C, "status": "ok", "throughput_tok_s": v}
                for C, row in level.items() for p, v in row.items()]

    ok = {1: {"K3": 80.0, "K7": 100.0, "adaptive": 98.0}, 64: {"K3": 100.0, "K7": 80.0, "adaptive": 99.0}}
    lines = S.bar_verdict({"cells": cells(ok), "fixed": [3, 7], "concurrency": [1, 64]})
    assert [line.split()[1] for line in lines[:2]] == ["1", "64"]
    assert all(line.endswith("pass") for line in lines[:2]) and lines[-1].endswith(": MET")
    assert "(K3), 1.238 x K7" in lines[1]  # K7 is not best at 64: the ratio over it is shown
    slow = {**ok, 1: {**ok[1], "adaptive": 96.0}}  # 0.96 x K7
    lines = S.bar_verdict({"cells": cells(slow), "fixed": [3, 7], "concurrency": [1, 64]})
    assert lines[0].endswith("FAIL") and lines[1].endswith("pass") and lines[-1].endswith("NOT MET")
    lines = S.bar_verdict({"cells": cells(ok), "fixed": [3, 7], "concurrency": [1, 8, 64]})
    assert "NOT MET" in lines[-1] and "[8]" in lines[-1]  # a level the sweep did not reach is not a pass


def test_sweep_replays_acceptance_on_random_weights(tmp_path):
    """The 20B code path at the tiny shape: random weights built on the device, acceptance replayed."""
    out = tmp_path / "replay"
    rc = S.main(["sweep", "--shape", "random-tiny", "--replay", "synthetic:0.9", "--concurrency", "2",
                 "--max-tokens", "10", "--waves", "2", "--prompt-len", "8", "--policies", "K1,K3",
                 "--prewarm-policy", "K3", "--out", str(out)])  # an unmeasured pass first: no cell of its own
    assert rc == 0
    cells = {c["policy"]: c for c in json.loads((out / "sweep.json").read_text())["cells"]}
    assert sorted(cells) == ["K1", "K3"] and all(c["replayed_verify_steps"] > 0 for c in cells.values())
    # random weights accept ~nothing; the replayed a = 0.9 gives 1 + 0.9 (+ 0.81 + 0.73 at K = 3)
    assert cells["K1"]["acceptance_length"] == pytest.approx(1.9, abs=0.2)
    assert cells["K3"]["acceptance_length"] > 2.8
    # each engine's pure decode steps timed at the k it verified (K3 drops below 3 near a request's last tokens)
    assert set(cells["K1"]["decode_step_ms_at_k"]) == {"1"} and "3" in cells["K3"]["decode_step_ms_at_k"]
    assert cells["K1"]["decode_drafts_at_k"] == {"1": 1.0}  # a fixed-depth engine drafts its K every step
    assert all(ms > 0 for c in cells.values() for ms in c["decode_step_ms_at_k"].values())
    assert all(c["other_steps"] > 0 and c["other_step_ms"] > 0 for c in cells.values())  # the joins' prompt chunks
    # the loop's time outside the device steps: some, and less than the steps themselves take
    for c in cells.values():
        assert 0 < c["host_ms_per_step"] < 1e3 * c["wall_s"] / c["steps"] - c["host_ms_per_step"]
    assert S.main(["sweep", "--shape", "random-tiny", "--out", str(tmp_path / "x")]) == 2  # no --replay: refused


def test_simulation_prefers_depth_at_low_load_and_tracks_the_best_fixed_k(tmp_path):
    # Verification nearly free at batch 1, costly at 64: the best fixed K falls with concurrency.
    steps = {"format": S.STEPS_FORMAT, "K": 7, "device": "synthetic", "seconds": {
        str(b): [0.010 + 0.00002 * b * (1 + k) ** 1.0 * (b / 8) for k in range(8)] for b in (1, 8, 64)}}
    (tmp_path / "steps.json").write_text(json.dumps(steps))
    out = tmp_path / "sim"
    rc = adaptive_sim.main(["--steps", str(tmp_path / "steps.json"), "--trace", "synthetic:0.8", "--concurrency",
                            "1,8,64", "--max-tokens", "48", "--waves", "4", "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "adaptive_sim.json").read_text())
    assert res["kind"] == "simulation"
    by = {(c["policy"], c["concurrency"]): c for c in res["cells"]}
    assert by[("adaptive", 1)]["mean_k"] > by[("adaptive", 64)]["mean_k"]
    best = {C: max(by[(f"K{k}", C)]["throughput_tok_s"] for k in (1, 3, 5, 7)) for C in (1, 8, 64)}
    assert max(by[(f"K{k}", 1)]["throughput_tok_s"] for k in (1, 3)) < best[1]  # deep wins at low load
    for C in (1, 8, 64):
        assert by[("adaptive", C)]["throughput_tok_s"] >= 0.9 * best[C], C
    assert "SIMULATION" in (out / "adaptive_sim.md").read_text()


def test_step_table_is_measured_and_feeds_the_simulation(tiny_pair, tmp_path):
    pair = str(Path(tiny_pair["target"]).parent)
    table = tmp_path / "steps.json"
    assert S.main(["steps", "--shape", "tiny", "--pair", pair, "--batch-sizes", "1,2", "--k", "2", "--context", "8",
                   "--warmup", "0", "--iters", "1", "--out", str(table)]) == 0
    d = json.loads(table.read_text())
    assert d["format"] == S.STEPS_FORMAT and d["K"] == 2
    assert all(len(row) == 3 and all(t > 0 for t in row) for row in d["seconds"].values())
    assert d["seconds_fixed"]["1"][0] is None and len(d["seconds_fixed"]["2"]) == 3 and d["seconds_none"]["2"] > 0
    out = tmp_path / "sim"
    assert adaptive_sim.main(["--steps", str(table), "--trace", "synthetic:0.5", "--concurrency", "1,2",
                              "--policies", "none,K1,K2,adaptive,K1@2", "--max-tokens", "8", "--waves", "2",
                              "--out", str(out)]) == 0
    cells = json.loads((out / "adaptive_sim.json").read_text())["cells"]
    assert {(c["policy"], c["concurrency"]) for c in cells} == {(p, C) for p in ("none", "K1", "K2", "adaptive", "K1@2")
                                                               for C in (1, 2)}
    assert adaptive_sim.main(["--steps", str(table), "--trace", "synthetic:0.5", "--policies", "K3",
                              "--out", str(out)]) == 2  # deeper than the table: a clear error, not a traceback


def test_simulation_replays_a_measured_sweeps_step_times(tmp_path):
    """A measured sweep's JSON as the step-time source: its fixed-K cells' mean step times (wall / steps, the
    median over rounds) give T(C, k), linear in k between the measured depths; the adaptive policies can start
    from a grid that under-charges depth, and `adaptive_level` (the policy before the shape correction) runs
    beside `adaptive`."""
    cells = []
    for C, base in ((1, 4e-3), (4, 8e-3)):
        for K, per_k in ((1, 0.0), (3, 1e-3)):
            for rnd, slow in enumerate((1.0, 1.0, 3.0)):  # one slow round: the median ignores it
                cells.append({"policy": f"K{K}", "concurrency": C, "round": rnd, "status": "ok", "steps": 100,
                              "wall_s": 100 * (base + per_k) * slow})
    sweep = {"kind": "measured", "shape": "20b", "mode": "peagle", "device": "cuda", "cells": [],
             "cells_by_round": cells}
    (tmp_path / "sweep.json").write_text(json.dumps(sweep))
    table = adaptive_sim.StepTable.load(tmp_path / "sweep.json")
    assert table.K == 3
    assert [table.time(4, k) for k in range(4)] == pytest.approx([7.5e-3, 8e-3, 8.5e-3, 9e-3])  # k = 0 extrapolated
    assert table.start_up_model(depth_scale=0.5).step(4, 3) == pytest.approx(7.5e-3 + 0.5 * 1.5e-3)
    out = tmp_path / "sim"
    assert adaptive_sim.main(["--steps", str(tmp_path / "sweep.json"), "--trace", "synthetic:0.5",
                              "--concurrency", "1,4", "--policies", "K1,K3,adaptive,adaptive_level",
                              "--start-up-depth-scale", "0.5", "--step-jitter", "0.02", "--min-requests", "8",
                              "--max-tokens", "16", "--waves", "1", "--out", str(out)]) == 0
    res = json.loads((out / "adaptive_sim.json").read_text())
    by = {(c["policy"], c["concurrency"]): c for c in res["cells"]}
    assert set(by) == {(p, C) for p in ("K1", "K3", "adaptive", "adaptive_level") for C in (1, 4)}
    assert all(by[("adaptive", C)]["requests"] == 8 for C in (1, 4))
    assert by[("adaptive_level", 4)]["explored_share"] == 0.0
    md = (out / "adaptive_sim.md").read_text()
    assert "adaptive_level / best" in md and "charges 0.5 x" in md
    with pytest.raises(ValueError, match="two depths"):
        adaptive_sim.StepTable({"kind": "measured", "cells": [c for c in cells if c["policy"] == "K1"]})


def test_a_two_round_sweeps_step_times_can_take_the_faster_round(tmp_path):
    """With two rounds the median is their mean, and one stalled round (outside the throughput window) makes
    a cell's steps look dearer; `min` takes the faster round."""
    cells = [{"policy": f"K{K}", "concurrency": 4, "round": rnd, "status": "ok", "steps": 100,
              "wall_s": 100 * (8e-3 + 1e-3 * K) * slow} for K in (1, 3) for rnd, slow in enumerate((1.0, 2.0))]
    sweep = {"kind": "measured", "cells": [], "cells_by_round": cells}
    assert adaptive_sim.StepTable(sweep).time(4, 1) == pytest.approx(1.5 * 9e-3)
    assert adaptive_sim.StepTable(sweep, "min").time(4, 1) == pytest.approx(9e-3)


GRAPHED = ROOT / "docs" / "benchmarks" / "adaptive_20b_graphed_profile.json"
TINY_TRACE = ROOT / "benchmarks" / "traces" / "tiny_peagle_k7.json"


def test_the_simulated_level_has_the_sweeps_shape_step_for_step():
    """Joins modelled as the engine schedules them (128-token prompts prefilled in chunks under the 512-token
    budget after the decoding requests, joiners verifying nothing until prefilled) and the acceptance traces
    handed out in the sweep's order: every fixed-K cell of the graphed H200 sweep takes exactly as many engine
    steps simulated as it took measured (step counts depend on scheduling and acceptance, not on step times),
    except K5 and K7 at 64 requests, 1-2% more steps simulated: that sweep's scheduler cut a request's last drafts
    to the tokens it had left, which left prompts more of the budget where it binds; the scheduler no longer
    does (a cut step ran eagerly), nor does the model. Without the joins model the counts are off."""
    sweep = json.loads(GRAPHED.read_text())
    trace = S.Trace.load(TINY_TRACE)
    table = adaptive_sim.StepTable(sweep, "min")
    conc = sweep["concurrency"]
    slots = adaptive_sim.sweep_first_slots(conc, sweep["waves"], sweep["min_requests"])
    joins = adaptive_sim.Joins(prompt_len=128, budget=512)
    old = 0
    for c in sweep["cells_by_round"]:
        f = S.fixed_policy(c["policy"])
        if c["round"] != 0 or f is None:
            continue
        K, C = f[0], c["concurrency"]
        args = (FixedDepth(K), c["policy"], table, trace, C, K, sweep["waves"], sweep["max_tokens"], 0, 0.0,
                sweep["min_requests"])
        steps = adaptive_sim.simulate(*args, joins, slots[C])["steps"]
        if C == 64 and K >= 5:
            assert c["steps"] < steps <= 1.025 * c["steps"], (c["policy"], C, steps)
        else:
            assert steps == c["steps"], (c["policy"], C)
        old += adaptive_sim.simulate(*args)["steps"] == c["steps"]
    assert old < 5


def test_a_simulated_decode_step_after_another_shape_pays_the_switch_once():
    """`--switch-s`: a decode step after a step of another shape (batch size or k) costs S more. One request
    at a fixed k keeps its shape (a finished request's successor decodes at once without the joins model), so
    only the level's first step pays; a depth that alternates pays on every step. `--explore` takes the
    exploration's fields and nothing else."""
    sweep = json.loads(GRAPHED.read_text())
    trace = S.Trace.load(TINY_TRACE)
    table = adaptive_sim.StepTable(sweep, "min")

    class Alternate(FixedDepth):
        def choose(self, info):
            self.k = 4 - self.k  # 1, 3, 1, ...
            return self.k

        def draft_depth(self, k):
            return 3  # drafting 3 every step, so a step can verify 3 after one that verified 1

    for policy, changes in ((lambda: FixedDepth(3), lambda steps: 1), (lambda: Alternate(3), lambda steps: steps)):
        plain, charged = (adaptive_sim.simulate(policy(), "K3", table, trace, 1, 3, 2, 16, 0, switch_s=s)
                          for s in (0.0, 1e-3))
        assert charged["steps"] == plain["steps"]
        assert charged["simulated_s"] - plain["simulated_s"] == pytest.approx(1e-3 * changes(plain["steps"]))
    assert adaptive_sim.parse_explore("far=0.01,near=0.1") == {"far": 0.01, "near": 0.1}
    for bad in ("farr=1", "far", "far=x", "seed=3"):  # a clear error (exit 2), not a traceback
        with pytest.raises(ValueError, match="--explore"):
            adaptive_sim.parse_explore(bad)


def test_simulation_starts_the_adaptive_policy_from_a_sweeps_recorded_grid(tmp_path):
    """`--start-up-grid`: the grid the sweep's engines profiled (median over rounds) is the adaptive policy's
    start; `--steps-from start-up-grid` also makes it the simulated steps' cost (no shape error); `--seeds`
    averages cells over seeds and keeps each seed's throughput."""
    sweep = json.loads(GRAPHED.read_text())
    grid = adaptive_sim.recorded_start_up_grid(sweep)
    rows = [c["step_grid"]["profiled_ms"] for c in sweep["cells_by_round"] if c["policy"] == "adaptive"]
    assert sorted(grid) == [1, 2, 4, 8, 16, 32, 64]
    recorded = [r[5][3] for r in rows]  # B = 32 (the sixth row), k = 3, in ms: the rounds' profiles
    assert min(recorded) <= grid[32][3] * 1e3 <= max(recorded)
    out = tmp_path / "sim"
    assert adaptive_sim.main(["--steps-from", "start-up-grid", "--start-up-grid", str(GRAPHED), "--trace",
                              str(TINY_TRACE), "--concurrency", "2,32", "--policies", "K1,K3,adaptive", "--waves", "2",
                              "--min-requests", "8", "--max-tokens", "64", "--prompt-len", "128",
                              "--sweep-trace-order", "--seeds", "2", "--out", str(out)]) == 0
    res = json.loads((out / "adaptive_sim.json").read_text())
    by = {(c["policy"], c["concurrency"]): c for c in res["cells"]}
    assert len(by[("adaptive", 32)]["throughput_by_seed"]) == 2 and by[("adaptive", 32)]["k_share"]
    assert by[("K3", 32)]["simulated_s"] > 1.0  # the recorded grid's 12-16 ms steps, about 120 of them
    md = (out / "adaptive_sim.md").read_text()
    assert "profiled at start-up" in md and "Prompts of 128 tokens" in md
    assert adaptive_sim.main(["--steps-from", "start-up-grid", "--trace", "synthetic:0.5", "--out",
                              str(out)]) == 2  # needs the sweep's grid


class _CountingEngine:
    """What `run_paired` and `run_level` drive: every in-flight request emits one token a step and finishes at its length;
    each step records the policy that ran it."""

    def __init__(self):
        self.policy = self.stats = None
        self.execute_seconds, self.ran, self.live, self.aborted, self.added = 0.0, [], {}, [], []

    def add_request(self, request_id, prompt, params):
        from types import SimpleNamespace

        req = SimpleNamespace(request_id=request_id, left=params.max_tokens, finished=False, finished_time=None,
                              first_token_time=None, output_ids=[])
        self.live[request_id] = req
        self.added.append((self.policy, tuple(prompt), params.max_tokens))
        return req

    def has_work(self):
        return bool(self.live)

    def step(self):
        from types import SimpleNamespace

        self.ran.append(self.policy)
        self.execute_seconds += 0.001
        updates = []
        for req in list(self.live.values()):
            req.left -= 1
            req.finished = req.left == 0
            if req.finished:
                del self.live[req.request_id]
            updates.append(SimpleNamespace(req=req, new_token_ids=[7]))
        return updates

    def abort(self, request_id):
        self.aborted.append(request_id)
        self.live.pop(request_id)

def test_a_level_reports_the_collectors_pauses_and_the_paired_cells_add_them_up():
    """A full collection stalls a whole step (175-212 ms on the H200 probes before the engine froze its heap): each
    level records the collector's pauses in it (their sum and the longest), and a paired cell sums its episodes'
    and keeps the longest."""
    import gc

    def collecting_engine(at_steps: set[int]) -> _CountingEngine:
        engine = _CountingEngine()
        step = engine.step
        engine.step = lambda: (gc.collect() if len(engine.ran) in at_steps else None, step())[1]
        return engine

    r = S.run_level(collecting_engine({2}), [[1]], C=2, waves=2, max_tokens=3, seed=0)
    assert r["gc_max_ms"] > 0 and r["gc_ms"] >= r["gc_max_ms"]
    # two episodes of at least 1 + 1 steps: two collections, at the first and the third step
    got = S.run_paired(collecting_engine({0, 2}), {"K1": "p1"}, [[1]], C=1, episodes=2, waves=1, max_tokens=2,
                       seed=0)
    assert got["K1"]["steps"] >= 3
    assert got["K1"]["gc_ms"] > got["K1"]["gc_max_ms"] > 0  # the sum of both, the longer one


def test_paired_episodes_give_every_policy_the_same_workload_in_a_shuffled_order():
    """Each episode is one workload (prompts and output lengths) that every policy runs from an idle engine, in an
    order drawn afresh each episode; each policy is charged its own episodes, and the episodes differ (the prompt
    list rotates), so every policy sees every prompt and the same tokens."""
    engine = _CountingEngine()
    policies = {"K1": "p1", "K3": "p3", "adaptive": "pa"}
    prompts = [[i] for i in range(10)]
    restarts: list[int] = []
    got = S.run_paired(engine, policies, prompts, C=2, episodes=6, waves=2, max_tokens=6, seed=0,
                       restart=restarts.append)
    assert restarts == [4 * e for e in range(6) for _ in policies]  # each run replays its requests' own traces
    per_episode = len(policies) * 4  # every policy, 2 x C requests each
    assert len(engine.added) == 6 * per_episode and not engine.live
    episodes = [engine.added[i:i + per_episode] for i in range(0, len(engine.added), per_episode)]
    firsts = []
    for ep in episodes:
        runs = [ep[i:i + 4] for i in range(0, per_episode, 4)]
        assert sorted(r[0][0] for r in runs) == ["p1", "p3", "pa"]  # each policy once an episode
        assert all({x[0] for x in r} == {r[0][0]} for r in runs)   # a run is one policy's alone
        assert len({tuple(x[1:] for x in r) for r in runs}) == 1    # the same prompts and lengths for each
        firsts.append(runs[0][0][0])
    assert len(set(firsts)) > 1  # the order is drawn afresh
    assert len({ep[0][1] for ep in episodes}) > 1  # and the workloads differ between episodes
    tokens = {name: got[name]["tokens"] for name in policies}
    # each request emits its length: every policy the same tokens, those of its own requests
    assert set(tokens.values()) == {sum(x[2] for ep in episodes for x in ep[:4])}
    for name in policies:
        assert got[name]["requests"] == 6 * 4 and got[name]["seconds"] > 0
        assert got[name]["host_seconds"] <= got[name]["seconds"]


def test_a_restarted_replay_gives_the_next_requests_the_same_traces_again():
    trace = S.Trace(3, [{"id": f"t{i}", "steps": [[3, i % 4], [3, 3]]} for i in range(5)])
    replay = S.AcceptanceReplay(trace, K=3)
    first = [replay.run_length(f"a{i}") for i in range(3)] + [replay.run_length("a0")]
    replay.restart(0)
    assert [replay.run_length(f"b{i}") for i in range(3)] + [replay.run_length("b0")] == first
    replay.restart(2)
    assert replay.run_length("c0") == first[2]


def test_a_paired_sweep_builds_one_engine_a_round_and_a_cell_per_policy(tmp_path, capsys):
    """--paired (episodes of one workload): one engine a round shared by the policies, one cell per policy, level and
    round, every policy of a round given the same tokens and a TPOT, and the report says how it was measured."""
    out = tmp_path / "paired"
    rc = S.main(["sweep", "--shape", "random-tiny", "--replay", "synthetic:0.9", "--concurrency", "2",
                 "--max-tokens", "8", "--prompt-len", "8", "--policies", "K1,K3,adaptive", "--rounds", "2",
                 "--paired", "2", "--waves", "2", "--warmup-steps", "3", "--out", str(out)])
    assert rc == 0
    err = capsys.readouterr().err
    assert err.count("paired engine built") == 2 and "engine built in" not in err
    res = json.loads((out / "sweep.json").read_text())
    assert res["shared_engine"] is True
    assert res["paired"] == {"episodes": 2, "waves": 2, "min_requests": 0}
    by = {(c["policy"], c["round"]): c for c in res["cells_by_round"]}
    assert set(by) == {(p, r) for p in ("K1", "K3", "adaptive") for r in (0, 1)}
    for c in by.values():
        assert c["K"] == 3 and c["throughput_tok_s"] == pytest.approx(c["output_tokens"] / c["wall_s"])
        assert c["requests"] == 2 * 2 * 2 and c["tpot_ms_mean"] > 0
    for r in (0, 1):  # the same workload for every policy of a round
        assert len({c["output_tokens"] for c in by.values() if c["round"] == r}) == 1
    assert by[("K1", 0)]["mean_k"] == 1.0
    md = (out / "sweep.md").read_text()
    assert "Paired episodes: at each level" in md and "Paired by round" in md
    rc = S.main(["sweep", "--shape", "random-tiny", "--replay", "synthetic:0.9", "--concurrency", "2",
                 "--policies", "K1,adaptive", "--paired", "2", "--resume", "--out", str(tmp_path / "bad")])
    err = capsys.readouterr().err
    assert rc != 0 and "cannot resume" in err and "engine built" not in err
