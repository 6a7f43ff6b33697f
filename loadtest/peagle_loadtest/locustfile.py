"""Locust user that streams OpenAI chat/completions requests and reports LLM latency figures.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000                  # web UI on :8089
    locust -f loadtest/locustfile.py --host http://127.0.0.1:8000 --headless -u 8 -r 8 -t 60s \
        --workload mtbench --max-tokens 128 --csv results/run

Besides the HTTP request itself (its response time is the end-to-end latency), every successful
request fires request events of type "METRIC" so the web UI, the console table and the --csv files
show their percentiles (all in ms, definitions in loadtest/stream.py, as `vllm bench serve`):
  ttft, tpot (usage-based), itl (one event per chunk gap), e2el, and output_tokens (a count, shown
  in the ms columns). HTTP errors, connection errors, error events in the stream, a missing
  `data: [DONE]` and empty answers are failures of the HTTP request.
--records-file writes one JSON line per request (exact values; Locust's own table rounds to whole ms).
"""
from __future__ import annotations

import itertools
import json
import logging
import sys
import threading
import time
from typing import Any, Iterator

from locust import HttpUser, events, task
from locust.exception import StopUser

try:
    import peagle_loadtest  # noqa: F401  (installed with the project)
except ImportError:  # a bare checkout, e.g. mounted into a Locust container: import from the repo root
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from peagle_loadtest.stream import RequestRecord, build_request, consume_stream
from peagle_loadtest.workloads import WORKLOADS, MissingDatasetError, Prompt, load_workload

log = logging.getLogger("loadtest")


@events.init_command_line_parser.add_listener
def _add_arguments(parser: Any) -> None:
    g = parser  # (argument groups do not accept include_in_web_ui)
    g.add_argument("--workload", choices=WORKLOADS, default="synthetic", env_var="PEAGLE_WORKLOAD",
                   include_in_web_ui=True, help="prompt source (default: synthetic)")
    g.add_argument("--endpoint", choices=("chat", "completions"), default="chat", env_var="PEAGLE_ENDPOINT",
                   include_in_web_ui=True, help="/v1/chat/completions or /v1/completions")
    g.add_argument("--max-tokens", type=int, default=128, env_var="PEAGLE_MAX_TOKENS", include_in_web_ui=True)
    g.add_argument("--temperature", type=float, default=0.0, env_var="PEAGLE_TEMPERATURE", include_in_web_ui=True)
    g.add_argument("--model", default="", env_var="PEAGLE_MODEL", include_in_web_ui=True,
                   help="model id (default: the first one GET /v1/models lists)")
    g.add_argument("--api-key", default="", env_var="PEAGLE_API_KEY", include_in_web_ui=False,
                   help="sent as 'Authorization: Bearer ...' when set")
    g.add_argument("--synthetic-input-len", type=int, default=128, env_var="PEAGLE_SYNTHETIC_INPUT_LEN",
                   include_in_web_ui=True, help="words per synthetic prompt (about one token each)")
    g.add_argument("--ignore-eos", action="store_true", default=False, env_var="PEAGLE_IGNORE_EOS",
                   help="ask for exactly --max-tokens tokens (vLLM's ignore_eos extension)")
    g.add_argument("--num-prompts", type=int, default=None, env_var="PEAGLE_NUM_PROMPTS",
                   help="use only this many prompts of the workload")
    g.add_argument("--seed", type=int, default=0, env_var="PEAGLE_SEED", help="prompt order")
    g.add_argument("--request-timeout", type=float, default=600.0, env_var="PEAGLE_REQUEST_TIMEOUT",
                   help="seconds before a request counts as failed")
    g.add_argument("--records-file", default="", env_var="PEAGLE_RECORDS_FILE",
                   help="append one JSON line per request (used by peagle_loadtest.sweep)")


class _Shared:
    """Per-process state every user shares: the prompt cycle, the model id, the records file."""

    lock = threading.Lock()
    prompts: Iterator[Prompt] | None = None
    options_key: tuple | None = None
    model: str | None = None
    records: Any = None


def _prompts(opts: Any) -> Iterator[Prompt]:
    key = (opts.workload, opts.synthetic_input_len, opts.num_prompts, opts.seed)
    with _Shared.lock:
        if _Shared.prompts is None or _Shared.options_key != key:  # the web UI may change the workload
            prompts = load_workload(opts.workload, limit=opts.num_prompts,
                                    synthetic_input_len=opts.synthetic_input_len, seed=opts.seed)
            if not prompts:
                raise ValueError(f"workload {opts.workload!r} produced no prompts")
            _Shared.prompts, _Shared.options_key = itertools.cycle(prompts), key
        return _Shared.prompts


def _check_options(opts: Any) -> str | None:
    """Why these options cannot run (None: they can); loads the prompts as a side effect."""
    if opts.max_tokens < 1:
        return f"--max-tokens must be at least 1, got {opts.max_tokens}"
    if opts.request_timeout <= 0:
        return f"--request-timeout must be positive, got {opts.request_timeout}"
    try:
        _prompts(opts)
    except (MissingDatasetError, ValueError) as e:
        return str(e)
    return None


@events.init.add_listener
def _on_init(environment: Any, **_: Any) -> None:
    opts = environment.parsed_options
    if opts is None:  # used as a library without Locust's parser
        return
    problem = _check_options(opts)
    if problem:
        log.error("load test cannot start: %s", problem)
        sys.exit(2)


@events.test_start.add_listener
def _on_test_start(environment: Any, **_: Any) -> None:
    opts = environment.parsed_options
    if opts is None:
        return
    problem = _check_options(opts)  # the web UI may have changed the options since init
    if problem:
        log.error("load test cannot start: %s", problem)
        environment.process_exit_code = 2
        import gevent  # stopping from inside the hook would kill the greenlet running it

        gevent.spawn_later(0.1, environment.runner.quit if opts.headless else environment.runner.stop)
        return
    if opts.records_file and _Shared.records is None:
        _Shared.records = open(opts.records_file, "a", encoding="utf-8")


@events.quitting.add_listener
def _on_quit(environment: Any, **_: Any) -> None:
    if _Shared.records is not None:
        _Shared.records.close()
        _Shared.records = None


class OpenAIStreamingUser(HttpUser):
    """One closed-loop client: sends a streamed request, waits for the whole answer, repeats.

    HttpUser (requests) rather than FastHttpUser: with `iter_content(chunk_size=None)` requests hands
    over each HTTP chunk as it arrives, while geventhttpclient's read(n) waits for n bytes, which
    would shift every TTFT/ITL timestamp. For many users, run several processes (`--processes -1`).
    """

    wait_time = staticmethod(lambda: 0.0)  # closed loop: concurrency == number of users

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
        with _Shared.lock:
            if opts.model:
                _Shared.model = opts.model
        if _Shared.model is None:
            _Shared.model = self._discover_model()

    def _discover_model(self) -> str:
        with self.client.get("/v1/models", headers=self.headers, name="/v1/models", catch_response=True,
                             timeout=30) as resp:
            try:
                resp.raise_for_status()
                model = resp.json()["data"][0]["id"]
                resp.success()
                return model
            except Exception as e:
                resp.failure(f"cannot list models: {e}")
                raise StopUser() from None

    @task
    def generate(self) -> None:
        opts = self.environment.parsed_options
        prompt = next(_prompts(opts))
        path, body = build_request(opts.endpoint, _Shared.model or "", list(prompt.messages)
                                   if opts.endpoint == "chat" else prompt.text, max_tokens=opts.max_tokens,
                                   temperature=opts.temperature, ignore_eos=opts.ignore_eos)
        start_time, t_start = time.time(), time.perf_counter()
        with self.client.post(path, json=body, headers=self.headers, stream=True, catch_response=True,
                              name=path, timeout=opts.request_timeout) as resp:
            if resp.status_code == 0 or getattr(resp, "error", None):  # no HTTP response at all
                rec = RequestRecord(ok=False, error=f"connection failed: {getattr(resp, 'error', '')}",
                                    start_time=start_time, e2el_ms=(time.perf_counter() - t_start) * 1000)
            else:
                rec = consume_stream(resp, t_start, start_time)
            resp.request_meta["response_time"] = rec.e2el_ms  # streamed: time to the end, not to headers
            resp.request_meta["response_length"] = rec.text_chars
            if rec.ok:
                resp.success()
            else:
                resp.failure(rec.error)
        self._report(rec)

    def _report(self, rec: RequestRecord) -> None:
        if _Shared.records is not None:
            _Shared.records.write(json.dumps(rec.to_json()) + "\n")
            _Shared.records.flush()
        if not rec.ok:
            return
        if not rec.usage_reported and not getattr(_Shared, "warned_usage", False):
            _Shared.warned_usage = True
            log.warning("server sent no usage.completion_tokens; TPOT uses the chunk count, which undercounts "
                        "tokens under speculative decoding")
        fire = self.environment.events.request.fire
        metric = dict(request_type="METRIC", response_length=0, exception=None, context={})
        fire(name="ttft", response_time=rec.ttft_ms, **metric)
        if rec.tpot_ms is not None:
            fire(name="tpot", response_time=rec.tpot_ms, **metric)
        for gap in rec.itl_ms:
            fire(name="itl", response_time=gap, **metric)
        fire(name="e2el", response_time=rec.e2el_ms, **metric)
        fire(name="output_tokens", response_time=rec.output_tokens, **metric)

