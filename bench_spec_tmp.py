"""Temporary GPU timing for the spec kernels (deleted after use)."""
import torch, triton
from triton.testing import do_bench
from kernels.draft_inputs import prepare_draft_inputs_ref, fill_hidden_ref
from kernels.sampling import rejection_sample_ref, target_probs
from kernels.triton_draft_inputs import prepare_draft_inputs_triton, fill_hidden_triton
from kernels.triton_sampling import rejection_sample_triton
dev = "cuda"
g = torch.Generator(device=dev).manual_seed(0)
for B, K in [(1, 8), (64, 8), (256, 8)]:
    q = K + 1; T = B * q
    tok = torch.randint(0, 200000, (T,), device=dev); pos = torch.arange(T, device=dev)
    nxt = torch.randint(0, 200000, (B,), device=dev)
    qsl = torch.arange(0, T + 1, q, device=dev, dtype=torch.int32)
    nr = torch.randint(0, K + 1, (B,), device=dev, dtype=torch.int32)
    a = prepare_draft_inputs_triton(tok, pos, nxt, qsl, nr, 200017, K)
    b = prepare_draft_inputs_ref(tok, pos, nxt, qsl, nr, 200017, K)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    t_tr = do_bench(lambda: prepare_draft_inputs_triton(tok, pos, nxt, qsl, nr, 200017, K))
    t_ref = do_bench(lambda: prepare_draft_inputs_ref(tok, pos, nxt, qsl, nr, 200017, K))
    H = 2880
    th = torch.randn(T, H, device=dev, dtype=torch.bfloat16); sh = torch.randn(H, device=dev, dtype=torch.bfloat16)
    assert torch.equal(fill_hidden_triton(th, a[5], a[3], sh), fill_hidden_ref(th, a[5], a[3], sh))
    f_tr = do_bench(lambda: fill_hidden_triton(th, a[5], a[3], sh)); f_ref = do_bench(lambda: fill_hidden_ref(th, a[5], a[3], sh))
    V = 201088; N = T
    logits = torch.randn(N, V, device=dev, dtype=torch.bfloat16) * 3
    cu = qsl.long(); am = logits.argmax(-1)
    drafts = torch.where(torch.rand(N, device=dev) < 0.8, am, 5); drafts[cu[1:] - 1] = -1
    z = torch.zeros(B, device=dev); tk = torch.zeros(B, dtype=torch.long, device=dev); tp = torch.ones(B, device=dev)
    u = torch.rand(N, device=dev); e = torch.empty(N, V, device=dev).exponential_()
    tmp = torch.full((B,), 0.8, device=dev)
    for name, temp, uu, ee in [("greedy", z, None, None), ("sampled", tmp, u, e)]:
        r1 = rejection_sample_triton(logits, drafts, cu, temp, tk, tp, uu, ee, max_rows=q)
        r2 = rejection_sample_ref(logits, drafts, cu, temp, tk, tp, uu, ee, max_rows=q)
        eq = torch.equal(r1[0], r2[0]) and torch.equal(r1[1], r2[1])
        s_tr = do_bench(lambda: rejection_sample_triton(logits, drafts, cu, temp, tk, tp, uu, ee, max_rows=q))
        s_ref = do_bench(lambda: rejection_sample_ref(logits, drafts, cu, temp, tk, tp, uu, ee, max_rows=q))
        extra = ""
        if name == "sampled":
            rr = torch.repeat_interleave(torch.arange(B, device=dev), q)
            extra = f" (target_probs alone {do_bench(lambda: target_probs(logits, temp[rr], tk[rr], tp[rr])):.3f} ms)"
        print(f"B={B} K={K} rejection[{name}] equal={eq} triton {s_tr:.3f} ms ref {s_ref:.3f} ms{extra}")
    print(f"B={B} K={K} prepare triton {t_tr*1e3:.1f} us ref {t_ref*1e3:.1f} us | fill_hidden triton {f_tr*1e3:.1f} us ref {f_ref*1e3:.1f} us")
