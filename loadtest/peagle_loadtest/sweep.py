"""Concurrency x speculation-mode sweep: Locust headless per cell, then CSV/JSON/PNG/markdown.

Against a running server (one mode, labelled with --label):
    python -m peagle_loadtest.sweep --host http://127.0.0.1:8000 --concurrency 1,2,4,8 --duration 30
Against servers already running per mode:
    python -m peagle_loadtest.sweep --mode-host none=http://127.0.0.1:8000 --mode-host peagle=http://127.0.0.1:8001
Starting one `serve run` cluster per mode from a config (speculative_config overridden per mode):
    python -m peagle_loadtest.sweep --config configs/tiny.yaml --modes none,eagle3,peagle,adaptive \
        --concurrency 1,2,4,8,16,32,64 --duration 30 --workload mtbench --max-tokens 128

Each cell is a closed-loop Locust run with C users (C requests in flight) for --duration seconds;
users finish their last request (bounded by --stop-timeout), and the whole cell by --cell-timeout.
Outputs in --out: sweep.json, sweep.csv, summary.md, *_vs_concurrency.png, cells/<mode>-c<C>/
(Locust's CSV files, its log and records.jsonl with one line per request).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from tqdm import tqdm

from peagle_loadtest import launch, report, server_metrics
from peagle_loadtest.stats import read_records, summarize
from peagle_loadtest.stream import build_request, stream_request
from peagle_loadtest.workloads import WORKLOADS, load_workload

LOCUSTFILE = Path(__file__).with_name("locustfile.py")
# The folder holding this package: Locust subprocesses import it from there in a bare checkout too.
PACKAGE_PARENT = Path(__file__).resolve().parent.parent


@dataclass
class LoadOptions:
    """What every cell sends (passed through to the Locust user)."""

    workload: str = "synthetic"
    endpoint: str = "chat"
    max_tokens: int = 128
    temperature: float = 0.0
    model: str = ""
    api_key: str = ""
    synthetic_input_len: int = 128
    num_prompts: int | None = None
    ignore_eos: bool = False
    seed: int = 0
    request_timeout: float = 600.0

    def locust_args(self) -> list[str]:
        a = ["--workload", self.workload, "--endpoint", self.endpoint, "--max-tokens", str(self.max_tokens),
             "--temperature", str(self.temperature), "--synthetic-input-len", str(self.synthetic_input_len),
             "--seed", str(self.seed), "--request-timeout", str(self.request_timeout)]
        if self.model:
            a += ["--model", self.model]
        if self.num_prompts is not None:
            a += ["--num-prompts", str(self.num_prompts)]
        if self.ignore_eos:
            a.append("--ignore-eos")
        return a


@dataclass
class CellPlan:
    duration_s: float
    spawn_rate: float | None = None  # None: all users within one second
    stop_timeout_s: float = 30.0
    cell_timeout_s: float | None = None  # None: duration + stop timeout + 60 s

    def timeout(self) -> float:
        return self.cell_timeout_s or self.duration_s + self.stop_timeout_s + 60.0


@dataclass
class Target:
    """One speculation mode and how to reach it: a running URL, or a serve config to start."""

    mode: str
    url: str | None = None
    config_path: Path | None = None  # written per mode; started with serve_cmd
    serve_cmd: list[str] = field(default_factory=list)


def parse_concurrency(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency must be a comma list of integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--concurrency values must be >= 1, got {text!r}")
    return sorted(set(values))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# One cell
# ---------------------------------------------------------------------------------------------


def _count_lines(path: Path) -> tuple[int, int]:
    """(ok, failed) requests so far, read from the records file Locust appends to."""
    ok = bad = 0
    if path.exists():
        with open(path, "rb") as f:
            for line in f:
                if b'"ok": true' in line:
                    ok += 1
                elif line.strip():
                    bad += 1
    return ok, bad


def _auth(api_key: str) -> dict[str, str] | None:
    return {"Authorization": f"Bearer {api_key}"} if api_key else None


def run_cell(url: str, concurrency: int, load: LoadOptions, plan: CellPlan, cell_dir: Path,
             metrics_url: str | None = None, bar: tqdm | None = None) -> dict[str, Any]:
    """Run Locust headless for one (server, concurrency) and summarise its records."""
    cell_dir.mkdir(parents=True, exist_ok=True)
    records = cell_dir / "records.jsonl"
    records.unlink(missing_ok=True)
    spawn = plan.spawn_rate or concurrency
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--only-summary",
           "-u", str(concurrency), "-r", str(spawn), "-t", f"{plan.duration_s:g}s",
           "--stop-timeout", f"{plan.stop_timeout_s:g}", "--host", url, "--csv", str(cell_dir / "locust"),
           "--records-file", str(records), "--loglevel", "WARNING", *load.locust_args()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PACKAGE_PARENT), os.environ.get("PYTHONPATH", "")])}
    if load.api_key:
        env["PEAGLE_API_KEY"] = load.api_key  # not on the command line, which `ps` shows
    before = server_metrics.fetch_counters(metrics_url, headers=_auth(load.api_key)) if metrics_url else None
    t0 = time.monotonic()
    status = "ok"
    with open(cell_dir / "locust.log", "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            while proc.poll() is None:
                elapsed = time.monotonic() - t0
                if elapsed > plan.timeout():
                    status = "timeout"
                    break
                if bar is not None:
                    ok, bad = _count_lines(records)
                    bar.set_postfix_str(f"c={concurrency} {elapsed:4.0f}s ok={ok} failed={bad}")
                time.sleep(0.5)
        finally:  # timeout or Ctrl-C: Locust runs in its own session, so it must be ended here
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    after = server_metrics.fetch_counters(metrics_url, headers=_auth(load.api_key)) if metrics_url else None
    recs = read_records(records)
    if status == "ok" and proc.returncode not in (0, 1):  # 1 only means "some requests failed"
        status = f"locust exit {proc.returncode}"
    summary = summarize(recs)
    if status == "ok" and summary["completed"] == 0:
        status = "no completed requests"
    acc = server_metrics.acceptance(before, after)
    acc["acceptance_source"] = "server metrics" if acc["acceptance_length"] is not None else None
    if acc["acceptance_length"] is None and summary.get("client_acceptance_length") is not None:
        acc.update(acceptance_length=summary["client_acceptance_length"],
                   draft_acceptance_rate=summary.get("client_draft_acceptance_rate"), acceptance_source="responses")
    return {"concurrency": concurrency, "status": status, "locust_exit_code": proc.returncode,
            "cell_dir": str(cell_dir), **summary, **acc}


# ---------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------


def find_metrics_url(base_url: str, explicit: str | None, api_key: str = "") -> str | None:
    """The server's spec-decode counters: --metrics-url, else the first candidate that has them
    (the cluster's JSON `/v1/stats`, or Prometheus text at `/metrics`)."""
    if explicit:
        return None if explicit == "none" else explicit
    for path in ("/v1/stats", "/metrics"):
        if server_metrics.fetch_counters(base_url + path, timeout=5, headers=_auth(api_key)) is not None:
            return base_url + path
    return None


def warm_up(url: str, load: LoadOptions, n: int) -> None:
    """A few requests before measuring (first requests pay for lazy initialisation)."""
    if n <= 0:
        return
    model = load.model or _first_model(url, load.api_key)
    prompts = load_workload(load.workload, limit=n, synthetic_input_len=load.synthetic_input_len, seed=load.seed + 1)
    headers = _auth(load.api_key)
    with requests.Session() as s:
        for p in prompts:
            path, body = build_request(load.endpoint, model, list(p.messages) if load.endpoint == "chat" else p.text,
                                       max_tokens=min(load.max_tokens, 16), temperature=load.temperature)
            stream_request(s, url, path, body, headers=headers, timeout=load.request_timeout)


def _first_model(url: str, api_key: str) -> str:
    r = requests.get(url + "/v1/models", headers=_auth(api_key), timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def run_sweep(targets: list[Target], concurrency: list[int], load: LoadOptions, plan: CellPlan, out_dir: Path, *,
              metrics_url: str | None = None, warmup_requests: int = 2, startup_timeout_s: float = 600.0,
              label: str = "", command: str | None = None) -> dict[str, Any]:
    """Run every (mode, concurrency) cell and write sweep.json/.csv, plots and summary.md into out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"meta": _meta(targets, load, plan, label, command), "cells": []}
    cells: list[dict[str, Any]] = doc["cells"]
    bar = tqdm(total=len(targets) * len(concurrency), unit="cell", dynamic_ncols=True, file=sys.stderr)
    tqdm.write(_live_header(), file=sys.stderr)
    try:
        for target in targets:
            bar.set_description(target.mode)
            try:
                with _serving(target, out_dir, startup_timeout_s) as url:
                    murl = find_metrics_url(url, metrics_url, load.api_key)
                    warm_up(url, load, warmup_requests)
                    for c in concurrency:
                        cell = run_cell(url, c, load, plan, out_dir / "cells" / f"{target.mode}-c{c}", murl, bar)
                        cell = {"mode": target.mode, **cell}
                        cells.append(cell)
                        tqdm.write(_live_row(cell), file=sys.stderr)
                        bar.update(1)
                        _write_outputs(doc, out_dir, plots=False)
            except (RuntimeError, TimeoutError, requests.RequestException, ValueError) as e:
                # one mode failing to start must not lose the others' results
                tqdm.write(f"mode {target.mode}: {e}", file=sys.stderr)
                done = {c["concurrency"] for c in cells if c["mode"] == target.mode}
                for c in concurrency:
                    if c not in done:
                        cells.append({"mode": target.mode, "concurrency": c, "status": f"server failed: {e}"[:300]})
                        bar.update(1)
    finally:
        bar.close()
        _write_outputs(doc, out_dir, plots=True)
    return doc


class _serving:
    """Context manager giving the base URL of a target, starting its server if needed."""

    def __init__(self, target: Target, out_dir: Path, startup_timeout_s: float):
        self.target, self.out_dir, self.startup_timeout_s = target, out_dir, startup_timeout_s
        self.proc: launch.ServeProcess | None = None

    def __enter__(self) -> str:
        t = self.target
        if t.url:
            launch.wait_ready(t.url.rstrip("/"), min(self.startup_timeout_s, 30.0))
            return t.url.rstrip("/")
        cfg = launch.load_serve_config(t.config_path)
        http = cfg.get("http_options") or {}
        host = http.get("host", "127.0.0.1")
        url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '::') else host}:{http.get('port', 8000)}"
        cmd = [a.replace("{config}", str(t.config_path)) for a in t.serve_cmd]
        self.proc = launch.ServeProcess(cmd, url, self.out_dir / "servers" / f"{t.mode}.log",
                                        startup_timeout_s=self.startup_timeout_s)
        self.proc.__enter__()
        return url

    def __exit__(self, *exc: Any) -> None:
        if self.proc is not None:
            self.proc.stop()


def _write_outputs(doc: dict[str, Any], out_dir: Path, plots: bool) -> None:
    report.write_json(doc, out_dir / "sweep.json")
    report.write_csv(doc["cells"], out_dir / "sweep.csv")
    measured = [c for c in doc["cells"] if c.get("completed")]
    pngs = report.plot(measured, out_dir) if plots and measured else []
    report.write_markdown(doc, out_dir / "summary.md", pngs)


def _live_header() -> str:
    return f"{'mode':>10} {'conc':>5} {'ok':>6} {'fail':>5} {'req/s':>7} {'tok/s':>8} {'TTFT50':>8} {'TPOT50':>8} {'acc.len':>7}"


def _live_row(c: dict[str, Any]) -> str:
    f = report._fmt
    return (f"{c['mode']:>10} {c['concurrency']:>5} {f(c.get('completed')):>6} {f(c.get('failed')):>5} "
            f"{f(c.get('request_throughput'), 2):>7} {f(c.get('output_throughput')):>8} "
            f"{f(c.get('median_ttft_ms')):>8} {f(c.get('median_tpot_ms'), 2):>8} {f(c.get('acceptance_length'), 2):>7}"
            + ("" if c.get("status") == "ok" else f"  [{c.get('status')}]"))


def _meta(targets: list[Target], load: LoadOptions, plan: CellPlan, label: str, command: str | None) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version  # never `import locust`: it patches gevent in

    versions = {"python": platform.python_version()}
    for dist in ("peagle", "locust", "ray", "torch"):
        try:
            versions[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return {"label": label, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "target": {t.mode: (t.url or str(t.config_path)) for t in targets}, "workload": load.workload,
            "endpoint": load.endpoint, "max_tokens": load.max_tokens, "temperature": load.temperature,
            "duration_s_per_cell": plan.duration_s, "machine": f"{platform.node()} {platform.machine()} "
            f"{os.cpu_count()} CPUs", "versions": versions, "command": command,
            "load": load.__dict__}


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m peagle_loadtest.sweep", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    where = p.add_argument_group("what to load")
    where.add_argument("--host", help="base URL of a running server (one mode)")
    where.add_argument("--label", default="", help="mode name for --host (default: 'running')")
    where.add_argument("--mode-host", action="append", default=[], metavar="MODE=URL",
                       help="a running server per mode (repeat)")
    where.add_argument("--config", help="serve config to start once per mode with `serve run`")
    where.add_argument("--modes", default="none,eagle3,peagle,adaptive",
                       help=f"modes for --config, from {','.join(launch.MODES)} (default: all)")
    where.add_argument("--mode-spec", action="append", default=[], metavar="NAME=JSON",
                       help="an extra mode with a full speculative_config, e.g. peagle-k3='{...}' (repeat)")
    where.add_argument("--num-speculative-tokens", type=int, default=None, help="K for the speculative modes")
    where.add_argument("--eagle3-model", default=None, help="EAGLE-3 drafter (default: the config's)")
    where.add_argument("--peagle-model", default=None, help="P-EAGLE drafter (default: the config's)")
    where.add_argument("--port", type=int, default=0, help="HTTP port of started servers (default: a free one)")
    where.add_argument("--serve-cmd", default="serve run {config}", help="command that serves a config")
    where.add_argument("--startup-timeout", type=float, default=600.0, help="seconds for a server to be ready")

    grid = p.add_argument_group("grid and timing")
    grid.add_argument("--concurrency", default="1,2,4,8,16,32,64", help="comma list of concurrent users")
    grid.add_argument("--duration", type=float, default=30.0, help="seconds of load per cell")
    grid.add_argument("--spawn-rate", type=float, default=None, help="users started per second (default: all)")
    grid.add_argument("--stop-timeout", type=float, default=30.0,
                      help="seconds users get to finish their last request after --duration")
    grid.add_argument("--cell-timeout", type=float, default=None,
                      help="hard limit per cell (default: duration + stop timeout + 60)")
    grid.add_argument("--warmup-requests", type=int, default=2, help="requests sent per mode before measuring")
    grid.add_argument("--metrics-url", default=None,
                      help="URL of spec-decode counters (Prometheus text or JSON); 'none' to skip "
                           "(default: try <host>/v1/stats, then <host>/metrics)")

    req = p.add_argument_group("requests")
    req.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    req.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    req.add_argument("--max-tokens", type=int, default=128)
    req.add_argument("--temperature", type=float, default=0.0)
    req.add_argument("--model", default="")
    req.add_argument("--api-key", default=os.environ.get("PEAGLE_API_KEY", ""))
    req.add_argument("--synthetic-input-len", type=int, default=128)
    req.add_argument("--num-prompts", type=int, default=None)
    req.add_argument("--ignore-eos", action="store_true")
    req.add_argument("--seed", type=int, default=0)
    req.add_argument("--request-timeout", type=float, default=600.0)

    p.add_argument("--out", default=None, help="output folder (default: results/sweep-<UTC time>)")
    return p


def targets_from_args(a: argparse.Namespace, out_dir: Path) -> list[Target]:
    sources = sum(bool(x) for x in (a.host, a.mode_host, a.config))
    if sources != 1:
        raise ValueError("give exactly one of --host, --mode-host or --config")
    if a.host:
        return [Target(a.label or "running", url=a.host)]
    if a.mode_host:
        targets = []
        for item in a.mode_host:
            mode, sep, url = item.partition("=")
            if not sep or not mode or not url:
                raise ValueError(f"--mode-host must be MODE=URL, got {item!r}")
            targets.append(Target(mode, url=url))
        return targets
    cfg = launch.load_serve_config(a.config)
    base = launch.base_speculative_config(cfg)
    specs: dict[str, dict[str, Any] | None] = {}
    for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
        specs[mode] = launch.mode_speculative_config(mode, base, num_speculative_tokens=a.num_speculative_tokens,
                                                     eagle3_model=a.eagle3_model, peagle_model=a.peagle_model)
    for item in a.mode_spec:
        name, sep, text = item.partition("=")
        try:
            specs[name] = json.loads(text) if sep else None
        except ValueError as e:
            raise ValueError(f"--mode-spec {name}: not valid JSON ({e})") from None
        if not sep or not name or not isinstance(specs[name], (dict, type(None))):
            raise ValueError(f"--mode-spec must be NAME=JSON-object, got {item!r}")
    if not specs:
        raise ValueError("no modes to run: --modes is empty")
    port = a.port or free_port()
    serve_cmd = shlex.split(a.serve_cmd)
    return [Target(mode, config_path=launch.write_mode_config(cfg, spec, out_dir / "configs" / f"{mode}.yaml",
                                                              port=port), serve_cmd=serve_cmd)
            for mode, spec in specs.items()]


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    out_dir = Path(a.out or f"results/sweep-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}")
    try:
        concurrency = parse_concurrency(a.concurrency)
        if a.duration <= 0:
            raise ValueError(f"--duration must be positive, got {a.duration}")
        load = LoadOptions(a.workload, a.endpoint, a.max_tokens, a.temperature, a.model, a.api_key,
                           a.synthetic_input_len, a.num_prompts, a.ignore_eos, a.seed, a.request_timeout)
        if load.max_tokens < 1:
            raise ValueError(f"--max-tokens must be at least 1, got {load.max_tokens}")
        load_workload(load.workload, limit=1, synthetic_input_len=load.synthetic_input_len)  # fail fast
        targets = targets_from_args(a, out_dir)
    except (ValueError, RuntimeError) as e:  # MissingDatasetError is a RuntimeError
        p.error(str(e))
    plan = CellPlan(a.duration, a.spawn_rate, a.stop_timeout, a.cell_timeout)
    command = "python -m peagle_loadtest.sweep " + " ".join(shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:]))
    doc = run_sweep(targets, concurrency, load, plan, out_dir, metrics_url=a.metrics_url,
                    warmup_requests=a.warmup_requests, startup_timeout_s=a.startup_timeout, label=a.label,
                    command=command.replace(a.api_key, "***") if a.api_key else command)
    print(f"\nwrote {out_dir}/sweep.json, sweep.csv, summary.md and plots\n", file=sys.stderr)
    print(report.markdown_table(doc["cells"]))
    return 0 if all(c.get("status") == "ok" for c in doc["cells"]) else 1


if __name__ == "__main__":
    sys.exit(main())
