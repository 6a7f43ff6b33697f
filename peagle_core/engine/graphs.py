"""CUDA graphs for every step shape: the target's forward and the drafter's forward.

A forward's shape is fixed once its requests and tokens are padded; graphs are keyed by
(padded requests, padded tokens), in two families:
  decode   every request feeds its last token plus the same k drafts (no prefill chunk): requests padded
           to a bucket (1, 2, 4, 8, 16, 24, ..., max_num_seqs), each dummy fed the same q tokens, so the
           attention kernel sees the same tiles as in the eager step;
             target         q = 1 + k tokens per request, k = 0..K   -> up to max_num_seqs x (K+1) tokens
             drafter step   behind each target graph, the drafter's whole step in one more graph (`DraftSteps`)
                            for each number of drafts n: P-EAGLE's one pass over q - 1 + n slots a request (up
                            to max_num_seqs x 2K tokens), EAGLE-3's n passes, with input preparation, LM head
                            and argmax
             drafter        EAGLE-3 only: 1 slot a request (the extra passes of mixed steps)
  mixed    anything else (prefill chunks next to decodes, unequal k): tokens padded to a bucket (16, 24, 32,
           48, ... up to the step's token budget), requests always padded to max_num_seqs + 1, the dummies
           sharing the padded tokens. This works because nothing in a forward depends on how the tokens
           split into requests except through device tensors: the attention grid is T // BLOCK_Q + B
           (peagle_kernels/triton_attention.py), and the MoE and the rest see only T.
Padding is harmless: padded tokens write no K/V (slot -1) and attend to nothing (seq_len 0); their
outputs are never read. The attention kernel's KV split count also reads the block-table width, which
a graph fixes at max_model_len. Steps larger than every bucket run eagerly.

A replay puts the real inputs and the dummies' into the key's static input buffers, replays, and returns views
of static output buffers (valid until the same model's next replay). Rank 0's target graphs take their inputs as
host lists, written into a pinned buffer that the graph itself copies in (`GraphSet`, "staged"); the others copy
device tensors in before the replay.
All graphs share one memory pool and are captured largest first (as nano-vllm does,
reference/aesthetics.md §1.4); every intermediate dies inside its own graph, so any replay order is safe.
The target's logits and sampling stay outside the graphs (the drafter step's LM head and argmax are inside).

`capture=False` keeps everything but the capture: "replay" calls the model on the padded static
buffers. The CPU tests use it to prove that padding and metadata give the eager runner's greedy tokens;
`capture=True` needs CUDA and the Triton kernels (the PyTorch references call `.tolist()`).

Tensor parallelism: the target's graphs hold the layers' all-reduces, so every rank must capture and replay
the same graph at the same time. Rank 0's target `GraphSet` has a `Mirror` (`engine/tp.py`): it tells the
workers to capture a key right before rank 0 does, and sends them each replay's real inputs and key before
rank 0 replays; each worker holds a target `GraphSet` of the same layout (`target_graph_set`) and does the same
`capture_one` / `run`. Rank 0's own forwards inside a `GraphSet` are muted (its forward pre-hook would announce
an eager step, and inside a capture it would record the announcement's broadcast into the graph). The drafter
runs on rank 0 alone: its graphs are rank 0's business.
"""
from __future__ import annotations

import array
import contextlib
import ctypes
from dataclasses import dataclass
from itertools import repeat
from typing import Callable, ContextManager, Iterable, Protocol

import torch

from peagle_kernels.dispatch import use_triton
from peagle_core.engine.drafting import Proposer
from peagle_core.engine.scheduler import Scheduled
from peagle_core.models.layers import ForwardMeta

# (input ids [T], hidden [T, H] or None, meta) -> outputs (a None output stays None)
Forward = Callable[[torch.Tensor, torch.Tensor | None, ForwardMeta], tuple[torch.Tensor | None, ...]]
Key = tuple[int, int]  # (padded number of requests, padded number of tokens)


class Mirror(Protocol):
    """Rank 0's link to the tensor-parallel workers' target graphs (`engine/tp.py`, `TPWorkerGroup`)."""

    def capture(self, key: Key) -> None: ...  # the workers capture `key` now, alongside rank 0

    def replay(self, key: Key, input_ids: torch.Tensor, meta: ForwardMeta) -> None: ...  # they run this step

    def muted(self) -> ContextManager[None]: ...  # rank 0's forwards inside it are not announced as eager steps


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Request-count buckets: 1, 2, 4, 8, then every 8 from 16, always ending at max_num_seqs."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + list(range(16, max_num_seqs, 8)) + [max_num_seqs]


def token_buckets(max_tokens: int) -> list[int]:
    """Token-count buckets of mixed steps: 16, 24, 32, 48, 64, ... (at most 1.5x padding), ending at max_tokens."""
    out, b = [], 16
    while b < max_tokens:
        out += [t for t in (b, b * 3 // 2) if t < max_tokens]
        b *= 2
    return out + [max_tokens]


def is_uniform_decode(batch: list[Scheduled]) -> bool:
    """Every request feeds one token plus the same number of drafts and samples: the graph case."""
    k = batch[0].num_drafts if batch else 0
    return bool(batch) and all(s.num_new == 1 and s.samples and s.num_drafts == k for s in batch)


def graphs_supported(device: torch.device, enforce_eager: bool) -> bool:
    """Whether an engine on `device` captures CUDA graphs: CUDA with the Triton kernels, unless told not to."""
    return not enforce_eager and device.type == "cuda" and use_triton(torch.empty(0, device=device))


def capture_graph(run: Callable[[], None], pool, what: str) -> torch.cuda.CUDAGraph:
    """Warm `run` up outside the pool (Triton compiles, lazy caches and workspaces fill), then capture it."""
    try:
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            run()
    except Exception as e:
        raise RuntimeError(f"CUDA graph capture of {what} failed: {type(e).__name__}: {e}; "
                           f"set enforce_eager=True to run eagerly") from e
    return graph


@dataclass(frozen=True)
class HostForward:
    """A target forward's inputs as host lists (`ModelRunner._host_inputs`): a staged `GraphSet` writes them
    straight into its pinned buffer."""
    input_ids: list[int]
    positions: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]  # each request's own blocks, unpadded
    slot_mapping: list[int]


@dataclass(frozen=True)
class Inputs:
    """One key's input buffers: views of its GraphSet's flat buffer, the first `num_tokens` / `num_seqs` real."""
    input_ids: torch.Tensor        # [Tk]
    positions: torch.Tensor        # [Tk]
    slot_mapping: torch.Tensor     # [Tk]
    query_start_loc: torch.Tensor  # [Bk + 1]
    seq_lens: torch.Tensor         # [Bk]
    block_tables: torch.Tensor     # [Bk, max_blocks]

    def meta(self, num_seqs: int, num_tokens: int) -> ForwardMeta:
        return ForwardMeta(positions=self.positions[:num_tokens], query_start_loc=self.query_start_loc[:num_seqs + 1],
                           seq_lens=self.seq_lens[:num_seqs], slot_mapping=self.slot_mapping[:num_tokens],
                           block_tables=self.block_tables[:num_seqs])


def _layout(num_seqs: int, num_tokens: int, max_blocks: int) -> tuple[list[int], int]:
    """Offsets (int64 elements) of ids, positions, slots, query starts, lengths and block tables in a key's
    stretch of the flat buffer, each 16 bytes aligned (Triton specialises on a pointer's alignment), and its end."""
    offsets, o = [], 0
    for n in (num_tokens, num_tokens, num_tokens, num_seqs + 1, num_seqs, num_seqs * max_blocks):
        offsets.append(o)
        o += n + n % 2
    return offsets, o


def dummy_step(num_real: int, num_tokens: int, num_dummies: int) -> int:
    """Dummies share tokens num_real..num_tokens-1, `step` each (exactly the padding in a decode step; the last
    ones may get fewer or none in a mixed one): dummy i's query starts at min(num_real + step * i, num_tokens)."""
    return -(-(num_tokens - num_real) // num_dummies)


class GraphSet:
    """The graphs of one forward (target or drafter) and the static buffers they read and write.

    Every key's inputs are views of one flat buffer, each key's packed from its start (`_layout`): only one step
    runs at a time, and a key's graph reads only its own stretch. A staged set (rank 0's target) keeps a pinned
    twin of that buffer: the host writes a step's lists into it (`run_host`) and the graph's first node copies the
    key's stretch in (block tables at full width: at bs 64 and 32k tokens a 1 MB copy, tens of microseconds of a
    ~13 ms 20B-shape step), so before the launch the host makes no CUDA call at all (each costs the host 10-20 us
    on a virtual machine, while the device waits). Other sets load device tensors (`run`):
    the drafter's (inputs made on the device) and the tensor-parallel workers' (broadcast from rank 0)."""

    def __init__(self, name: str, forward: Forward, buckets: list[int], max_tokens_per_seq: int,
                 mixed_buckets: list[int], max_blocks: int, hidden: tuple[int, torch.dtype] | None,
                 device: torch.device, capture: bool, pool=None, mirror: Mirror | None = None, staged: bool = False):
        self.name, self.forward, self.buckets, self.max_tokens_per_seq = name, forward, buckets, max_tokens_per_seq
        self.mixed_buckets, self.mixed_seqs = mixed_buckets, buckets[-1] + 1  # >= 1 dummy owns the padded tokens
        self.capture, self.pool, self.mirror, self.staged, self.max_blocks = capture, pool, mirror, staged, max_blocks
        T = self.max_tokens = max([buckets[-1] * max_tokens_per_seq, *mixed_buckets])
        size = _layout(self.mixed_seqs, T, max_blocks)[1]
        self.flat = torch.zeros(size, dtype=torch.long, device=device)
        # (pinned: the graph's copy reads it when it replays, asynchronously)
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=device.type == "cuda") if staged else None
        # the host buffer as int64 Python memory: slices take arrays in one C copy each, no tensor op per part
        self._host_mem = memoryview((ctypes.c_int64 * size).from_address(self.host.data_ptr())).cast("B").cast("q") \
            if staged else None
        self._host_pending = False  # a replay queued since the device was last idle may still read `host`
        self._cuda = device.type == "cuda"
        self.hidden = torch.zeros(T, hidden[0], dtype=hidden[1], device=device) if hidden else None
        self.outputs: list[torch.Tensor | None] | None = None  # sized from the first forward's outputs
        self.graphs: dict[Key, torch.cuda.CUDAGraph] = {}
        self._views: dict[Key, Inputs] = {}
        self.num_replays = self.num_padded = 0

    def bucket(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def key(self, num_seqs: int, num_tokens: int, uniform: bool, block_table_width: int) -> Key | None:
        """The graph a step of this shape replays (decode family if `uniform`, else mixed); None: run eagerly."""
        if block_table_width > self.max_blocks or num_seqs < 1:
            return None
        q = num_tokens // num_seqs
        if uniform and num_seqs <= self.buckets[-1] and q * num_seqs == num_tokens and 0 < q <= self.max_tokens_per_seq:
            b = self.bucket(num_seqs)
            return b, b * q
        if self.mixed_buckets and num_seqs < self.mixed_seqs and 0 < num_tokens <= self.mixed_buckets[-1]:
            return self.mixed_seqs, next(t for t in self.mixed_buckets if t >= num_tokens)
        return None

    def views(self, key: Key) -> Inputs:
        """The input buffers of graph `key` (made once: a view costs the host a few microseconds)."""
        if key not in self._views:
            (ids, pos, slots, qsl, seq, tables), _ = _layout(*key, self.max_blocks)
            B, T, f = key[0], key[1], self.flat
            self._views[key] = Inputs(f[ids:ids + T], f[pos:pos + T], f[slots:slots + T], f[qsl:qsl + B + 1],
                                      f[seq:seq + B], f[tables:tables + B * self.max_blocks].view(B, self.max_blocks))
        return self._views[key]

    def run(self, input_ids: torch.Tensor, hidden: torch.Tensor | None, meta: ForwardMeta, key: Key
            ) -> tuple[torch.Tensor | None, ...]:
        """The forward of a batch padded to `key` (from `self.key`), its inputs on the device."""
        if self.staged:
            raise RuntimeError(f"the {self.name} graphs load their inputs from the host (run_host)")
        B, T = meta.seq_lens.shape[0], input_ids.shape[0]
        if self.capture and key not in self.graphs:
            self.capture_one(key)
        if self.mirror is not None:
            self.mirror.replay(key, input_ids, meta)  # the workers load the same step and replay the same key
        self._load(input_ids, hidden, meta, *key)
        return self._replay(key, B, T)

    def run_host(self, step: HostForward, key: Key) -> tuple[torch.Tensor | None, ...]:
        """The forward of a batch padded to `key` (from `self.key`), its inputs host lists (a staged set)."""
        B, T = len(step.seq_lens), len(step.input_ids)
        if self.capture and key not in self.graphs:
            self.capture_one(key)
        self._write(step, key)
        if self.mirror is not None:  # the workers need the step now, from rank 0's device (the graph copies again)
            self._copy_in(key)
            self.mirror.replay(key, self.views(key).input_ids[:T], self.views(key).meta(B, T))
        self._host_pending = True
        return self._replay(key, B, T)

    def device_idle(self) -> None:
        """Every replay queued so far has run (the caller waited for the device): the host buffer is free."""
        self._host_pending = False

    def _replay(self, key: Key, B: int, T: int) -> tuple[torch.Tensor | None, ...]:
        if self.capture:
            self.graphs[key].replay()
        else:
            self._forward(*key)
        self.num_replays += 1
        self.num_padded += key[0] > B
        return tuple(None if o is None else o[:T] for o in self.outputs)

    def capture_one(self, key: Key) -> None:
        """Warm up, then capture the forward of `num_seqs` dummy requests sharing `num_tokens` into the shared pool."""
        num_seqs, num_tokens = key
        # all dummies: the warm-up writes no K/V and reads none
        if self.staged:
            self._write(HostForward([], [], [0], [], [], []), key)
        else:
            self.clear(key)
        if self.mirror is not None:
            self.mirror.capture(key)  # the workers' warm-ups and captures meet rank 0's in every all-reduce
        self.graphs[key] = capture_graph(lambda: self._forward(num_seqs, num_tokens), self.pool,
                                         f"the {self.name} forward ({num_seqs} requests, {num_tokens} tokens)")

    def _write(self, step: HostForward, key: Key) -> None:
        """The step's lists and its dummies' inputs into the pinned buffer, laid out as `views(key)` (`_pad`'s
        dummies, block-table rows past the batch's left stale)."""
        if self._host_pending and self._cuda:  # a caller replaying twice without waiting (never the engine)
            torch.cuda.synchronize(self.flat.device)
            self._host_pending = False
        Bk, Tk = key
        B, T = len(step.seq_lens), len(step.input_ids)
        tables_at = _layout(Bk, Tk, self.max_blocks)[0][5]
        step_ = dummy_step(T, Tk, Bk - B) if Bk > B else 0
        starts = [min(T + step_ * i, Tk) for i in range(1, Bk - B + 1)]
        head = array.array("q")
        for part, fill, size in ((step.input_ids, 0, Tk), (step.positions, 0, Tk), (step.slot_mapping, -1, Tk),
                                 (step.query_start_loc + starts, 0, Bk + 1), (step.seq_lens, 0, Bk)):
            head.extend(part)
            head.extend(repeat(fill, size - len(part) + size % 2))
        mem = self._host_mem
        mem[:tables_at] = head
        for i, row in enumerate(step.block_tables):
            at = tables_at + i * self.max_blocks
            mem[at:at + len(row)] = array.array("q", row)

    def _copy_in(self, key: Key) -> None:
        """The key's stretch of the pinned buffer to the device: in a staged set's graphs, their first node."""
        end = _layout(*key, self.max_blocks)[1]
        self.flat[:end].copy_(self.host[:end], non_blocking=True)

    def _load(self, input_ids: torch.Tensor, hidden: torch.Tensor | None, meta: ForwardMeta,
              num_seqs: int, num_tokens: int) -> None:
        B, T = meta.seq_lens.shape[0], input_ids.shape[0]
        v = self.views((num_seqs, num_tokens))
        dst = [v.input_ids[:T], v.positions[:T], v.slot_mapping[:T], v.query_start_loc[:B + 1], v.seq_lens[:B]]
        src = [input_ids, meta.positions, meta.slot_mapping, meta.query_start_loc, meta.seq_lens]
        # Columns past this batch's width keep stale block ids: a request never reads past its own blocks.
        tables = v.block_tables[:B, :meta.block_tables.shape[1]]
        if tables.is_contiguous():  # one request, or the full width: a flat copy like the others
            dst.append(tables.view(-1))
            src.append(meta.block_tables.reshape(-1))
        else:
            tables.copy_(meta.block_tables)
        # one multi-tensor launch for the flat copies: the device idles while the host issues launches
        torch._foreach_copy_(dst, src)
        if hidden is not None:
            self.hidden[:T].copy_(hidden)  # padded rows keep stale (finite) values; rows never mix
        self._pad(B, T, num_seqs, num_tokens)

    def clear(self, key: Key) -> None:
        """Key `key`'s device buffers hold dummies only, no step (before a capture that reads them)."""
        self._pad(0, 0, *key)

    def _pad(self, B: int, T: int, num_seqs: int, num_tokens: int) -> None:
        """Requests B..num_seqs-1 become dummies sharing tokens T..num_tokens-1 (`dummy_step`): position 0, no
        K/V write, no keys to read."""
        n = num_seqs - B
        if n == 0:
            return
        v = self.views((num_seqs, num_tokens))
        v.input_ids[T:].zero_()
        v.positions[T:].zero_()
        v.slot_mapping[T:].fill_(-1)
        qsl = v.query_start_loc[B:]
        step = dummy_step(T, num_tokens, n)
        if step == 0:
            qsl.fill_(T)
        else:  # one kernel in a decode step (n * step is exactly the padding), a clamp more in a mixed one
            torch.arange(T, T + step * n + 1, step, out=qsl)
            if step * n != num_tokens - T:
                qsl.clamp_(max=num_tokens)
        v.seq_lens[B:].zero_()

    def _forward(self, num_seqs: int, T: int) -> None:
        if self.staged:
            self._copy_in((num_seqs, T))
        v = self.views((num_seqs, T))
        with self.mirror.muted() if self.mirror is not None else contextlib.nullcontext():
            outs = self.forward(v.input_ids, None if self.hidden is None else self.hidden[:T], v.meta(num_seqs, T))
        if self.outputs is None:  # the first call is a warm-up or an uncaptured run, never a capture
            self.outputs = [None if o is None else torch.empty(self.max_tokens, *o.shape[1:], dtype=o.dtype,
                                                                device=o.device)
                            for o in outs]
        for buf, o in zip(self.outputs, outs):
            if buf is not None:
                buf[:T].copy_(o)


# (input ids [T], aux hidden [T, n_aux * H], the target's meta, next token [B], rejected drafts [B], n) -> drafts [B, n]
DraftStep = Callable[[torch.Tensor, torch.Tensor, ForwardMeta, torch.Tensor, torch.Tensor, int], torch.Tensor]


class DraftSteps:
    """The drafter's whole step behind each target decode graph, captured as one graph of its own.

    A drafter step is ~40 small launches around its forward (draft-input preparation, fc, the hidden fill,
    slots, the LM head, argmax, the id map): at bs 1 the host issuing them, not the GPU, set its time.
    After the target's decode graph `key` replays, its static inputs and aux output hold the step (padded
    with dummies), so this graph reads them in place and only the next tokens and rejected counts are
    copied in. Graphs are keyed by the target's key and the number of drafts n. `GraphRunner.capture_all`
    captures the n a depth policy may ask for up front (K for fixed depth; 1..K when the depth varies, as a
    step verifying k may draft any n for the next); any other n is captured at its first use by `ensure`,
    which runs before the target's inputs are loaded because a capture pads the target's buffers with
    dummies. Dummy requests (seq_len 0) write no K/V and read none (`drafting.Proposer.propose`).
    """

    def __init__(self, target: GraphSet, step: DraftStep, max_drafts: int, device: torch.device, capture: bool,
                 pool=None):
        self.name = "drafter step"
        self.target, self.step, self.max_drafts, self.capture, self.pool = target, step, max_drafts, capture, pool
        self.keys = {(b, b * q) for b in target.buckets for q in range(1, target.max_tokens_per_seq + 1)}
        n = target.buckets[-1]
        self.next_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.num_rejected = torch.zeros(n, dtype=torch.long, device=device)
        self.drafts = torch.zeros(n, max_drafts, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int, int], torch.cuda.CUDAGraph] = {}
        self.num_replays = self.num_padded = 0

    def covers(self, key: Key, num_drafts: int) -> bool:
        return key in self.keys and 1 <= num_drafts <= self.max_drafts

    def ensure(self, key: Key, num_drafts: int) -> None:
        """Capture the graph for (`key`, n) if it is missing; call before the target's forward loads the step."""
        if self.capture and self.covers(key, num_drafts) and (*key, num_drafts) not in self.graphs:
            self.capture_one((*key, num_drafts))

    def run(self, key: Key, num_drafts: int, next_ids: torch.Tensor, num_rejected: torch.Tensor
            ) -> torch.Tensor | None:
        """The drafts [B, n] of the step whose target forward just replayed graph `key`; None if not covered."""
        gkey = (*key, num_drafts)
        if not self.covers(key, num_drafts) or (self.capture and gkey not in self.graphs):
            return None
        B = next_ids.shape[0]
        self.next_ids[:B].copy_(next_ids)
        self.num_rejected[:B].copy_(num_rejected)
        if self.capture:
            self.graphs[gkey].replay()
        else:
            self._step(*gkey)
        self.num_replays += 1
        self.num_padded += key[0] > B
        return self.drafts[:B, :num_drafts]

    def capture_one(self, gkey: tuple[int, int, int]) -> None:
        num_seqs, num_tokens, n = gkey
        self.target.clear((num_seqs, num_tokens))
        self.graphs[gkey] = capture_graph(lambda: self._step(num_seqs, num_tokens, n), self.pool,
                                          f"the drafter step ({num_seqs} requests, {num_tokens} target tokens, "
                                          f"{n} drafts)")

    def _step(self, num_seqs: int, T: int, n: int) -> None:
        t, v = self.target, self.target.views((num_seqs, T))
        aux = t.outputs[1][:T]  # written by the target's forward of this key
        self.drafts[:num_seqs, :n].copy_(self.step(v.input_ids, aux, v.meta(num_seqs, T),
                                                   self.next_ids[:num_seqs], self.num_rejected[:num_seqs], n))


class StepModels(Protocol):
    """What the graphs capture (a `ModelRunner` is one): the target, the drafter's step, and the cache's shape."""
    target: Callable
    proposer: Proposer | None
    K: int
    max_model_len: int
    block_size: int
    device: torch.device


class GraphRunner:
    """A runner's graphs: the target's verify forward, the drafter's steps and forwards, one memory pool."""

    def __init__(self, runner: StepModels, max_num_seqs: int, capture: bool = True,
                 max_num_batched_tokens: int | None = None, mirror: Mirror | None = None):
        dev = runner.device
        if capture and not graphs_supported(dev, enforce_eager=False):
            raise ValueError("CUDA graphs need a CUDA device and the Triton kernels (the PyTorch reference "
                             "kernels sync with the host); run with enforce_eager=True or capture=False")
        # No reference to the runner itself: it owns this object, and a cycle would keep its KV cache alive.
        self.capture, self.K = capture, runner.K
        self.buckets = graph_buckets(max_num_seqs)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        K, max_blocks = runner.K, -(-runner.max_model_len // runner.block_size)
        # Mixed steps up to the scheduler's token budget (None: decode steps only); P-EAGLE's drafter adds
        # K - 1 MASK slots per request to the target's tokens.
        budget = max_num_batched_tokens
        mixed = lambda extra: token_buckets(budget + extra) if budget else []
        self.target = target_graph_set(runner.target, max_num_seqs, K, runner.max_model_len, runner.block_size,
                                       budget, dev, capture, self.pool, mirror, staged=True)
        self.drafter: GraphSet | None = None
        self.draft_steps: DraftSteps | None = None
        proposer = runner.proposer
        if proposer is not None:
            d = proposer.drafter
            # Decode steps draft inside `draft_steps`; the drafter's own decode graphs serve only EAGLE-3's extra
            # passes in mixed steps (one slot a request). P-EAGLE needs none.
            self.draft_lens = range(1, 2) if proposer.mode == "eagle3" else range(0)
            masks = max_num_seqs * (K - 1) if proposer.mode == "peagle" else 0
            self.drafter = GraphSet("drafter", lambda ids, h, meta: d(ids, h, meta), self.buckets, len(self.draft_lens),
                                    mixed(masks), max_blocks, (d.config.hidden_size, d.fc.weight.dtype), dev,
                                    capture, self.pool)
            # inside the graph the drafter's forwards run plainly (no nested replay)
            self.draft_steps = DraftSteps(self.target, lambda ids, aux, meta, nxt, rej, n: proposer.propose(
                ids, aux, meta, nxt, rej, n, True), K, dev, capture, self.pool)

    def sets(self) -> list[GraphSet]:
        return [s for s in (self.target, self.drafter) if s is not None]

    @torch.inference_mode()
    def capture_all(self, draft_depths: Iterable[int] | None = None) -> int:
        """Capture every shape a step can take, largest first; returns how many graphs exist. `draft_depths`:
        the numbers of drafts a drafter step may produce (default K, a fixed depth). A policy that varies the
        depth passes 1..K: captured lazily instead, each new (batch, tokens, drafts) shape stalled the step
        that met it by a capture, and on the H200 sweep those stalls, timed as steps, taught the adaptive
        policy that shallow steps cost more than deep ones."""
        if not self.capture:
            return 0
        todo = [(self.target, (b, b * q)) for b in self.buckets for q in range(1, self.K + 2)]
        if self.drafter is not None:
            todo += [(self.drafter, (b, b * q)) for b in self.buckets for q in self.draft_lens]
        todo += [(s, (s.mixed_seqs, t)) for s in self.sets() for t in s.mixed_buckets]
        # the drafter steps last: each reads a target graph's output buffer, made by the target's first capture
        depths = sorted(set(draft_depths or [self.K]), reverse=True)
        steps = [(self.draft_steps, (*key, n)) for key in self.draft_steps.keys for n in depths] \
            if self.draft_steps else []
        for graphs, key in sorted(todo, key=lambda t: t[1][1], reverse=True) + sorted(steps, key=lambda t: -t[1][1]):
            if key not in graphs.graphs:
                graphs.capture_one(key)
        return self.num_graphs

    @property
    def num_graphs(self) -> int:
        return sum(len(s.graphs) for s in self.sets()) + (len(self.draft_steps.graphs) if self.draft_steps else 0)

    def reset(self) -> None:
        """Drop every graph (after the model changed: a graph replays the modules it was captured with)."""
        for s in self.sets():
            s.graphs.clear()
        if self.draft_steps is not None:
            self.draft_steps.graphs.clear()


def target_graph_set(target: Callable, max_num_seqs: int, K: int, max_model_len: int, block_size: int,
                     budget: int | None, device: torch.device, capture: bool, pool=None,
                     mirror: Mirror | None = None, staged: bool = False) -> GraphSet:
    """The target's verify graphs (`staged`: rank 0's, loaded from the host). Tensor-parallel workers build theirs
    from the same numbers (rank 0 sends them at start-up), so that every rank has the same keys and buffers."""
    return GraphSet("target", lambda ids, _, meta: target(ids, meta), graph_buckets(max_num_seqs), K + 1,
                    token_buckets(budget) if budget else [], -(-max_model_len // block_size), None, device,
                    capture, pool, mirror, staged)


def make_graph_runner(runner: StepModels, max_num_seqs: int, enforce_eager: bool,
                      max_num_batched_tokens: int | None = None, draft_depths: Iterable[int] | None = None,
                      mirror: Mirror | None = None) -> GraphRunner | None:
    """Captured graphs where they work (CUDA, Triton kernels), else None (eager). `draft_depths`: see
    `GraphRunner.capture_all`; `mirror`: the tensor-parallel workers (None at TP = 1)."""
    if not graphs_supported(runner.device, enforce_eager):
        return None
    graphs = GraphRunner(runner, max_num_seqs, capture=True, max_num_batched_tokens=max_num_batched_tokens,
                         mirror=mirror)
    graphs.capture_all(draft_depths)
    return graphs
