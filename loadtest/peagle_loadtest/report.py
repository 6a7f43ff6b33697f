"""Sweep outputs: one CSV row per cell, the JSON document, PNG plots and a markdown table."""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any

from peagle_loadtest.stats import DEFAULT_PERCENTILES, METRICS

ACCEPT_KEYS = ("acceptance_length", "draft_acceptance_rate", "acceptance_source", "num_drafts", "num_draft_tokens",
               "num_accepted_tokens")


def csv_columns(percentiles: tuple[float, ...] = DEFAULT_PERCENTILES) -> list[str]:
    cols = ["mode", "concurrency", "status", "completed", "failed", "duration_s", "request_throughput",
            "output_throughput", "total_token_throughput", "total_input_tokens", "total_output_tokens"]
    for m in METRICS:
        cols += [f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms"] + [f"p{q:g}_{m}_ms" for q in percentiles]
    return cols + list(ACCEPT_KEYS) + ["usage_reported", "errors"]


def write_csv(cells: list[dict[str, Any]], path: Path) -> None:
    cols = csv_columns()
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for c in cells:
            w.writerow({**c, "errors": json.dumps(c.get("errors") or {})})


def write_json(doc: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(doc, indent=2, default=str) + "\n")


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def markdown_table(cells: list[dict[str, Any]]) -> str:
    head = ("| mode | conc. | ok | failed | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 "
            "| ITL p50 | E2EL p50 | accept. len |")
    rule = "|" + "---|" * 2 + "---:|" * 11
    rows = [head, rule]
    for c in cells:
        status = "" if c.get("status") == "ok" else f" ({c.get('status')})"
        rows.append("| " + " | ".join([
            c["mode"] + status, str(c["concurrency"]), _fmt(c.get("completed")), _fmt(c.get("failed")),
            _fmt(c.get("request_throughput"), 2), _fmt(c.get("output_throughput")),
            _fmt(c.get("median_ttft_ms")), _fmt(c.get("p99_ttft_ms")), _fmt(c.get("median_tpot_ms"), 2),
            _fmt(c.get("p99_tpot_ms"), 2), _fmt(c.get("median_itl_ms"), 2), _fmt(c.get("median_e2el_ms")),
            _fmt(c.get("acceptance_length"), 2)]) + " |")
    return "\n".join(rows)


def write_markdown(doc: dict[str, Any], path: Path, plots: list[Path]) -> None:
    meta = doc["meta"]
    lines = [f"# Load-test sweep: {meta.get('label') or 'peagle'}", ""]
    for key in ("date", "target", "workload", "endpoint", "max_tokens", "temperature", "duration_s_per_cell",
                "machine", "versions", "command"):
        if meta.get(key) is not None:
            val = meta[key]
            if isinstance(val, dict):
                val = ", ".join(f"{k} {v}" for k, v in val.items())
            lines.append(f"- {key}: `{val}`" if key == "command" else f"- {key}: {val}")
    lines += ["", markdown_table(doc["cells"]), "",
              "Times in ms, per `vllm bench serve`: TTFT to the first non-empty chunk; TPOT = (E2EL - TTFT) / "
              "(output tokens - 1) with tokens from the server's `usage`; ITL = gaps between content chunks "
              "(one chunk may carry several accepted tokens); out tok/s = output tokens of completed requests / "
              "(first request sent .. last request finished). Acceptance length = 1 + accepted / drafts from the "
              "server's counters over the cell (- when the server exports none).", ""]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    path.write_text("\n".join(lines) + "\n")


def plot(cells: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Output throughput, TPOT and TTFT against concurrency, one line per mode (log2 x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(c["mode"] for c in cells))
    specs = [
        ("throughput_vs_concurrency.png", "Output throughput", "output tokens / s", [("output_throughput", "-", None)]),
        ("tpot_vs_concurrency.png", "Time per output token", "TPOT (ms)",
         [("median_tpot_ms", "-", "median"), ("p99_tpot_ms", "--", "p99")]),
        ("ttft_vs_concurrency.png", "Time to first token", "TTFT (ms)",
         [("median_ttft_ms", "-", "median"), ("p99_ttft_ms", "--", "p99")]),
    ]
    paths = []
    for name, title, ylabel, series in specs:
        fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
        for i, mode in enumerate(modes):
            rows = sorted((c for c in cells if c["mode"] == mode), key=lambda c: c["concurrency"])
            color = f"C{i}"
            for key, style, tag in series:
                pts = [(c["concurrency"], c[key]) for c in rows if c.get(key) is not None]
                if pts:
                    xs, ys = zip(*pts)
                    ax.plot(xs, ys, style, marker="o", color=color, label=mode + (f" {tag}" if tag else ""))
        concs = sorted({c["concurrency"] for c in cells})
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.set_xlabel("concurrent users")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.set_ylim(bottom=0)  # ratios between modes read honestly only from zero
        ax.grid(True, alpha=0.3)
        if ax.has_data():
            ax.legend(fontsize=8)
        fig.tight_layout()
        path = out_dir / name
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths
