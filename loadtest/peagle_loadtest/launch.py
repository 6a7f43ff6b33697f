"""Start and stop one `serve run` cluster per speculation mode, for the sweep.

The mode only changes `args.speculative_config` of the serve config (vLLM's keys, plus our
`adaptive`); everything else (model, replicas, autoscaling) stays as the user wrote it:
    none      no speculative_config
    eagle3    method eagle3, autoregressive drafting (parallel_drafting false)
    peagle    method eagle3, parallel_drafting true, fixed K
    adaptive  as peagle, with adaptive true (the engine picks k <= K per step)
"""
from __future__ import annotations

import copy
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import requests
import yaml

MODES = ("none", "eagle3", "peagle", "adaptive")
_MODE_KEYS = {"eagle3": (False, False), "peagle": (True, False), "adaptive": (True, True)}


# Drafter pairs shipped in the package: the other head of the same target.
SHIPPED_SIBLINGS = {"tiny-peagle": "tiny-eagle3", "tiny-eagle3": "tiny-peagle"}


def mode_speculative_config(mode: str, base: dict[str, Any] | None, *, num_speculative_tokens: int | None = None,
                            eagle3_model: str | None = None, peagle_model: str | None = None) -> dict[str, Any] | None:
    """The speculative_config of one mode, built on the config's own (its drafter, K, ...).

    The config's drafter serves the modes of its kind (a P-EAGLE head, `parallel_drafting: true`,
    serves peagle and adaptive); the other kind needs its own head (--eagle3-model / --peagle-model),
    except for the shipped tiny pair, whose sibling is known. Running a P-EAGLE head autoregressively
    would not be the EAGLE-3 baseline, so that is never done silently.
    """
    if mode == "none":
        return None
    if mode not in _MODE_KEYS:
        raise ValueError(f"unknown speculation mode {mode!r}; choose from {', '.join(MODES)} "
                         f"or give a full config with --mode-spec NAME=JSON")
    parallel, adaptive = _MODE_KEYS[mode]
    spec = {k: v for k, v in (base or {}).items() if k != "method"}
    base_model = spec.get("model")
    base_parallel = bool(spec.get("parallel_drafting")) or (base or {}).get("method") == "peagle"
    given = eagle3_model if mode == "eagle3" else peagle_model
    if given:
        model = given
    elif base_model and base_parallel == parallel:
        model = base_model
    else:
        model = SHIPPED_SIBLINGS.get(base_model or "")
    if not model:
        flag, kind = ("--eagle3-model", "an EAGLE-3") if mode == "eagle3" else ("--peagle-model", "a P-EAGLE")
        have = f"the serve config's drafter {base_model!r} is of the other kind" if base_model else \
            "the serve config names no drafter"
        raise ValueError(f"mode {mode!r} needs {kind} drafter: {have}; pass {flag}")
    spec.update(method="eagle3", model=model, parallel_drafting=parallel, adaptive=adaptive)
    if num_speculative_tokens is not None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_speculative_tokens}")
        spec["num_speculative_tokens"] = num_speculative_tokens
    return spec


def load_serve_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"serve config {str(path)!r} does not exist")
    cfg = yaml.safe_load(path.read_text())
    apps = cfg.get("applications") if isinstance(cfg, dict) else None
    if not apps or not isinstance(apps, list):
        raise ValueError(f"serve config {str(path)!r} has no 'applications' list")
    return cfg


def base_speculative_config(cfg: dict[str, Any]) -> dict[str, Any] | None:
    return (cfg["applications"][0].get("args") or {}).get("speculative_config")


def write_mode_config(cfg: dict[str, Any], spec: dict[str, Any] | None, out_path: str | Path, *,
                      port: int, host: str = "127.0.0.1") -> Path:
    """A copy of the serve config with this mode's speculative_config and the given HTTP address."""
    cfg = copy.deepcopy(cfg)
    cfg["http_options"] = {**(cfg.get("http_options") or {}), "host": host, "port": port}
    args = cfg["applications"][0].setdefault("args", {})
    if spec is None:
        args.pop("speculative_config", None)
    else:
        args["speculative_config"] = spec
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out_path


# Lines `serve run` logs when an application cannot come up; it keeps running, so waiting longer is futile.
FAILURE_MARKERS = ("Failed to update the deployments", "DEPLOY_FAILED")


def wait_ready(base_url: str, timeout_s: float, proc: subprocess.Popen | None = None, log_path: Path | None = None) -> None:
    """Block until GET /health and GET /v1/models answer 200; fail early if the server died or failed to deploy."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready"
                               + _log_tail(log_path))
        if log_path is not None and log_path.exists():
            text = log_path.read_text(errors="replace")
            if any(m in text for m in FAILURE_MARKERS):
                raise RuntimeError("the server failed to deploy its application" + _log_tail(log_path, 4000))
        try:
            if (requests.get(base_url + "/health", timeout=5).status_code == 200
                    and requests.get(base_url + "/v1/models", timeout=5).status_code == 200):
                return
        except requests.RequestException:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"server at {base_url} not ready after {timeout_s:.0f} s" + _log_tail(log_path))


def _log_tail(log_path: Path | None, n: int = 2000) -> str:
    if log_path is None or not log_path.exists():
        return ""
    return "\n--- server log tail ---\n" + log_path.read_text(errors="replace")[-n:]


class ServeProcess:
    """A server subprocess (by default `serve run CONFIG`) in its own process group.

    Stopping sends SIGINT first, which `serve run` handles by shutting Serve and its local Ray
    down; only if that hangs does the group get SIGTERM, then SIGKILL.
    """

    def __init__(self, cmd: list[str], base_url: str, log_path: str | Path, *, startup_timeout_s: float = 600.0,
                 stop_timeout_s: float = 60.0, cwd: str | Path | None = None, env: dict[str, str] | None = None):
        self.cmd, self.base_url, self.log_path = cmd, base_url.rstrip("/"), Path(log_path)
        self.startup_timeout_s, self.stop_timeout_s = startup_timeout_s, stop_timeout_s
        self.cwd, self.env = cwd, env
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServeProcess":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # fresh: failure markers of an older run must not count
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.cwd,
                                     env={**os.environ, **(self.env or {})}, start_new_session=True)
        try:
            wait_ready(self.base_url, self.startup_timeout_s, self.proc, self.log_path)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            for sig, wait_s in ((signal.SIGINT, self.stop_timeout_s), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
                try:
                    if sig == signal.SIGINT:
                        proc.send_signal(sig)
                    else:
                        os.killpg(proc.pid, sig)  # the group we created: serve run and what it started
                except ProcessLookupError:
                    break
                try:
                    proc.wait(wait_s)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # Ray's replicas run in process groups of their own but stay in our session: end them all, then
        # wait until the port is closed, so the next server (possibly on the same port) is not confused
        # with a proxy of this one that is still shutting down.
        kill_session(proc.pid)
        wait_closed(self.base_url, timeout_s=30.0)
        self._log.close()
        self.proc = None


def kill_session(sid: int) -> None:
    """SIGKILL every process whose session id is `sid` (Linux /proc; elsewhere the group only)."""
    try:
        os.killpg(sid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid:  # fields after the command: state ppid pgrp session ...
                os.kill(int(stat.parent.name), signal.SIGKILL)
        except (OSError, ValueError, IndexError):
            continue


def wait_closed(base_url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            requests.get(base_url + "/health", timeout=1)
        except requests.RequestException:
            return
        time.sleep(0.5)
