"""A run's outputs: `summary.json` (strict JSON), `summary.md` and the brief printed last."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from peagle_core.bench.bars import bar_rows

PACKED = {"gpt_oss_20b_mxfp4": "20B", "gpt_oss_120b": "120B"}  # summary key -> name of the MXFP4 sections


def write_outputs(summary: dict[str, Any], out: Path) -> None:
    """summary.json (atomically: a run cut short leaves the last whole one) and summary.md, with the bars."""
    summary["bars"] = bar_rows(summary)
    tmp = out / "summary.json.tmp"
    tmp.write_text(json.dumps(_clean(summary), indent=2, default=str) + "\n")
    tmp.replace(out / "summary.json")
    (out / "summary.md").write_text(render_markdown(summary))


def _clean(o: Any) -> Any:
    """Strict JSON: non-finite floats become null."""
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, float) and not math.isfinite(o):
        return None
    return o


def _f(v: Any, digits: int = 3) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:.{digits}f}"
    return str(v)


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines += ["| " + " | ".join(_f(c) if not isinstance(c, str) else c for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(s: dict[str, Any]) -> str:
    """summary.md: the settings, the bar, then a table per section that ran (or why it did not)."""
    m, st = s.get("machine", {}), s.get("settings", {})
    device = m.get("gpu_name") or f"CPU ({m.get('cpu')}, {m.get('cpu_count')} cores)"
    out = [f"# peagle bench: {st.get('shape')} shape on {device}", "",
           f"- command: `{s.get('command')}`",
           f"- date: {s.get('date')} ({s.get('status')})",
           f"- versions: torch {m.get('torch')}, triton {m.get('triton')}, transformers {m.get('transformers')}, "
           f"CUDA {m.get('cuda', '-')}, Python {m.get('python')}",
           f"- commit: {m.get('git_commit', '-')}{' (uncommitted changes)' if m.get('git_dirty') else ''}",
           f"- settings: {st.get('dtype')}, context {st.get('context')} tokens, {st.get('warmup')} warm-up + "
           f"{st.get('iters')} timed calls per figure ({st.get('timing')}), Triton kernels "
           f"{'on' if st.get('triton_kernels') else 'off'}; random weights, no checkpoint", ""]
    if s.get("note"):
        out += [f"> {s['note']}", ""]

    out += _bar_section(s)

    bw = s.get("bandwidth")
    if bw:
        b = s.get("bytes_per_step_bs1") or {}
        out += ["## Bandwidth and the bs-1 roofline", "",
                _table(["quantity", "value"], [
                    ["read bandwidth, `x.sum()` (TB/s)", bw["read_tb_s"]],
                    ["copy bandwidth, read + write (TB/s)", bw["copy_tb_s"]],
                    ["bandwidth used for the roofline (TB/s)", bw["tb_s"]],
                    ["bytes per decode step at bs 1 (GB)", b.get("total", 0) / 1e9 if b else None],
                    ["  of which weights (GB)", b.get("weights", 0) / 1e9 if b else None],
                    ["  of which K/V (GB)", b.get("kv", 0) / 1e9 if b else None],
                    ["same with MXFP4 experts (GB)", (s.get("bytes_per_step_bs1_mxfp4_experts") or 0) / 1e9 or None],
                    ["roofline time at bs 1 (ms)", s.get("roofline_ms_bs1")],
                ]), ""]
        if b:
            out += ["Bytes by part at bs 1 (MB): " + ", ".join(f"{k} {v / 1e6:.2f}" for k, v in b["parts"].items()),
                    "(attention, norms, router and the top-k experts of every layer, the whole LM head, one embedding "
                    "row; K/V over the context, sliding layers capped at their window).", ""]

    dec = s.get("decode")
    if dec:
        out += ["## Decode steps (no speculation)", "",
                "`ModelRunner.execute` on synthetic decode batches; bytes above bs 1 assume uniform routing "
                "(expected distinct experts).", "",
                _table(["batch", "step ms (median)", "min", "max", "tok/s", "bytes (GB)", "roofline ms", "roofline fraction"],
                       [[bs, d["step_ms"], d["min_ms"], d["max_ms"], _f(d["tok_s"], 1), d["bytes"] / 1e9, d["roofline_ms"],
                         d["roofline_fraction"]] for bs, d in dec.items()]), ""]
        if "repeat_ms" in dec.get("1", {}):
            out += [f"bs 1 timed twice: {dec['1']['step_ms']:.3f} and {dec['1']['repeat_ms']:.3f} ms "
                    f"(spread {100 * dec['1']['repeat_spread']:.1f}%: differences below this are noise).", ""]

    ver = s.get("verify")
    if ver:
        out += ["## Verify steps at bs 1", "", "Target over 1 + k tokens plus rejection sampling (bar: k = 7 within "
                "1.3x of a plain decode step).", "",
                "Bytes: the weights the step must read, with the experts that 1 + k tokens select under uniform "
                "routing (a MoE verify reads more experts than a decode step; the last column is that ratio "
                "alone, the floor a bandwidth-bound verify step cannot beat).", "",
                _table(["k", "step ms", "min", "max", "over decode bs 1", "roofline fraction", "bytes over decode bs 1"],
                       [[k, v["step_ms"], v["min_ms"], v["max_ms"], v["over_decode_bs1"], v.get("roofline_fraction"),
                         v.get("bytes_over_decode_bs1")] for k, v in ver.items()]), ""]

    dr = s.get("draft")
    if dr and "not_run" not in dr:
        pe, e3 = dr["peagle"], dr["eagle3"]
        out += ["## Drafter steps at bs 1", "", dr["batch"] + ".",
                f"P-EAGLE head: {pe['layers']} layers, {pe['parameters'] / 1e9:.2f} B parameters; "
                f"EAGLE-3 head: {e3['layers']} layer, {e3['parameters'] / 1e9:.2f} B parameters.", "",
                _table(["K", "P-EAGLE ms", "P-EAGLE / K=1", "EAGLE-3 ms", "EAGLE-3 / K=1"],
                       [[K, pe["by_k"][K]["draft_ms"], pe["by_k"][K]["draft_ms"] / pe["by_k"]["1"]["draft_ms"],
                         e3["by_k"][K]["draft_ms"], e3["by_k"][K]["draft_ms"] / e3["by_k"]["1"]["draft_ms"]]
                        for K in pe["by_k"]]), ""]
    elif dr:
        out += ["## Drafter steps", "", f"Not run: {dr['not_run']}.", ""]

    hf = s.get("hf")
    if hf and "not_run" not in hf:
        out += ["## transformers baseline at bs 1", "",
                f"`GptOssForCausalLM` over the same weights, attention `{hf['attn_implementation']}`, experts "
                f"`{hf['experts_implementation']}`; greedy, {hf['tokens']} tokens after the same prompt. Decode tok/s "
                "= (n - 1) / (t(n) - t(1))." + (f" Note: {hf['fallback']}." if hf.get("fallback") else ""), "",
                _table(["quantity", "value"], [
                    ["transformers decode tok/s", _f(hf["decode_tok_s"], 2)],
                    ["transformers end-to-end tok/s (prefill included)", _f(hf["end_to_end_tok_s"], 2)],
                    ["ours, engine decode step at bs 1 (tok/s)", _f(s.get("decode_tok_s", {}).get("1"), 1)],
                    ["ours, greedy loop through ModelRunner.execute (tok/s)", _f(hf["ours_loop_decode_tok_s"], 1)],
                    ["speedup (ours / transformers)", _f(s.get("speedup_vs_hf_transformers_bs1"), 2)],
                    ["greedy tokens equal (leading tokens that agree)",
                     f"{_f(hf['same_greedy_tokens'])} ({hf['same_greedy_prefix']}/{hf['tokens']})"],
                ]), ""]
    elif hf:
        out += ["## transformers baseline", "", f"Not run: {hf['not_run']}.", ""]

    for key, name in PACKED.items():
        out += _packed_section(s.get(key), name)
    return "\n".join(out)


def _packed_section(big: dict[str, Any] | None, name: str) -> list[str]:
    """A packed-MXFP4 shape's decode, verify and MoE-layer figures."""
    if not big:
        return []
    out = [f"## {name} shape with MXFP4 experts: decode at bs 1", ""]
    if "not_run" in big:
        out += [f"Not run: {big['not_run']}.", ""]
    if big.get("note"):
        out += [big["note"] + ".", ""]
    if "step_ms" in big:
        if big.get("truncated"):
            out += [f"**Truncated**: {big['layers_run']} of {big['layers_full']} layers built; {big['method']}.", ""]
        out += [_table(["quantity", "value"], [
            ["step ms (bs 1)" + (" extrapolated" if big.get("truncated") else ""), big["step_ms"]],
            ["tok/s", _f(big["tok_s"], 1)],
            ["measured step ms by depth", ", ".join(f"{d} layers: {t:.3f}" for d, t in big["measured_step_ms"].items())],
            ["bytes per step (GB)", big["bytes_per_step_bs1"]["total"] / 1e9],
            ["roofline ms", big["roofline_ms"]],
            ["roofline fraction", big["roofline_fraction"]],
            ["roofline fraction of the truncated model as run", big.get("truncated_roofline_fraction")],
            ["experts", big.get("experts_dtype")],
            ["bytes per step with bf16 experts instead (GB)", (big.get("bytes_per_step_bs1_bf16_experts") or 0) / 1e9],
        ]), ""]
    if big.get("verify"):
        out += [f"### {name}: verify at bs 1 (target over 1 + k tokens)", "",
                _table(["k", "step ms", "x decode", "bytes (GB)", "roofline fraction"],
                       [[k, v["step_ms"], v["over_decode_bs1"], v["bytes"] / 1e9, v["roofline_fraction"]]
                        for k, v in big["verify"].items()]), ""]
    if big.get("moe_layer"):
        out += [f"### {name}: the MoE layer alone", "",
                _table(["routed tokens", "us", "experts read", "TB/s effective"],
                       [[t, v["us"], v["experts"], v["tb_s"]] for t, v in big["moe_layer"].items()]), ""]
    return out


def _bar_section(s: dict[str, Any]) -> list[str]:
    out = ["## The bar", ""]
    rows = s.get("bars") or bar_rows(s)
    if rows and not rows[0]["bar_applies"]:
        out += ["The bar is set for the 20B shape on one H200; this run is a different shape or device, so "
                "the verdicts below are informational.", ""]
    out += [_table(["figure", "measured", "bar", "met"],
                   [[f"`{r['key']}`", r["figure"], r["bar"], "-" if r["met"] is None else ("yes" if r["met"] else "NO")]
                    for r in rows]), ""]
    return out


def render_brief(s: dict[str, Any]) -> str:
    """The few lines printed last (a remote run's output tail): the bar, tok/s by batch, the 120B figure."""
    out = _bar_section(s)
    if s.get("decode_tok_s"):
        out.append("decode tok/s by batch: " + ", ".join(f"bs {b}: {v:.1f}" for b, v in s["decode_tok_s"].items()))
    for key, name in PACKED.items():
        big = s.get(key) or {}
        if "step_ms" in big:
            out.append(f"{name} MXFP4 bs 1: {big['tok_s']:.1f} tok/s, roofline fraction {big['roofline_fraction']:.3f}"
                       + (f" (truncated to {big['layers_run']} layers, extrapolated)" if big.get("truncated") else ""))
        elif big:
            out.append(f"{name} MXFP4: not run ({big.get('not_run')})")
    return "\n".join(out)
