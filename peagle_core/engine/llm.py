"""Offline API with vLLM's shapes: `LLM(model=..., speculative_config=...).generate(prompts, params)`."""
from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from peagle_core.config import parse_engine_config
from peagle_core.engine.llm_engine import LLMEngine
from peagle_core.engine.output import final_output
from peagle_core.engine.types import RequestOutput, SamplingParams
from peagle_core.depth.policy import DepthPolicy


class LLM:
    def __init__(self, model: str = "tiny", *, policy: DepthPolicy | None = None, **engine_args: Any):
        self.engine = LLMEngine(parse_engine_config(model=model, **engine_args), policy=policy)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """One RequestOutput per prompt, with `n` outputs each (independent samples; seeded: sample i has
        seed + i, so it is the single request with that seed)."""
        return self._run(normalize_prompts(prompts), sampling_params, use_tqdm, None)

    def _run(self, prompts: list[str | list[int]], sampling_params, use_tqdm: bool,
             chat_prefix: str | None) -> list[RequestOutput]:
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        groups = [[self.engine.add_request(f"offline-{id(self)}-{i}-{j}", p, sp.sample(j), chat_prefix)
                   for j in range(sp.n)] for i, (p, sp) in enumerate(zip(prompts, params))]
        reqs = [r for g in groups for r in g]
        bar = tqdm(total=len(reqs), disable=not use_tqdm, desc="generate")
        done = 0
        while self.engine.has_work():
            self.engine.step()
            finished = sum(r.finished for r in reqs)
            bar.update(finished - done)
            done = finished
        bar.close()
        return [final_output(f"offline-{id(self)}-{i}", g) for i, g in enumerate(groups)]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False, *, tools: list[dict] | None = None, reasoning_effort: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of messages) or several, rendered in harmony as the
        server renders them (with today's date and `tools`). Each output's `text` is the reply's content
        (final channel); its `reasoning` is the analysis channel and `tool_calls` the calls it made, as
        {"name", "arguments"}."""
        from peagle_core.loading.tokenizer import today

        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer.json: chat needs one")
        one = isinstance(messages, (list, tuple)) and (not messages or isinstance(messages[0], dict))
        conversations = [messages] if one else list(messages)
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(
            conv, add_generation_prompt, reasoning_effort, tools=tools, current_date=today())) for conv in conversations]
        return self._run(prompts, sampling_params, use_tqdm, chat_prefix="")


def normalize_prompts(prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return list(prompts)
