"""Held-out evaluation of the tiny pair: acceptance (greedy) and CPU tokens/s per speculation mode.

    python scripts/tiny/evaluate.py --pair peagle_core/assets/tiny --prompts 40 --max-tokens 64 \
        --out docs/benchmarks/tiny_pair

MT-Bench questions go through the chat template, HumanEval prompts are completed as raw code.
Every greedy speculative run is also checked token-for-token against plain greedy decoding. With --temperature T
the runs sample (seed i for prompt i): rejection sampling keeps the target's distribution, not its draws, so the
outputs are not compared. Drafts are still proposed greedily, so a draft is then accepted with the target's
probability of it (`kernels/sampling.py`): acceptance falls with the target's uncertainty.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from peagle_core import LLM, SamplingParams

HELDOUT = Path(__file__).resolve().parents[2] / "data" / "heldout.json"


def load_prompts(tokenizer, n: int, heldout: Path = HELDOUT) -> dict[str, list[str]]:
    if heldout.exists():
        qs = json.loads(heldout.read_text())
    else:  # straight from the packages (scripts/tiny/corpus.py knows where they keep their data)
        import importlib.util
        import sys
        spec = importlib.util.spec_from_file_location("tiny_corpus", Path(__file__).with_name("corpus.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
        qs = {"mtbench": mod.load_heldout("mtbench"), "humaneval": mod.load_heldout("humaneval")}
    return {"mtbench": [tokenizer.apply_chat_template([{"role": "user", "content": q}]) for q in qs["mtbench"][:n]],
            "humaneval": qs["humaneval"][:n]}


def spec(pair: Path, method: str, k: int) -> dict | None:
    if method == "none":
        return None
    return {"method": "eagle3", "model": str(pair / method), "num_speculative_tokens": k,
            "parallel_drafting": method == "peagle"}


def evaluate(pair: Path, n: int, max_tokens: int, ks=(3, 5, 7), temperature: float = 0.0, **engine) -> list[dict]:
    greedy = temperature == 0.0
    base = LLM(str(pair / "target"), **engine)
    prompts = load_prompts(base.tokenizer, n)
    params = {name: [SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=None if greedy else i)
                     for i in range(len(ps))] for name, ps in prompts.items()}
    rows, plain = [], {}
    for name, ps in prompts.items():
        t0 = time.perf_counter()
        outs = base.generate(ps, params[name])
        secs = time.perf_counter() - t0
        plain[name] = [o.outputs[0].token_ids for o in outs]
        toks = sum(map(len, plain[name]))
        rows.append({"dataset": name, "method": "none", "k": 0, "prompts": len(ps), "acceptance_length": 1.0,
                     "per_position_acceptance": [], "tokens_per_s": toks / secs, "steps": base.engine.num_steps,
                     "output_tokens": toks, "identical_to_plain": len(ps) if greedy else None})
        base.engine.num_steps = 0
    for method in ("peagle", "eagle3"):
        for k in ks:
            llm = LLM(str(pair / "target"), speculative_config=spec(pair, method, k), **engine)
            for name, ps in prompts.items():
                t0 = time.perf_counter()
                outs = llm.generate(ps, params[name])
                secs = time.perf_counter() - t0
                st = llm.engine.stats
                toks = sum(len(o.outputs[0].token_ids) for o in outs)
                rows.append({"dataset": name, "method": method, "k": k, "prompts": len(ps),
                             "acceptance_length": st.acceptance_length,
                             "per_position_acceptance": [a / st.num_drafts for a in st.num_accepted_tokens_per_pos]
                             if st.num_drafts else [],
                             "tokens_per_s": toks / secs, "steps": llm.engine.num_steps, "output_tokens": toks,
                             "identical_to_plain": sum(o.outputs[0].token_ids == r for o, r in zip(outs, plain[name]))
                             if greedy else None})
                print(json.dumps(rows[-1]), flush=True)
                llm.engine.stats, llm.engine.num_steps = type(st)(), 0
    return rows


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"# Tiny pair: held-out acceptance and CPU speed", "",
             f"Machine: {meta['machine']}; torch {meta['torch']}; {meta['date']}.", "",
             f"Command: `{meta['command']}`", "",
             ("Greedy" if not meta.get("temperature") else f"Sampled at temperature {meta['temperature']} (seed i "
              f"for prompt i; outputs not compared with plain decoding)") +
             ", all prompts of a set batched together; tok/s is output tokens over wall time for the whole set.", "",
             f"![per-position acceptance]({meta['plot']})", "",
             "| dataset | method | K | acceptance length | per-position acceptance | tok/s | identical to plain |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        per = " ".join(f"{a:.2f}" for a in r["per_position_acceptance"]) or "-"
        lines.append(f"| {r['dataset']} | {r['method']} | {r['k']} | {r['acceptance_length']:.2f} | {per} | "
                     f"{r['tokens_per_s']:.1f} | "
                     f"{'-' if r['identical_to_plain'] is None else r['identical_to_plain']}/{r['prompts']} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: Path) -> None:
    """Per-position acceptance (the share of steps that accept at least i drafts), one panel per set: a line per
    head and K, so the heads' fall-off with depth shows at a glance."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = list(dict.fromkeys(r["dataset"] for r in rows))
    fig, axes = plt.subplots(1, len(sets), figsize=(5.5 * len(sets), 4), squeeze=False)
    colors = {"peagle": "tab:blue", "eagle3": "tab:orange"}
    ks = sorted({r["k"] for r in rows if r["per_position_acceptance"]})
    for ax, name in zip(axes[0], sets):
        for r in rows:
            if r["dataset"] == name and r["per_position_acceptance"]:
                per = r["per_position_acceptance"]
                ax.plot(range(1, len(per) + 1), per, marker="o", color=colors.get(r["method"], "gray"),
                        alpha=0.4 + 0.6 * (ks.index(r["k"]) + 1) / len(ks),
                        label=f"{r['method']} K={r['k']} (AL {r['acceptance_length']:.2f})")
        ax.set(title=name, xlabel="draft position", ylabel="share of steps accepting it", ylim=(0, 1))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    import sys

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", default=str(Path(__file__).resolve().parents[2] / "peagle_core/assets/tiny"))
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--ks", default="3,5,7", help="speculation depths to evaluate, comma-separated")
    ap.add_argument("--out", default="docs/benchmarks/tiny_pair")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (checked against plain decoding)")
    args = ap.parse_args()
    ks = tuple(int(k) for k in args.ks.split(","))
    rows = evaluate(Path(args.pair), args.prompts, args.max_tokens, ks, args.temperature, device=args.device,
                    max_num_seqs=64, max_model_len=1024)
    meta = {"machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "command": "python " + " ".join(sys.argv), "temperature": args.temperature}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta["plot"] = out.with_suffix(".png").name
    plot(rows, out.with_suffix(".png"))
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1))
    out.with_suffix(".md").write_text(markdown(rows, meta))
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
