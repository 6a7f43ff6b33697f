"""Triton verification: greedy acceptance and speculative rejection sampling in one kernel.

Same signature and semantics as `peagle_kernels.sampling.rejection_sample_ref` (read its docstring first).

One program per request walks its rows in order and stops at the first rejection, so a request
that rejects early reads no further rows:
- greedy request (temperature 0): row i accepts its draft iff it equals argmax(logits[i]); the
  argmax of the rejected row (or of the bonus row when all pass) is the emitted token.
- sampled request: row i accepts draft d iff uniforms[i] < p_i(d); the emitted token at the
  stopping row is argmax(residual / exp_noise), residual = p with the draft's entry zeroed (the
  bonus row has no draft, so it samples from p itself).
Argmaxes take the first maximal index, as torch does, so equal inputs give equal outputs.

Temperature, top-k and top-p are applied before the kernel by `peagle_kernels.sampling.target_probs` (the
reference's own function, in torch): p is then bit-identical in both paths, which the exactness of
`uniforms < p(d)` needs. That precompute is what a sampled batch costs: callers with only greedy
requests pass `uniforms=exp_noise=None` (no probabilities are built, every request is verified
greedily), and callers whose requests use no top-k/top-p pass `top_k=top_p=None` (a softmax instead
of an [N, V] sort). Measured on one H200 (V = 201088, bf16 logits, K = 8, B = 1 / 64 / 256):
greedy 0.09 / 0.15 / 0.29 ms; sampled without filters 0.27 / 1.3 / 4.6 ms, nearly all of it the
torch softmax; with top-k/top-p the sort alone is 0.7 / 16 / 58 ms. A later step is the softmax
(online max / sum-exp) and a sort-free top-k/top-p threshold inside the kernel.
No step reads device values on the host when `max_rows` is given, so the op can sit inside a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from peagle_kernels.dispatch import pdl_launch
from peagle_kernels.sampling import target_probs

# Vocabulary tile and warps: one program scans a row in V / BLOCK_V_MAX dependent steps. 16384 / 8 was the
# fastest of {4096, 8192, 16384} x {4, 8, 16} on an H200 (V = 201088, bf16 logits, B = 1..256).
BLOCK_V_MAX = 16384
NUM_WARPS = 8


@triton.jit
def _argmax_row(ptr, V, F64: tl.constexpr, BLOCK: tl.constexpr):
    """First index of the maximum of ptr[0:V] (lanes keep their first best; ties go to the lowest index).

    Compared in fp32 (exact for bf16/fp16/fp32 inputs; fp64 logits stay fp64)."""
    lanes = tl.arange(0, BLOCK)
    if F64:
        best = tl.full([BLOCK], float("-inf"), dtype=tl.float64)
    else:
        best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_i = lanes
    for off in range(0, V, BLOCK):
        cols = off + lanes
        x = tl.load(ptr + cols, mask=cols < V, other=float("-inf"))
        if F64:
            x = x.to(tl.float64)
        else:
            x = x.to(tl.float32)
        better = x > best
        best = tl.where(better, x, best)
        best_i = tl.where(better, cols, best_i)
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, best_i, 2147483647), axis=0).to(tl.int64)


@triton.jit
def _residual_argmax(p_ptr, e_ptr, V, draft, NOISE_F64: tl.constexpr, BLOCK: tl.constexpr):
    """argmax over v of residual[v] / E[v], residual = p with entry `draft` zeroed (draft < 0: none)."""
    lanes = tl.arange(0, BLOCK)
    if NOISE_F64:
        best = tl.full([BLOCK], float("-inf"), dtype=tl.float64)
    else:
        best = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_i = lanes
    for off in range(0, V, BLOCK):
        cols = off + lanes
        ok = cols < V
        p = tl.load(p_ptr + cols, mask=ok, other=0.0)
        p = tl.where(cols == draft, 0.0, p)
        e = tl.load(e_ptr + cols, mask=ok, other=1.0)
        if NOISE_F64:  # torch promotes fp32 / fp64 to fp64
            w = p.to(tl.float64) / e.to(tl.float64)
        else:          # IEEE-rounded division, as torch's (Triton's default fp32 division may be approximate)
            w = tl.math.div_rn(p, e.to(tl.float32))
        w = tl.where(ok, w, float("-inf"))
        better = w > best
        best = tl.where(better, w, best)
        best_i = tl.where(better, cols, best_i)
    top = tl.max(best, axis=0)
    return tl.min(tl.where(best == top, best_i, 2147483647), axis=0).to(tl.int64)


# N (verified rows) changes with every step's batch and depth, and the kernel runs outside the CUDA graphs:
# specialising on it (== 1, divisible by 16) compiled new variants in live steps (0.1-0.4 s stalls).
@triton.jit(do_not_specialize=["N"])
def _rejection_kernel(logits_ptr, probs_ptr, draft_ptr, cu_ptr, temp_ptr, u_ptr, e_ptr, tokens_ptr, nacc_ptr,
                      N, V, max_rows, stride_l, stride_p, stride_e,
                      ALL_GREEDY: tl.constexpr, LOGITS_F64: tl.constexpr, NOISE_F64: tl.constexpr,
                      BLOCK_V: tl.constexpr, BLOCK_R: tl.constexpr, USE_PDL: tl.constexpr = False):
    if USE_PDL:  # PDL: every program waits for the previous kernel first (kernels/dispatch.py)
        tl.extra.cuda.gdc_wait()
    b = tl.program_id(0)
    start = tl.load(cu_ptr + b).to(tl.int64)
    n_rows = tl.load(cu_ptr + b + 1).to(tl.int64) - start
    out = tokens_ptr + b.to(tl.int64) * max_rows
    if ALL_GREEDY:
        greedy = True
    else:
        greedy = tl.load(temp_ptr + b) == 0
    n_judge = tl.minimum(n_rows - 1, max_rows)        # rows that carry a draft (the last row is the bonus row)
    num_acc = start * 0
    going = num_acc == 0                              # True until the first rejection
    rec = num_acc - 1                                 # greedy: argmax of the rejected row
    for i in range(0, n_judge):
        if going:
            r = start + i
            d = tl.load(draft_ptr + r).to(tl.int64)
            if greedy:
                top = _argmax_row(logits_ptr + r * stride_l, V, LOGITS_F64, BLOCK_V)
                acc = (d >= 0) & (top == d)
            else:
                p_d = tl.load(probs_ptr + r * stride_p + tl.maximum(d, 0))
                u = tl.load(u_ptr + r)
                acc = (d >= 0) & (u.to(tl.float64) < p_d.to(tl.float64))   # widening: exact comparison
                top = d
            tl.store(out + i, d, mask=acc)
            num_acc += acc.to(tl.int64)
            rec = tl.where(acc, rec, top)
            going = acc
    # The emitted (recovered or bonus) token sits right after the accepted ones.
    col = tl.minimum(num_acc, max_rows - 1)
    rb = tl.minimum(start + col, N - 1)
    if greedy:
        if going:
            rec = _argmax_row(logits_ptr + rb * stride_l, V, LOGITS_F64, BLOCK_V)
    else:
        d = tl.load(draft_ptr + rb).to(tl.int64)
        rec = _residual_argmax(probs_ptr + rb * stride_p, e_ptr + rb * stride_e, V, d, NOISE_F64, BLOCK_V)
    tl.store(out + col, rec)
    for off in range(0, max_rows, BLOCK_R):
        cols = off + tl.arange(0, BLOCK_R)
        tl.store(out + cols, tl.full([BLOCK_R], -1, dtype=tl.int64), mask=(cols > num_acc) & (cols < max_rows))
    tl.store(nacc_ptr + b, num_acc)
    if USE_PDL:  # PDL: the next kernel's programs may become resident only now, not while this grid still
        tl.extra.cuda.gdc_launch_dependents()  # works (kernels/dispatch.py, rule 2)


def rejection_sample_triton(logits: torch.Tensor, draft_ids: torch.Tensor, cu_rows: torch.Tensor,
                            temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                            uniforms: torch.Tensor | None, exp_noise: torch.Tensor | None, *,
                            max_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [B, max_rows] padded with -1, num_accepted [B]); request b emits tokens[b, :num_accepted+1].

    `uniforms=exp_noise=None` declares every request greedy (temperatures are then not read).
    """
    B, (N, V) = cu_rows.shape[0] - 1, logits.shape
    device = logits.device
    if draft_ids.shape != (N,):
        raise ValueError(f"draft_ids must have one entry per logits row ({N}), got shape {tuple(draft_ids.shape)}")
    if (uniforms is None) != (exp_noise is None):
        raise ValueError("uniforms and exp_noise must be given together (or both None for all-greedy batches)")
    all_greedy = uniforms is None
    if not all_greedy and (uniforms.shape != (N,) or exp_noise.shape != (N, V)):
        raise ValueError(f"uniforms must be [{N}] and exp_noise [{N}, {V}]; got {tuple(uniforms.shape)} "
                         f"and {tuple(exp_noise.shape)}")
    if max_rows is None:
        max_rows = int((cu_rows[1:] - cu_rows[:-1]).max()) if B else 0   # the one host sync; pass max_rows to avoid it
    tokens = torch.empty(B, max_rows, dtype=torch.long, device=device)
    num_accepted = torch.zeros(B, dtype=torch.long, device=device)
    if B == 0 or max_rows == 0 or N == 0:
        return tokens.fill_(-1), num_accepted
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    draft_ids, cu_rows, temperature = draft_ids.contiguous(), cu_rows.contiguous(), temperature.contiguous()
    if all_greedy:
        probs = u = e = torch.zeros(1, 1, dtype=torch.float32, device=device)   # never read (fp32: the
        # sampled branch is still compiled, as `greedy` is a runtime value)
    else:
        row_req = torch.repeat_interleave(torch.arange(B, device=device), cu_rows[1:] - cu_rows[:-1], output_size=N)
        probs = target_probs(logits, temperature[row_req], None if top_k is None else top_k[row_req],
                             None if top_p is None else top_p[row_req])
        u = uniforms.contiguous()
        e = exp_noise if exp_noise.stride(1) == 1 else exp_noise.contiguous()
    _rejection_kernel[(B,)](
        logits, probs, draft_ids, cu_rows, temperature, u, e, tokens, num_accepted,
        N, V, max_rows, logits.stride(0), probs.stride(0), e.stride(0),
        ALL_GREEDY=all_greedy, LOGITS_F64=logits.dtype == torch.float64,
        NOISE_F64=not all_greedy and exp_noise.dtype == torch.float64,
        BLOCK_V=min(triton.next_power_of_2(V), BLOCK_V_MAX), BLOCK_R=min(triton.next_power_of_2(max_rows), 64),
        num_warps=NUM_WARPS if V >= 4096 else 4, **pdl_launch(logits))
    return tokens, num_accepted
