"""Prefix caching through `serve run`: the same engine with the cache on and off, and prefix-affinity routing.

    python -m peagle_loadtest.prefix_bench --config configs/tiny.yaml --out docs/benchmarks/prefix_caching.json

One `serve run` holds every variant as its own Serve application (route prefixes /on, /off, /affinity2, /pow2),
built from the config's first application: one replica with the prefix cache, one without, and two 2-replica
deployments with the cache, one routed by prefix affinity (peagle_cluster.prefix_router) and one by Serve's
default. Cells alternate between the variants, so a loaded machine slows both sides of a comparison alike.

- shared system prompt (workloads.shared_system_prompt), streamed, closed loop at each concurrency: TTFT p50/p99
  and the prefix-cache hit rate (usage.prompt_tokens_details.cached_tokens / prompt_tokens), cache on against off;
- multi-turn chats (workloads.conversations): each turn is sent with the history, the server's own replies
  included; the hit rate on one replica, and on two with and without prefix affinity.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
import yaml

from peagle_loadtest import launch
from peagle_loadtest.stream import RequestRecord, build_request, stream_request
from peagle_loadtest.workloads import Conversation, Prompt, conversations, shared_system_prompt

ROUTER = {"request_router_class": "peagle_cluster.prefix_router:PrefixAffinityRouter",
          "request_router_kwargs": {"imbalanced_threshold": 4}}
# name -> (engine args changed, replicas, request_router_config)
VARIANTS: dict[str, tuple[dict[str, Any], int, dict[str, Any] | None]] = {
    "on": ({"enable_prefix_caching": True}, 1, None),
    "off": ({"enable_prefix_caching": False}, 1, None),
    "affinity2": ({"enable_prefix_caching": True}, 2, ROUTER),
    "pow2": ({"enable_prefix_caching": True}, 2, None),
}


def bench_config(base: dict[str, Any], port: int, replica_cpus: float) -> dict[str, Any]:
    """The config's first application once per variant, each under its own route prefix."""
    cfg = copy.deepcopy(base)
    cfg["http_options"] = {**cfg.get("http_options", {}), "host": "127.0.0.1", "port": port}
    template = cfg["applications"][0]
    apps = []
    for name, (engine, replicas, router) in VARIANTS.items():
        app = copy.deepcopy(template)
        app["name"], app["route_prefix"] = f"prefix-{name}", f"/{name}"
        args = app["args"] | engine
        deployment = {k: v for k, v in args.get("deployment", {}).items()
                      if k not in ("autoscaling_config", "request_router_config")}
        deployment["num_replicas"] = replicas
        # several replicas share this machine's cores; each still runs one torch thread
        deployment["ray_actor_options"] = {**deployment.get("ray_actor_options", {}), "num_cpus": replica_cpus}
        if router is not None:
            deployment["request_router_config"] = router
        args["deployment"] = deployment
        app["args"] = args
        apps.append(app)
    cfg["applications"] = apps
    return cfg


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def hit_rate(pairs: list[tuple[int | None, int | None]]) -> float | None:
    """Cached prompt tokens over prompt tokens, as vLLM's prefix_cache_hits / prefix_cache_queries."""
    prompt = sum(p or 0 for p, _ in pairs)
    return sum(c or 0 for _, c in pairs) / prompt if prompt else None


def shared_cell(url: str, model: str, prompts: list[Prompt], concurrency: int, max_tokens: int) -> dict[str, Any]:
    """`prompts` streamed by `concurrency` closed-loop users."""
    todo, lock, records = list(prompts), threading.Lock(), []

    def user() -> None:
        session = requests.Session()
        while True:
            with lock:
                if not todo:
                    return
                p = todo.pop(0)
            path, body = build_request("chat", model, list(p.messages), max_tokens=max_tokens, temperature=0.0,
                                       ignore_eos=True)
            rec = stream_request(session, url, path, body)
            with lock:
                records.append(rec)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(user)
    return summarize(records, time.perf_counter() - t0)


def summarize(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    return {"requests": len(records), "errors": len(records) - len(ok), "duration_s": round(duration_s, 2),
            "ttft_p50_ms": percentile(ttft, 50), "ttft_p99_ms": percentile(ttft, 99),
            "ttft_mean_ms": statistics.fmean(ttft) if ttft else None,
            "hit_rate": hit_rate([(r.prompt_tokens, r.cached_tokens) for r in ok]),
            "first_error": next((r.error for r in records if not r.ok), None)}


def chat_turns(url: str, model: str, conv: Conversation, max_tokens: int) -> list[dict[str, Any]]:
    """One conversation, turn by turn: each request carries the earlier user turns and the replies received."""
    session, history, out = requests.Session(), [], []
    for text in conv.user_turns:
        history.append({"role": "user", "content": text})
        path, body = build_request("chat", model, list(history), max_tokens=max_tokens, temperature=0.0,
                                   stream=False)
        t0 = time.perf_counter()
        r = session.post(url + path, json=body, timeout=600)
        if r.status_code != 200:  # the history outgrew max_model_len: the chat ends there
            out.append({"ok": False, "status": r.status_code})
            break
        body = r.json()
        usage = body["usage"]
        out.append({"ok": True, "prompt_tokens": usage["prompt_tokens"], "e2e_ms": (time.perf_counter() - t0) * 1e3,
                    "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)})
        history.append({"role": "assistant", "content": body["choices"][0]["message"].get("content") or ""})
    return out


def conversation_cell(url: str, model: str, convs: list[Conversation], concurrency: int,
                      max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        turns = list(pool.map(lambda c: chat_turns(url, model, c, max_tokens), convs))
    ok = [t for conv in turns for t in conv if t["ok"]]
    later = [t for conv in turns for t in conv[1:] if t["ok"]]
    return {"conversations": len(convs), "turns": len(ok), "failed_turns": sum(not t["ok"] for c in turns for t in c),
            "duration_s": round(time.perf_counter() - t0, 2),
            "hit_rate": hit_rate([(t["prompt_tokens"], t["cached_tokens"]) for t in ok]),
            "hit_rate_after_first_turn": hit_rate([(t["prompt_tokens"], t["cached_tokens"]) for t in later]),
            "mean_prompt_tokens": statistics.fmean(t["prompt_tokens"] for t in ok) if ok else None}


def plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = doc["shared_system_prompt"]
    conc = sorted({c["concurrency"] for c in cells})
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.35
    for i, variant in enumerate(("off", "on")):
        for stat, alpha in (("ttft_p50_ms", 1.0), ("ttft_p99_ms", 0.35)):
            vals = [next(c[stat] for c in cells if c["concurrency"] == n and c["variant"] == variant) for n in conc]
            ax.bar([j + (i - 0.5) * width for j in range(len(conc))], vals, width, alpha=alpha,
                   color="C0" if variant == "off" else "C2",
                   label=f"cache {variant}, {'p50' if alpha == 1 else 'p99'}")
    ax.set_xticks(range(len(conc)), [str(n) for n in conc])
    ax.set_yscale("log")
    ax.set(xlabel="concurrency", ylabel="TTFT (ms, log scale)", title="Shared system prompt: TTFT")
    ax.legend(fontsize=8)
    conv = doc["multi_turn"]
    names = [c["variant"] for c in conv]
    bx.bar(range(len(conv)), [c["hit_rate"] for c in conv], color="C2")
    bx.axhline(0.8, color="k", ls="--", lw=1)
    bx.set_xticks(range(len(conv)), names)
    bx.set(ylim=(0, 1), ylabel="prefix-cache hit rate (tokens)", title="Multi-turn chats: hit rate")
    fig.suptitle(f"{doc['meta']['model']} on {doc['meta']['machine']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--out", default="docs/benchmarks/prefix_caching.json")
    ap.add_argument("--port", type=int, default=8455)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests-per-user", type=int, default=3, help="shared prompt: requests per user and cell")
    ap.add_argument("--min-requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=8, help="shared prompt: tokens per answer (TTFT is the point)")
    ap.add_argument("--conversations", type=int, default=12)
    ap.add_argument("--conversation-concurrency", type=int, default=4)
    ap.add_argument("--reply-tokens", type=int, default=48)
    ap.add_argument("--replica-cpus", type=float, default=0.25)
    ap.add_argument("--startup-timeout-s", type=float, default=900)
    a = ap.parse_args(argv)

    out = Path(a.out)
    work = Path(tempfile.gettempdir()) / f"prefix_bench_{a.port}"  # the generated config and the server's log
    work.mkdir(parents=True, exist_ok=True)
    cfg_path = work / "serve.yaml"
    cfg_path.write_text(yaml.safe_dump(bench_config(launch.load_serve_config(a.config), a.port, a.replica_cpus)))
    base = f"http://127.0.0.1:{a.port}"
    # A Ray instance of its own (never another session's), in a temp dir of its own
    env = {"RAY_TMPDIR": str(work / "ray")}
    cmd = ["serve", "run", "--address", "local", str(cfg_path)]
    concurrency = [int(x) for x in a.concurrency.split(",")]
    prompts = shared_system_prompt()
    convs = conversations(a.conversations)
    doc: dict[str, Any] = {"meta": {
        "command": "python -m peagle_loadtest.prefix_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": a.config, "model": launch.load_serve_config(a.config)["applications"][0]["args"].get("model"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores (shared with other sessions)",
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
        "system_prompt_chars": len(prompts[0].messages[0]["content"]), "max_tokens": a.max_tokens,
        "reply_tokens": a.reply_tokens, "replica_cpus": a.replica_cpus}}
    with launch.ServeProcess(cmd, base + "/on", work / "serve.log", startup_timeout_s=a.startup_timeout_s, env=env):
        for name in VARIANTS:
            launch.wait_ready(f"{base}/{name}", a.startup_timeout_s)
        model = requests.get(f"{base}/on/v1/models", timeout=30).json()["data"][0]["id"]
        for name in VARIANTS:  # first requests pay one-time costs (and fill the caches with the system prompt)
            shared_cell(f"{base}/{name}", model, prompts[-2:], 1, a.max_tokens)
        cells, used = [], 0
        for i, n in enumerate(concurrency):
            k = max(a.min_requests, n * a.requests_per_user)
            batch = [prompts[(used + j) % (len(prompts) - 2)] for j in range(k)]  # fresh questions per cell
            used += k
            for variant in (("on", "off") if i % 2 == 0 else ("off", "on")):  # alternate who goes first
                cell = {"variant": variant, "concurrency": n} | shared_cell(f"{base}/{variant}", model, batch, n,
                                                                            a.max_tokens)
                print(json.dumps(cell), flush=True)
                cells.append(cell)
        doc["shared_system_prompt"] = cells
        doc["multi_turn"] = []
        for variant in ("on", "affinity2", "pow2"):
            cell = {"variant": variant} | conversation_cell(f"{base}/{variant}", model, convs,
                                                            a.conversation_concurrency, a.reply_tokens)
            print(json.dumps(cell), flush=True)
            doc["multi_turn"].append(cell)
    ratios = {}
    for n in concurrency:
        on, off = (next(c for c in doc["shared_system_prompt"] if c["variant"] == v and c["concurrency"] == n)
                   for v in ("on", "off"))
        if on["ttft_p50_ms"] and off["ttft_p50_ms"]:
            ratios[str(n)] = round(on["ttft_p50_ms"] / off["ttft_p50_ms"], 3)
    doc["ttft_p50_on_over_off"] = ratios
    out.write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, out.with_suffix(".png"))
    print(json.dumps({"ttft_p50_on_over_off": ratios,
                      "multi_turn_hit_rate": {c["variant"]: c["hit_rate"] for c in doc["multi_turn"]}}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
