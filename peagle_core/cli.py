"""`peagle` command line: serve, generate, bench, train."""
from __future__ import annotations

import argparse
import json
import sys
import time


def add_generate_parser(sub) -> None:
    p = sub.add_parser("generate", help="one-off generation with speculative statistics")
    p.add_argument("--model", default="tiny", help="target checkpoint directory, Hub repo id, or 'tiny'")
    p.add_argument("--revision", help="Hub branch, tag or commit of --model")
    p.add_argument("--download-dir", help="Hub cache directory (default: huggingface_hub's)")
    p.add_argument("--drafter", help="drafter head (default for tiny: the shipped head of --mode)")
    p.add_argument("--mode", choices=["peagle", "eagle3", "none"], default="peagle")
    p.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    p.add_argument("--adaptive", action="store_true", help="adapt k per step to load and acceptance")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch")
    p.add_argument("--chat", action="store_true", help="render each prompt as a user message (harmony)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--device")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    from peagle_core import LLM, SamplingParams

    spec = None
    if args.mode != "none":
        drafter = args.drafter or (f"tiny-{args.mode}" if args.model == "tiny" else None)
        if drafter is None:
            raise ValueError(f"--mode {args.mode} needs --drafter")
        spec = {"method": "eagle3", "model": drafter, "num_speculative_tokens": args.k,
                "parallel_drafting": args.mode == "peagle", "adaptive": args.adaptive}
    llm = LLM(args.model, speculative_config=spec, device=args.device, dtype=args.dtype,
              tensor_parallel_size=args.tensor_parallel_size, revision=args.revision, download_dir=args.download_dir)
    sp = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed)
    t0 = time.perf_counter()
    # --chat: each prompt a user message; the text is the reply's final channel
    outs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], sp) if args.chat \
        else llm.generate(args.prompt, sp)
    seconds = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stats = llm.engine.stats
    summary = {"mode": args.mode, "k": args.k if spec else 0, "seconds": seconds, "output_tokens": tokens,
               "tokens_per_s": tokens / seconds, "steps": llm.engine.num_steps,
               "acceptance_length": stats.acceptance_length, "num_drafts": stats.num_drafts,
               "num_draft_tokens": stats.num_draft_tokens, "num_accepted_tokens": stats.num_accepted_tokens,
               "num_accepted_tokens_per_pos": stats.num_accepted_tokens_per_pos}
    texts = [o.outputs[0].text for o in outs]
    if args.json:
        print(json.dumps({"outputs": texts, **summary}))
        return 0
    for text in texts:
        print(text)
        print("-" * 60)
    per_pos = [f"{a / stats.num_drafts:.2f}" for a in stats.num_accepted_tokens_per_pos] if stats.num_drafts else []
    print(f"{tokens} tokens in {seconds:.2f} s ({tokens / seconds:.1f} tok/s), {llm.engine.num_steps} steps; "
          f"acceptance length {stats.acceptance_length:.2f}; per-position acceptance {' '.join(per_pos) or '-'}")
    return 0


def add_bench_parser(sub) -> None:
    from peagle_core.bench import add_arguments, run

    p = sub.add_parser("bench", help="engine step timings and fraction of the memory-bandwidth roofline")
    add_arguments(p)
    p.set_defaults(func=run)


def main(argv: list[str] | None = None) -> int:
    from peagle_core.serve_cli import add_serve_parser
    from peagle_core.training.cli import add_train_parser

    parser = argparse.ArgumentParser(prog="peagle", description="GPT-OSS with P-EAGLE parallel speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_train_parser(sub)
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError) as e:  # bad input: one line, no traceback
        print(f"peagle {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
