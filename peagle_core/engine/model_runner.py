"""One engine step on the device: target forward, verification, drafting.

`ModelRunner.execute` owns the step, which reads like the method (DESIGN.md, "One engine step"):
  1. target forward over every request's `[uncomputed tokens, drafts[:k]]`, keeping the aux hidden states;
  2. accept/reject the drafts against the target (rejection sampling over the full logits; greedy with a split
     head, from each row's argmax alone) and pick the bonus token;
  3. rejected K/V need no work: the request's length rolls back and later writes overwrite them;
  4. drafter (`drafting.Proposer`): P-EAGLE runs ONE forward over `[accepted, bonus, MASK x (K-1)]` and reads K
     drafts; EAGLE-3 runs one forward over `[accepted, bonus]`, then K-1 single-token passes feeding itself back;
     a step asked for no drafts skips it and keeps its inputs for the next step that drafts (`_catch_up`);
  5. one device-to-host copy brings back emitted tokens and drafts for the scheduler.
"""
from __future__ import annotations

import array
from dataclasses import dataclass

import torch

from peagle_kernels.dispatch import use_triton
from peagle_kernels.sampling import greedy_verify, rejection_sample
from peagle_core.engine.drafting import Proposer
from peagle_core.engine.logits_processors import needs_processing, process_logits
from peagle_core.engine.logprobs import emitted_logprobs, host_logprobs
from peagle_core.engine.graphs import GraphRunner, HostForward, is_uniform_decode
from peagle_core.engine.memory import bind_kv_cache
from peagle_core.engine.scheduler import Scheduled
from peagle_core.engine.types import SamplingParams
from peagle_core.engine.uploads import Uploader
from peagle_core.models.drafter import Drafter
from peagle_core.models.gpt_oss import GptOss
from peagle_core.models.layers import ForwardMeta, pack_qkv


def host_slots(block_table: list[int], start: int, end: int, block_size: int, max_model_len: int) -> list[int]:
    """`drafting.cache_slots` on the host for positions start..end-1 of one request: one contiguous run per
    block (a prefill chunk costs a Python step per block, not per token); -1 past max_model_len."""
    out, p, stop = [], start, min(end, max_model_len)
    while p < stop:
        block, offset = divmod(p, block_size)
        n = min(block_size - offset, stop - p)
        first = block_table[block] * block_size + offset
        out += range(first, first + n)
        p += n
    return out + [-1] * (end - max(stop, start))


@dataclass
class HostStep:
    """One step's metadata on the host (`ModelRunner._host_inputs`)."""
    forward: HostForward           # the target forward's inputs
    num_drafts: list[int]          # [B] drafts verified per request
    next_ids: list[int]            # [B] next prompt token of requests still in their prompt (0 if sampling)
    rows: list[int]                # [N] hidden rows to verify: the last 1 + k of each sampling request
    draft_ids: list[int]           # [N] the draft each row judges (-1 on a request's last row)
    cu: list[int]                  # [S+1] rows of sampling request j: cu[j] .. cu[j+1]-1
    sampling: list[int]            # [S] batch index of each sampling request
    params: list[SamplingParams]   # [S]


@dataclass
class StepInputs:
    """A step's verification inputs on the device (`ModelRunner._upload`), with the host lists it still reads."""
    num_drafts: torch.Tensor       # [B]
    next_ids: torch.Tensor         # [B]
    rows: torch.Tensor             # [N]
    draft_ids: torch.Tensor        # [N]
    cu: torch.Tensor               # [S+1]
    sampling: torch.Tensor         # [S]
    top_k: torch.Tensor            # [S]
    temperature: torch.Tensor      # [S]
    top_p: torch.Tensor            # [S]
    sampling_host: list[int]
    cu_host: list[int]
    filtered: bool                 # some request uses top-k / top-p
    all_rows: bool                 # rows == every token (decode): no gather


@dataclass
class StepResult:
    tokens: list[list[int]]       # per scheduled request: emitted tokens (accepted drafts + bonus); [] if not sampling
    num_accepted: list[int]
    drafts: list[list[int]]       # per request: K new drafts (empty without a drafter)
    logprobs: list | None = None  # per request: a {token_id: Logprob} per emitted token, where it asked (logprobs.py)


def forward_ints(f: HostForward, width: int) -> list[list[int]]:
    """A forward's inputs as the integer lists an `Uploader` copies, block tables padded to `width`."""
    tables = [b for t in f.block_tables for b in t + [0] * (width - len(t))]
    return [f.input_ids, f.positions, f.query_start_loc, f.seq_lens, tables, f.slot_mapping]


def forward_views(ints: list[torch.Tensor], width: int) -> tuple[torch.Tensor, ForwardMeta]:
    """`forward_ints`, uploaded, as the forward's input ids and `ForwardMeta`."""
    input_ids, positions, qsl, seq_lens, tables, slot_mapping = ints
    return input_ids, ForwardMeta(positions=positions, query_start_loc=qsl, seq_lens=seq_lens,
                                  slot_mapping=slot_mapping, block_tables=tables.view(len(seq_lens), width))


def check_sampling_setup(params: SamplingParams) -> None:
    """Raise what a step's `_upload` would for this one request's sampling values (top_k packed as int64,
    temperature and top_p as float32): a request that cannot be set up is found alone, not by failing a step."""
    params.validate()
    array.array("q", [params.top_k])
    array.array("f", [params.temperature, params.top_p])


class ModelRunner:
    def __init__(self, target: GptOss, drafter: Drafter | None, mode: str, num_spec: int, block_size: int,
                 num_blocks: int, max_model_len: int, device: torch.device, dtype: torch.dtype,
                 vocab_size: int):
        self.target, self.drafter, self.mode, self.K = target, drafter, mode, num_spec
        self.stop_ids: set[int] = set()  # end-of-turn ids, which min_tokens holds back (the engine sets them)
        for model in (target, drafter):
            if model is not None:
                pack_qkv(model)
        self.block_size, self.max_model_len, self.device, self.vocab_size = block_size, max_model_len, device, vocab_size
        self.target_cache = bind_kv_cache(target, num_blocks, block_size, dtype, device)
        self.drafter_cache = bind_kv_cache(drafter, num_blocks, block_size, dtype, device) if drafter is not None \
            else None
        self.proposer = None
        if drafter is not None:
            target.set_aux_layers(drafter.config.resolved_aux_layer_ids(target.config.num_hidden_layers))
            self.proposer = Proposer(drafter, mode, block_size, max_model_len, device)
        self.global_generator = torch.Generator(device=device).manual_seed(0)
        self.graphs: GraphRunner | None = None  # CUDA graphs (the engine sets them)
        self.uploads = Uploader(device)

    # ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, batch: list[Scheduled], draft_len: int | None = None) -> StepResult:
        """Run one step; the drafter proposes `draft_len` tokens (default K) for the next step to verify."""
        host = self._host_inputs(batch)
        uniform = is_uniform_decode(batch)  # one k, no prefill: the target's decode graph, then the drafter's
        width = max(map(len, host.forward.block_tables))
        key = self.graphs.target.key(len(batch), len(host.forward.input_ids), uniform, width) \
            if self.graphs is not None else None
        n = self._num_drafts(batch, draft_len)
        if n and key is not None and self.graphs.draft_steps is not None:
            self.graphs.draft_steps.ensure(key, n)  # a first capture pads the target's buffers: before they load
        inp, input_ids, meta, hidden, aux = self._target_forward(host, key, width)
        tokens, num_accepted, next_ids, lps = self._verify(batch, hidden, inp)
        drafts = None
        if self.drafter is not None and n == 0:
            self._fall_behind(batch, aux, host.forward.query_start_loc, len(host.forward.input_ids))
        elif self.drafter is not None:
            self._catch_up([s.req for s in batch])
            drafts = self._draft(key, uniform, input_ids, aux, meta, next_ids, inp.num_drafts - num_accepted, n)
        return self._to_host(batch, tokens, num_accepted, drafts, lps)

    def _num_drafts(self, batch: list[Scheduled], draft_len: int | None) -> int:
        n = self.K if draft_len is None else min(self.K, max(0, draft_len))
        # a step drafts nothing only when it verifies nothing: its positions are then all real tokens
        return 1 if n == 0 and any(s.num_drafts for s in batch) else n

    def _target_forward(self, host: HostStep, key, width: int):
        """The target over the step's tokens, and the verification inputs on the device: a graph replay that
        copies its inputs in itself (the host makes no CUDA call before its launch; the verification inputs
        upload behind it), else one upload and an eager forward."""
        if key is None:
            inp, (input_ids, meta) = self._upload(host, width)
            hidden, aux = self.target(input_ids, meta)
            return inp, input_ids, meta, hidden, aux
        B, T = len(host.forward.seq_lens), len(host.forward.input_ids)
        hidden, aux = self.graphs.target.run_host(host.forward, key)
        views = self.graphs.target.views(key)
        inp, _ = self._upload(host, None)
        return inp, views.input_ids[:T], views.meta(B, T), hidden, aux

    def _host_inputs(self, batch: list[Scheduled]) -> HostStep:
        """The step's metadata as host lists."""
        ids, pos, qsl, seq, num_drafts, next_ids = [], [], [0], [], [], []
        rows, draft_ids, cu, sampling = [], [], [0], []
        for i, s in enumerate(batch):
            r = s.req
            toks = r.token_ids[r.num_computed:r.num_computed + s.num_new] + r.drafts[:s.num_drafts]
            ids += toks
            pos += range(r.num_computed, r.num_computed + len(toks))
            qsl.append(qsl[-1] + len(toks))
            seq.append(r.num_computed + len(toks))
            num_drafts.append(s.num_drafts)
            # a request still in its prompt continues with its next prompt token (the drafter's input)
            next_ids.append(0 if s.samples else r.token_ids[r.num_computed + s.num_new])
            if s.samples:  # verify the last 1 + k positions
                sampling.append(i)
                rows += range(qsl[-1] - s.num_drafts - 1, qsl[-1])
                draft_ids += r.drafts[:s.num_drafts] + [-1]
                cu.append(cu[-1] + s.num_drafts + 1)
        slots = []
        for s in batch:
            slots += host_slots(s.req.block_table, s.req.num_computed, s.req.num_computed + s.num_tokens,
                                self.block_size, self.max_model_len)
        forward = HostForward(ids, pos, qsl, seq, [s.req.block_table for s in batch], slots)
        return HostStep(forward, num_drafts, next_ids, rows, draft_ids, cu, sampling,
                        [batch[i].req.params for i in sampling])

    def _upload(self, host: HostStep, width: int | None) -> tuple[StepInputs, tuple[torch.Tensor, ForwardMeta] | None]:
        """The step's verification inputs, and with a block-table `width` the target forward's too, in one
        asynchronous copy (`Uploader`). Nothing after the first launch waits for the host: a pageable
        host-to-device copy would wait for the stream, so each one placed after the target forward used to stall
        the step."""
        params = host.params
        ints = [host.num_drafts, host.next_ids, host.rows, host.draft_ids, host.cu, host.sampling,
                [p.top_k for p in params]]
        f = host.forward
        if width is not None:
            ints += forward_ints(f, width)
        ints, (temperature, top_p) = self.uploads.upload(ints, [[p.temperature for p in params],
                                                                [p.top_p for p in params]])
        num_drafts, next_ids, rows, draft_ids, cu, sampling, top_k = ints[:7]
        filtered = any(p.top_k > 0 or p.top_p < 1 for p in params if not p.greedy)
        inp = StepInputs(num_drafts, next_ids, rows, draft_ids, cu, sampling, top_k, temperature, top_p,
                         sampling_host=host.sampling, cu_host=host.cu, filtered=filtered,
                         all_rows=len(host.rows) == len(f.input_ids))
        return inp, (forward_views(ints[7:], width) if width is not None else None)

    def _verify(self, batch: list[Scheduled], hidden: torch.Tensor, inp: StepInputs):
        """Rejection-sample the requests that reach their end; others continue with their next prompt token."""
        dev, B = self.device, len(batch)
        if not inp.sampling_host:
            tokens = torch.full((B, self.K + 1), -1, dtype=torch.long, device=dev)
            return tokens, torch.zeros(B, dtype=torch.long, device=dev), inp.next_ids, None
        rows = None if inp.all_rows else inp.rows
        reqs = [batch[i].req for i in inp.sampling_host]
        wants = [r.params.logprobs for r in reqs]
        lps = None
        if self.target.lm_head.world > 1 and all(r.params.greedy and not needs_processing(r.params)
                                                 and r.params.logprobs is None for r in reqs):
            # a split head: each row's argmax (per-rank maxima, gathered) is all greedy acceptance reads. One rank
            # keeps the full logits and the one-launch Triton verify, whose argmax scan costs less than these ops
            sampled, accepted = greedy_verify(self.target.greedy_tokens(hidden, rows), inp.draft_ids, inp.cu,
                                              max_rows=self.K + 1)
        else:
            logits = self.target.compute_logits(hidden, rows).float()
            if any(needs_processing(r.params) for r in reqs):
                logits = process_logits(logits, reqs, inp.cu_host, self.stop_ids)
            top_k, top_p = (inp.top_k, inp.top_p) if inp.filtered else (None, None)
            uniforms, noise = self._noise([batch[i] for i in inp.sampling_host], inp.cu_host, logits.shape[1])
            sampled, accepted = rejection_sample(logits, inp.draft_ids, inp.cu, inp.temperature, top_k, top_p,
                                                 uniforms, noise, max_rows=self.K + 1)
            if any(n is not None for n in wants):
                lps = (emitted_logprobs(logits, sampled, inp.cu, inp.temperature, top_k, top_p,
                                        max(n or 0 for n in wants)), sampled, accepted, wants, inp.cu_host)
        next_sampled = sampled.gather(1, accepted[:, None])[:, 0]
        if len(inp.sampling_host) == B:  # every request samples (decode): no scatter
            return sampled, accepted, next_sampled, lps
        tokens = torch.full((B, self.K + 1), -1, dtype=torch.long, device=dev)
        num_accepted = torch.zeros(B, dtype=torch.long, device=dev)
        tokens[inp.sampling] = sampled
        num_accepted[inp.sampling] = accepted
        next_ids = inp.next_ids.clone()
        next_ids[inp.sampling] = next_sampled
        return tokens, num_accepted, next_ids, lps

    @torch.inference_mode()
    def warm_up_sampling(self) -> None:
        """Run the verify's sampling once greedy and once sampled (with top-k/top-p) on dummy rows, if it runs
        the Triton kernel: that compiles per variant at first use, 0.1-0.4 s on an H200 that would otherwise
        stall a live step (the first sampled request's, say). The graphs' capture warms up what is inside them."""
        rows, dev = self.K + 1, self.device
        logits = torch.zeros(rows, self.vocab_size, device=dev)
        if not use_triton(logits):
            return
        draft_ids, cu = torch.full((rows,), -1, dtype=torch.long, device=dev), torch.tensor([0, rows], device=dev)
        for sampled in (False, True):
            temperature = torch.full((1,), float(sampled), device=dev)  # 0: greedy
            noise = (torch.rand(rows, device=dev), torch.ones(rows, self.vocab_size, device=dev)) if sampled \
                else (None, None)
            filters = (torch.full((1,), 5, dtype=torch.long, device=dev), torch.full((1,), 0.9, device=dev)) \
                if sampled else (None, None)
            rejection_sample(logits, draft_ids, cu, temperature, *filters, *noise, max_rows=rows)

    def _noise(self, items: list[Scheduled], cu: list[int], vocab: int):
        """Uniforms and Exp(1) noise per verified row; seeded requests draw from their own generator."""
        if all(s.req.params.greedy for s in items):
            return None, None
        n = cu[-1]
        uniforms = torch.empty(n, device=self.device)
        noise = torch.empty(n, vocab, device=self.device)
        for j, s in enumerate(items):
            g = s.req.generator or self.global_generator
            uniforms[cu[j]:cu[j + 1]].uniform_(generator=g)
            noise[cu[j]:cu[j + 1]].exponential_(generator=g)
        return uniforms, noise

    # A step that drafts nothing (the depth policy chose k = 0 and wants no drafts next) skips the drafter: it
    # keeps each request's drafter inputs instead (`Request.behind`), and the next step that drafts first writes
    # the drafter's K/V for them in one forward, as the context of a prompt chunk. Without this a k = 0 step
    # still cost a drafter pass, and adaptive depth could never decode as fast as no speculation.
    MAX_BEHIND = 256  # positions a request may fall behind before they are caught up anyway (memory)

    def _fall_behind(self, batch: list[Scheduled], aux, query_start_loc: list[int], T: int) -> None:
        """Keep the drafter's input rows of this step's positions (the target's fused aux hidden states)."""
        self._catch_up([s.req for s in batch if s.req.behind is not None
                        and s.req.num_computed - s.req.behind[0] >= self.MAX_BEHIND])
        rows = self.drafter.combine(aux[:T])  # a new tensor: graph outputs are overwritten by the next replay
        for i, s in enumerate(batch):
            r, h = s.req, rows[query_start_loc[i]:query_start_loc[i + 1]]
            if r.behind is None:
                r.behind = (r.num_computed, [h])
            else:
                r.behind[1].append(h)

    def _catch_up(self, reqs: list) -> None:
        """One drafter forward over the positions the requests' drafter cache lacks, writing their K/V: position p
        gets the token at p + 1 and p's kept row, as in any drafter step's context (`prepare_draft_inputs`)."""
        behind = [r for r in reqs if r.behind is not None]
        if not behind:
            return
        ids, pos, qsl, seq, slots, rows = [], [], [0], [], [], []  # a HostForward's lists, and the kept rows
        for r in behind:
            start, chunks = r.behind
            r.behind = None
            h = torch.cat(chunks) if len(chunks) > 1 else chunks[0]
            end = start + h.shape[0]
            ids += r.token_ids[start + 1:end + 1]
            pos += range(start, end)
            qsl.append(qsl[-1] + end - start)
            seq.append(end)
            slots += host_slots(r.block_table, start, end, self.block_size, self.max_model_len)
            rows.append(h)
        f = HostForward(ids, pos, qsl, seq, [r.block_table for r in behind], slots)
        width = max(map(len, f.block_tables))
        ints, _ = self.uploads.upload(forward_ints(f, width), [])  # the step's second upload (one copy, pinned)
        input_ids, meta = forward_views(ints, width)
        self.drafter(input_ids, torch.cat(rows), meta)

    def _forward(self, model, input_ids, hidden, meta: ForwardMeta, uniform: bool):
        """A drafter forward outside a captured drafter step: replayed from a graph when one fits."""
        graphs = self.graphs.drafter if self.graphs is not None else None
        key = graphs.key(meta.seq_lens.shape[0], input_ids.shape[0], uniform, meta.block_tables.shape[1]) \
            if graphs is not None else None
        return graphs.run(input_ids, hidden, meta, key) if key is not None else model(input_ids, hidden, meta)

    def _draft(self, key, uniform: bool, input_ids, aux, meta: ForwardMeta, next_ids, num_rejected, n: int):
        """The drafter step: one graph replay behind a target decode graph (`key`), else eagerly."""
        steps = self.graphs.draft_steps if key is not None else None
        drafts = steps.run(key, n, next_ids, num_rejected) if steps is not None else None  # None: not covered
        if drafts is None:
            drafts = self.proposer.propose(input_ids, aux, meta, next_ids, num_rejected, n, uniform, self._forward)
        return drafts

    def _to_host(self, batch, tokens, num_accepted, drafts, lps=None) -> StepResult:
        """The step's one device-to-host copy: emitted tokens, accepted counts and drafts side by side."""
        K1 = tokens.shape[1]
        parts = [tokens, num_accepted[:, None]] + ([drafts] if drafts is not None else [])
        rows = torch.cat(parts, dim=1).tolist()  # waits for the device: every upload so far has been read
        self.uploads.device_idle()
        if self.graphs is not None:
            self.graphs.target.device_idle()
        out_tokens = [r[:r[K1] + 1] if s.samples else [] for s, r in zip(batch, rows)]
        drafts = [r[K1 + 1:] for r in rows]
        logprobs = None
        if lps is not None:  # after the step's sync: these copies wait for nothing
            dev_rows, sampled, accepted, wants, cu = lps
            per_sampling = host_logprobs(dev_rows, cu, accepted.tolist(), sampled.tolist(), wants)
            logprobs = [None] * len(batch)
            for j, i in enumerate(i for i, s in enumerate(batch) if s.samples):
                logprobs[i] = per_sampling[j]
        return StepResult(out_tokens, [r[K1] for r in rows], drafts, logprobs)
