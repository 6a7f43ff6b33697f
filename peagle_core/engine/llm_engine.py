"""The engine loop: schedule, run one step on the device, apply results, finish requests."""
from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from peagle_core.config import EngineConfig
from peagle_core.engine.block_manager import BlockManager
from peagle_core.engine.graphs import graphs_supported, make_graph_runner
from peagle_core.engine.memory import (cache_bytes_per_block, freeze_heap, kv_budget_bytes, memory_line,
                                       reclaim_dropped_engines, weight_bytes)
from peagle_core.engine.model_runner import ModelRunner, check_sampling_setup
from peagle_core.engine.logits_processors import bad_words_ids
from peagle_core.engine.output import Delta, OutputState
from peagle_core.engine.request import Request, Status
from peagle_core.engine.scheduler import Scheduler
from peagle_core.engine.tp import GraphLayout, TPError, start_tensor_parallel
from peagle_core.engine.types import SamplingParams, SpecDecodeStats
from peagle_core.loading.checkpoint import DTYPES, load_drafter, load_target
from peagle_core.loading.hub import resolve
from peagle_core.depth.policy import DepthPolicy, FixedDepth, StepInfo, StepOutcome

log = logging.getLogger("peagle.engine")


class StepError(RuntimeError):
    """A device step failed; `requests` were in it and have been finished with reason "error"."""

    def __init__(self, requests: list[Request], cause: Exception):
        super().__init__(f"engine step failed: {type(cause).__name__}: {cause}")
        self.requests = requests


@dataclass
class Update:
    """What one step did for one request."""

    req: Request
    new_token_ids: list[int]
    delta: Delta  # the text, reasoning and tool calls they add (`OutputState`)
    new_logprobs: list[dict] | None = None  # with params.logprobs: one {token_id: Logprob} per new token

    @property
    def new_text(self) -> str:
        return self.delta.text


def resolve_device_dtype(cfg: EngineConfig) -> tuple[torch.device, torch.dtype]:
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was requested but no CUDA device is available")
    name = cfg.dtype if cfg.dtype not in (None, "auto") else ("bfloat16" if device.type == "cuda" else "float32")
    return device, DTYPES[name]


def load_tokenizer(path: Path):
    if not (path / "tokenizer.json").exists():
        return None
    from peagle_core.loading.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(path)
    for skip in (True, False):  # the stream decoders' byte tables (texts; harmony), now rather than in a request
        tokenizer.token_bytes(skip)
    return tokenizer


class LLMEngine:
    def __init__(self, cfg: EngineConfig, policy: DepthPolicy | None = None):
        self.config = cfg
        self.device, self.dtype = resolve_device_dtype(cfg)
        if self.device.type == "cuda":
            reclaim_dropped_engines()
        torch.manual_seed(cfg.seed)
        path = resolve(cfg.model, cfg.revision, cfg.download_dir)
        self.tokenizer = load_tokenizer(resolve(cfg.tokenizer, cfg.tokenizer_revision or cfg.revision, cfg.download_dir)
                                        if cfg.tokenizer else path)
        # TP=N: ranks 1..N-1 start loading their shards now; TP=1: a stand-in that does nothing.
        self.tp = start_tensor_parallel(cfg, path, self.device, self.dtype)
        try:
            self._build(cfg, path, policy)
        except BaseException:
            self.tp.shutdown()
            raise
        freeze_heap()  # after the step-grid profile: what serving allocates is all the collector walks from here

    def _build(self, cfg: EngineConfig, path: Path, policy: DepthPolicy | None) -> None:
        self.target = load_target(path, self.dtype, self.device, self.tp.world_size, self.tp.shard, cfg.quantization)
        self.tp.apply(self.target)  # all-reduces in the layers; each forward announced to the workers
        tcfg = self.target.config
        self.mode, self.K = cfg.spec_mode, cfg.num_spec_tokens
        self.drafter = None
        if self.mode != "none":
            self.drafter = load_drafter(resolve(cfg.speculative_config.model, cfg.speculative_config.revision,
                                                cfg.download_dir), self.target, self.dtype, self.device,
                                        target_path=path)
            if self.mode == "peagle" and self.drafter.mask_hidden is None:
                raise ValueError(f"drafter {cfg.speculative_config.model!r} has no mask token / mask_hidden: it cannot "
                                 "draft in parallel; use parallel_drafting=false (EAGLE-3)")
        self.max_model_len = cfg.max_model_len or min(tcfg.max_position_embeddings, 8192)
        if self.max_model_len > tcfg.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {tcfg.max_position_embeddings}")
        self.stop_ids = set(self.tokenizer.stop_token_ids if self.tokenizer else tcfg.eos_token_id)
        budget = cfg.max_num_batched_tokens or max(512, min(8192, self.max_model_len))
        # CUDA graphs for every step up to the token budget (eager on CPU, without Triton or with enforce_eager);
        # tensor-parallel workers build the target's graphs of the same layout
        layout = GraphLayout(cfg.max_num_seqs, self.K, budget, graphs_supported(self.device, cfg.enforce_eager))
        per_block = self._cache_bytes_per_block()
        num_blocks, self.memory_per_rank = self.tp.agree_num_blocks(  # the smallest rank's number of blocks
            self._num_blocks(per_block), self.max_model_len, layout, weight_bytes(self.target, self.drafter), per_block)
        log.info(memory_line(self.memory_per_rank))
        if num_blocks * cfg.block_size < self.max_model_len:
            raise ValueError(f"the KV cache ({num_blocks} blocks of {cfg.block_size}) cannot hold one sequence of "
                             f"max_model_len={self.max_model_len}; lower max_model_len or give the cache more memory")
        self.runner = ModelRunner(self.target, self.drafter, self.mode, self.K, cfg.block_size, num_blocks,
                                  self.max_model_len, self.device, self.dtype, tcfg.vocab_size)
        self.runner.stop_ids = self.stop_ids  # min_tokens holds these back
        # A depth that varies (every policy but fixed) may draft any n <= K: capture those drafter steps too
        varies = self.mode != "none" and (cfg.speculative_config.policy != "fixed" if policy is None
                                          else not isinstance(policy, FixedDepth))
        self.runner.graphs = make_graph_runner(self.runner, cfg.max_num_seqs, cfg.enforce_eager, budget,
                                               range(1, self.K + 1) if varies else None, self.tp.mirror)
        self.runner.warm_up_sampling()  # what runs outside the graphs compiles now, not in a request's step
        self.blocks = BlockManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, budget, self.max_model_len, max(self.K - 1, 0))
        self.policy = policy or self._default_policy()
        self.requests: dict[str, Request] = {}
        self.stats = SpecDecodeStats()
        self.last_k, self.num_steps = self.K, 0
        self.execute_seconds = 0.0  # inside `runner.execute`, over all steps: the rest of a loop's time is the host's

    def _default_policy(self) -> DepthPolicy:
        spec = self.config.speculative_config
        if self.mode == "none" or spec.policy == "fixed":
            return FixedDepth(self.K)
        if spec.policy != "adaptive":  # vLLM's batch-size table or SGLang-like EMA tiers
            from peagle_core.depth.baselines import from_config

            return from_config(spec)
        from peagle_core.depth.adaptive import AdaptiveDepth, StepTimeModel
        from peagle_core.engine.profile import profile, profile_step_grid

        try:  # whole verify steps per batch bucket and k (nothing is in the KV cache yet)
            times = profile_step_grid(self.runner, self.config.max_num_seqs, self.K)
        except ValueError:  # a KV cache too small for the grid's synthetic requests: the token-count profile
            points, draft = profile(self.runner, self.config.max_num_seqs * (self.K + 1))
            times = StepTimeModel(points, draft_pass=draft, per_k_draft=self.mode == "eagle3")
        return AdaptiveDepth(self.K, times, k_min=spec.min_num_speculative_tokens, flat_draft=self.mode == "peagle")

    def _cache_bytes_per_block(self) -> int:
        per_block = cache_bytes_per_block(self.target, self.config.block_size, self.dtype)
        if self.drafter is not None:
            per_block += cache_bytes_per_block(self.drafter, self.config.block_size, self.dtype)
        return per_block

    def _num_blocks(self, per_block: int) -> int:
        cfg = self.config
        if cfg.num_gpu_blocks:
            return cfg.num_gpu_blocks
        useful = cfg.max_num_seqs * -(-(self.max_model_len + self.K) // cfg.block_size) + 1
        n = min(useful, int(kv_budget_bytes(cfg, self.device) // per_block))
        if n < 1:
            raise ValueError("not enough memory for a single KV-cache block; lower max_model_len or raise the KV budget")
        return n

    # ------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    chat_prefix: str | None = None) -> Request:
        """Queue a request; ValueError before any work where it cannot run (see `make_request`)."""
        return self.submit(self.make_request(request_id, prompt, params, chat_prefix))

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     chat_prefix: str | None = None) -> Request:
        """Tokenize, and check what only the engine knows (vocabulary, context, cache), without touching engine
        state (safe from another thread). Request values themselves are checked where requests come in
        (`SamplingParams`, the server's request models). `chat_prefix`: a harmony chat reply (`OutputState`)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if params.n != 1:
            raise ValueError("one engine request is one sample: n > 1 is LLM.generate's (or the server's) to fan out")
        vocab = self.target.config.vocab_size
        generator = self._sampling_setup(params, vocab)
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer.json: pass the prompt as token ids")
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        self._check_token_ids(params, vocab)
        if params.bad_words and self.tokenizer is None:
            raise _invalid("bad_words needs the model's tokenizer.json", "bad_words")
        if len(ids) >= self.max_model_len:
            err = _invalid(f"This model's maximum context length is {self.max_model_len} tokens (max_model_len); "
                           f"the prompt has {len(ids)} tokens (at least one token must be left to generate).", "prompt")
            err.code = "context_length_exceeded"
            raise err
        if self.blocks.blocks_needed([], len(ids) + self.K) > self.blocks.num_blocks:
            raise ValueError(f"the prompt needs more KV-cache blocks than the engine has ({self.blocks.num_blocks})")
        limit = self.max_model_len - len(ids)
        if params.max_tokens is None or params.max_tokens > limit:
            params = SamplingParams(**{**params.__dict__, "max_tokens": limit})
        req = Request(request_id, ids, params, prompt=text)
        req.generator = generator
        req.bad_words_ids = bad_words_ids(self.tokenizer, params.bad_words)
        req.output = OutputState(self.tokenizer, params, chat_prefix)
        return req

    @staticmethod
    def _check_token_ids(params: SamplingParams, vocab: int) -> None:
        """Token ids a step indexes logits with (logit_bias, allowed_token_ids, and stop_token_ids while min_tokens
        holds them back):
        one out of the vocabulary would fail the whole step, so it refuses this request alone."""
        for name, ids in (("logit_bias", params.logit_bias or ()), ("stop_token_ids", params.stop_token_ids),
                          ("allowed_token_ids", params.allowed_token_ids or ())):
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
                raise _invalid(f"{name} token ids must be integers in [0, {vocab})", name)

    def _sampling_setup(self, params: SamplingParams, vocab: int) -> torch.Generator | None:
        """Check the request's sampling values as a step will use them, and seed its generator: a ValueError
        (naming the field in `.param`) here refuses this request alone."""
        try:
            check_sampling_setup(params)
            if params.top_k > vocab:
                raise ValueError(f"top_k must be at most the vocabulary size {vocab}, got {params.top_k}")
            return None if params.seed is None else torch.Generator(device=self.device).manual_seed(params.seed)
        except (ValueError, OverflowError, RuntimeError, TypeError) as e:
            err = ValueError(str(e) if isinstance(e, ValueError) else f"invalid sampling parameters: {e}")
            err.param = next((f for f in ("top_k", "top_p", "temperature", "seed", "max_tokens") if f in str(e)), None)
            raise err from None

    def submit(self, req: Request) -> Request:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        if req.output is None:  # a Request built by hand (profiles, tests)
            req.output = OutputState(self.tokenizer, req.params)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is not None and not req.finished:
            self.scheduler.finish(req, "abort")
        return req

    def has_work(self) -> bool:
        self.tp.check_alive()  # TPError once a tensor-parallel worker is gone: the engine is dead, not idle
        return self.scheduler.has_work()

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do at TP=1), and let the collector see this engine again."""
        self.tp.shutdown()
        gc.unfreeze()

    def step(self) -> list[Update]:
        # decoding requests: with no drafts after a step that drafted none, they verify nothing (k = 0) but the
        # choice still decides whether this step drafts for the next
        running = [r for r in self.scheduler.running if r.num_uncomputed == 1 and r.num_output]
        # The choice is also the depth this step drafts for the next (`draft_depth`: at least it); it can verify
        # only what the last step drafted (one k for every request keeps the step a graph's uniform decode)
        drafts = min((len(r.drafts) for r in running), default=self.K)
        # the requests wanting a step and the budget they share (a deep k can crowd prompts out of it)
        sched = self.scheduler
        wanting = min(len(sched.running) + len(sched.waiting), sched.max_num_seqs)
        # prompt tokens waiting: none when every request wanting a step verifies (the walk over the requests would
        # otherwise cost every policy's every step)
        backlog = None if self.mode == "none" else sched.prompt_backlog() if wanting > len(running) else 0
        info = StepInfo(num_verify=len(running), num_prefill_tokens=0, max_k=self.K, drafts=drafts,
                        num_requests=wanting, token_budget=sched.budget, prompt_backlog=backlog)
        want = self.policy.choose(info) if self.mode != "none" else 0
        k, draft = min(want, info.verifiable), self.policy.draft_depth(want)
        batch = self.scheduler.schedule(k)
        if not batch:
            return []
        graphs = self.runner.graphs
        num_graphs = graphs.num_graphs if graphs is not None else 0
        t0 = time.perf_counter()
        try:
            result = self.runner.execute(batch, draft_len=draft)  # drafting the depth the policy wants next
        except Exception as e:
            # A request whose own sampling values cannot be set up fails alone: nothing was computed for the
            # others that a step cannot redo, and the next step schedules them again. Any other failure touched
            # the whole batch: end exactly those requests, keep the engine.
            failed = [] if isinstance(e, TPError) else [s for s in batch if _setup_fails(s.req.params)]
            for s in failed or batch:
                self.scheduler.finish(s.req, "error")
                self.requests.pop(s.req.request_id, None)
            if isinstance(e, TPError):
                raise  # the ranks are out of step for good: fatal for the engine, not just this batch
            raise StepError([s.req for s in failed or batch], e) from e
        step_time = time.perf_counter() - t0
        self.execute_seconds += step_time
        self.last_k, self.num_steps = k, self.num_steps + 1
        now = time.monotonic()
        updates, accepted = [], []
        lps = result.logprobs or [None] * len(batch)
        for s, toks, acc, drafts, lp in zip(batch, result.tokens, result.num_accepted, result.drafts, lps):
            req = s.req
            if not s.samples:
                req.num_computed += s.num_new
                continue
            req.num_computed += s.num_new + acc
            req.num_steps += 1
            req.drafts = drafts
            if s.num_drafts:
                req.stats.observe(s.num_drafts, acc)
                self.stats.observe(s.num_drafts, acc)
                accepted.append((s.num_drafts, acc))
            req.first_token_time = req.first_token_time or now
            new = self._append(req, toks)
            if lp is not None:
                lp = lp[:len(new)]  # a stop token or the length limit may have cut the step's tokens
                if req.logprobs is None:
                    req.logprobs = []
                req.logprobs.extend(lp)
            delta = req.output.update(req)
            if req.output.stopped and not req.finished:
                self.scheduler.finish(req, "stop")
            updates.append(Update(req, new, delta, lp))
        for s in batch:  # the blocks this step made final become cacheable (finishing ones did in `finish`)
            if not s.req.finished:
                self.blocks.commit(s.req)
        # a step that captured a graph (a shape first met) timed the capture, not the step
        timed = graphs is None or graphs.num_graphs == num_graphs
        self.policy.observe(info, StepOutcome(k, accepted, step_time, sum(s.num_tokens for s in batch), timed,
                                              drafted=draft))
        for u in updates:
            if u.req.finished:
                self.requests.pop(u.req.request_id, None)
        return updates

    def _append(self, req: Request, toks: list[int]) -> list[int]:
        """Append emitted tokens one by one, stopping at a stop token or a length limit."""
        new = []
        for t in toks:
            req.token_ids.append(t)
            new.append(t)
            if t in req.params.stop_token_ids or (t in self.stop_ids and not req.params.ignore_eos):
                self.scheduler.finish(req, "stop")
            elif req.num_output >= req.params.max_tokens or len(req.token_ids) >= self.max_model_len:
                self.scheduler.finish(req, "length")
            if req.finished:
                break
        return new

    def engine_stats(self) -> dict:
        s = self.stats
        return {
            "num_running": len(self.scheduler.running), "num_waiting": len(self.scheduler.waiting),
            "kv_blocks_used": self.blocks.num_used, "kv_blocks_total": self.blocks.num_blocks,
            "num_preemptions": self.scheduler.num_preemptions, "steps": self.num_steps,
            "prefix_cache_queries": self.scheduler.prefix_queries, "prefix_cache_hits": self.scheduler.prefix_hits,
            "kv_blocks_cached": self.blocks.num_cached, "prefix_cache_evictions": self.blocks.num_evictions,
            "speculation_depth": self.last_k, "speculation_mode": self.mode, "policy": self.policy.describe(),
            "tensor_parallel": self.tp.describe(),
            "spec": {"num_drafts": s.num_drafts, "num_draft_tokens": s.num_draft_tokens,
                     "num_accepted_tokens": s.num_accepted_tokens,
                     "num_accepted_tokens_per_pos": list(s.num_accepted_tokens_per_pos),
                     "acceptance_length": s.acceptance_length},
        }


def _invalid(message: str, param: str) -> ValueError:
    err = ValueError(message)
    err.param = param
    return err


def _setup_fails(params: SamplingParams) -> bool:
    try:
        check_sampling_setup(params)
        return False
    except Exception:
        return True
