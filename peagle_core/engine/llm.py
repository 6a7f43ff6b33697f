"""Offline API with vLLM's shapes: `LLM(model=..., speculative_config=...).generate(prompts, params)`."""
from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from peagle_core.config import parse_engine_config
from peagle_core.engine.llm_engine import LLMEngine
from peagle_core.engine.request import Request
from peagle_core.engine.types import CompletionOutput, RequestOutput, SamplingParams
from peagle_core.loading.tokenizer import stop_string_match
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
        prompts = normalize_prompts(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        reqs = [self.engine.add_request(f"offline-{id(self)}-{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        bar = tqdm(total=len(reqs), disable=not use_tqdm, desc="generate")
        done = 0
        while self.engine.has_work():
            self.engine.step()
            finished = sum(r.finished for r in reqs)
            bar.update(finished - done)
            done = finished
        bar.close()
        return [to_output(r, self.engine.tokenizer) for r in reqs]


def normalize_prompts(prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return list(prompts)


def to_output(req: Request, tokenizer) -> RequestOutput:
    ids = req.output_ids
    text = tokenizer.decode(ids) if tokenizer is not None else ""
    cut = stop_string_match(text, req.params.stop)
    text = text if cut is None else text[:cut]
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                         [CompletionOutput(0, text, ids, req.finish_reason)], finished=req.finished,
                         spec_decode_stats=req.stats,
                         metrics={"arrival_time": req.arrival_time, "first_token_time": req.first_token_time or 0.0,
                                  "finished_time": req.finished_time or 0.0, "num_preemptions": req.num_preemptions,
                                  "num_steps": req.num_steps})
