"""Tensor-parallel check and benchmark: TP=1 against TP=N on one random GPT-OSS-shaped checkpoint.

    python -m peagle_core.parallel_bench --shape 20b --tp 2                        # two GPUs
    python -m peagle_core.parallel_bench --shape tiny --tp 2 --device cpu          # anywhere (gloo)

1. builds a random target of the shape on the device (`--layers` cuts the depth) and writes it as a
   Hugging Face checkpoint (`--mxfp4` stores the experts as MXFP4, as the published ones are);
2. greedy-generates the same prompts at TP=1 and TP=N and reports, per prompt, how many tokens agree
   (in fp32 all of them should; in bf16 the all-reduce rounds partial sums differently, so a random
   model's near-ties may flip late in a sequence: `--scale` sharpens the logits as trained models are);
3. times decode steps (one new token per request, no speculation) at each batch size, TP=1 then TP=N;
4. writes summary.json and summary.md under `--out`, with the machine, versions, date and command.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import sys
import tempfile
from pathlib import Path

import torch

from peagle_core.bench.models import build_random, target_config
from peagle_core.engine.llm import LLM
from peagle_core.engine.types import SamplingParams
from peagle_core.loading.checkpoint import DTYPES, save_target
from peagle_core.models.gpt_oss import GptOss
from peagle_core.timing import measure


def write_checkpoint(args, device: torch.device, dtype: torch.dtype) -> Path:
    cfg = target_config(args.shape)
    if args.layers:
        cfg = cfg.model_copy(update={"num_hidden_layers": args.layers})
    model = build_random(lambda: GptOss(cfg), device, dtype, seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(args.scale)
    path = Path(args.checkpoint or tempfile.mkdtemp(prefix="peagle-tp-"))
    save_target(model, path, mxfp4_experts=args.mxfp4, max_shard_bytes=4 << 30)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return path


def engine(path: Path, tp: int, args, max_num_seqs: int, eager: bool) -> LLM:
    return LLM(str(path), device=args.device, dtype=args.dtype, tensor_parallel_size=tp, max_num_seqs=max_num_seqs,
               max_model_len=args.context + args.steps + 64, kv_cache_memory_gb=args.kv_gb, enforce_eager=eager)


def agreement(a: list[int], b: list[int]) -> int:
    """Length of the common prefix: tokens that agree before the first difference."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def decode_step_times(llm: LLM, batch: int, args) -> dict:
    """Fill `batch` requests of `context` tokens, then time `steps` decode steps of the whole batch."""
    eng, g = llm.engine, torch.Generator().manual_seed(batch)
    vocab = eng.target.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=args.steps + args.warmup + 8, ignore_eos=True)
    reqs = [eng.add_request(f"b{batch}-{i}", torch.randint(0, vocab - 1, (args.context,), generator=g).tolist(),
                            params) for i in range(batch)]
    while any(r.num_computed < r.num_prompt for r in reqs):  # prefill (chunked as the scheduler likes)
        eng.step()
    t = measure(eng.step, torch.device(args.device), args.warmup, args.steps, clock="wall")  # the step as served
    for r in reqs:
        eng.abort(r.request_id)
    return {"batch": batch, "median_ms": t.median_ms, "min_ms": t.min_ms}


def run(args) -> dict:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.device = str(device)
    args.dtype = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    dtype = DTYPES[args.dtype]
    path = write_checkpoint(args, device, dtype)
    try:
        return compare(path, args, device)
    finally:
        if not args.checkpoint:
            shutil.rmtree(path, ignore_errors=True)  # a 20b-shaped checkpoint is tens of GB


def compare(path: Path, args, device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    cfg = target_config(args.shape)
    prompts = [torch.randint(0, cfg.vocab_size - 1, (n,), generator=g).tolist() for n in (5, 37, 3, 64)]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    result = {"shape": args.shape, "layers": args.layers or cfg.num_hidden_layers, "dtype": args.dtype,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
              "mxfp4_checkpoint": args.mxfp4, "tp": args.tp, "context": args.context, "scale": args.scale, "runs": {}}
    outputs = {}
    # On GPUs every TP size is timed with CUDA graphs and eagerly (how much of an eager step is the host's)
    runs = [(tp, eager) for tp in (1, args.tp) for eager in (True, False)] if device.type == "cuda" \
        else [(1, True), (args.tp, True)]
    for tp, eager in runs:
        llm = engine(path, tp, args, max(args.batch_sizes), eager)
        name = f"tp{tp}" + ("_eager" if eager and device.type == "cuda" else "")
        t = llm.engine.target
        run_ = {"weights_gb_per_rank": sum(p.numel() * p.element_size() for p in t.parameters()) / 1e9,
                "kv_cache_gb_per_rank": llm.engine.runner.target_cache.numel() * t.lm_head.weight.element_size() / 1e9}
        run_["cuda_graphs"] = llm.engine.runner.graphs is not None
        outputs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        run_["decode"] = [decode_step_times(llm, b, args) for b in args.batch_sizes]
        result["runs"][name] = run_
        llm.engine.shutdown()
        del llm
        if device.type == "cuda":
            torch.cuda.empty_cache()
    agree = [agreement(a, b) for a, b in zip(outputs["tp1"], outputs[f"tp{args.tp}"])]
    result["greedy_agreement"] = {"tokens_per_prompt": args.tokens, "agreeing_prefix": agree,
                                  "identical": all(n == args.tokens for n in agree),
                                  # every run against TP=1: eager vs graphs at TP=1 shows how far bf16 rounding
                                  # alone moves a random model's greedy tokens
                                  "vs_tp1": {name: [agreement(a, b) for a, b in zip(outputs["tp1"], outs)]
                                             for name, outs in outputs.items() if name != "tp1"}}
    return result


def label(name: str, run: dict) -> str:
    tp = name[2:].split("_")[0]
    return f"TP={tp}" + ("" if run.get("cuda_graphs") is None else (" graphs" if run["cuda_graphs"] else " eager"))


def to_markdown(r: dict, command: str) -> str:
    lines = [f"# Tensor parallelism: TP=1 vs TP={r['tp']}", "",
             f"- machine: {r['device']}; torch {torch.__version__}; python {platform.python_version()}",
             f"- date: {datetime.date.today().isoformat()}; command: `{command}`",
             f"- model: random GPT-OSS {r['shape']} shape, {r['layers']} layers, {r['dtype']}"
             f"{', MXFP4 checkpoint' if r['mxfp4_checkpoint'] else ''}; context {r['context']} tokens per request",
             f"- greedy tokens agreeing with TP=1 (leading tokens, of {r['greedy_agreement']['tokens_per_prompt']} "
             f"per prompt, scale {r.get('scale')}): " + "; ".join(
                 f"{label(k, r['runs'][k])}: {v}" for k, v in r["greedy_agreement"].get("vs_tp1", {}).items()), "",
             "| batch | " + " | ".join(f"{label(k, v)} step (ms)" for k, v in r["runs"].items()) + " |",
             "|---|" + "---|" * len(r["runs"])]
    runs = list(r["runs"].values())
    for i, d in enumerate(runs[0]["decode"]):
        lines.append(f"| {d['batch']} | " + " | ".join(f"{x['decode'][i]['median_ms']:.2f}" for x in runs) + " |")
    lines += ["", "| | " + " | ".join(label(k, v) for k, v in r["runs"].items()) + " |", "|---|" + "---|" * len(runs),
              "| weights per rank (GB) | " + " | ".join(f"{x['weights_gb_per_rank']:.3f}" for x in runs) + " |",
              "| KV cache per rank (GB) | " + " | ".join(f"{x['kv_cache_gb_per_rank']:.3f}" for x in runs) + " |"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=["tiny", "20b", "120b"], default="20b")
    p.add_argument("--layers", type=int, help="cut the target to this many layers (default: the shape's; "
                   "120b at TP=1 needs ~234 GB in bf16, so cut it, e.g. --layers 12, on one H200)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device")
    p.add_argument("--dtype", choices=list(DTYPES))
    p.add_argument("--mxfp4", action="store_true", help="write the experts as MXFP4 (slow to quantise at 20b+)")
    p.add_argument("--scale", type=float, default=4.0, help="multiply lm_head (peaked logits, fewer near-ties)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt for the agreement check")
    p.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--kv-gb", type=float, default=4.0, help="KV cache per rank (GB)")
    p.add_argument("--checkpoint", help="where to write the random checkpoint (default: a temporary directory)")
    p.add_argument("--out", default="docs/benchmarks/tp")
    args = p.parse_args(argv)
    r = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m peagle_core.parallel_bench " + " ".join(argv if argv is not None else sys.argv[1:])
    (out / "summary.json").write_text(json.dumps({**r, "command": command, "torch": torch.__version__,
                                                  "date": datetime.datetime.now().isoformat(timespec="seconds")},
                                                 indent=2))
    (out / "summary.md").write_text(to_markdown(r, command))
    print(to_markdown(r, command))


if __name__ == "__main__":
    main()
