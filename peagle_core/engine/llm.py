"""Offline API with vLLM's shapes: `LLM(model=..., speculative_config=...).generate(prompts, params)`."""
from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from peagle_core.config import parse_engine_config
from peagle_core.engine.llm_engine import LLMEngine
from peagle_core.engine.request import Request
from peagle_core.engine.types import CompletionOutput, RequestOutput, SamplingParams
from peagle_core.loading.tokenizer import stop_length_at, stop_string_match
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


    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = False, *, tools: list[dict] | None = None, reasoning_effort: str | None = None,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of messages) or several, rendered in harmony as the
        server renders them (with today's date and `tools`). Each output's `text` is the reply's content
        (final channel); its `reasoning` is the analysis channel and `tool_calls` the calls it made, as
        {"name", "arguments"}."""
        from peagle_core.loading.harmony import ChatDecoder
        from peagle_core.loading.tokenizer import today

        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer.json: chat needs one")
        one = isinstance(messages, (list, tuple)) and (not messages or isinstance(messages[0], dict))
        conversations = [messages] if one else list(messages)
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(
            conv, add_generation_prompt, reasoning_effort, tools=tools, current_date=today())) for conv in conversations]
        outs = self.generate(prompts, sampling_params, use_tqdm)
        stops = (sampling_params or SamplingParams()).stop
        for o in outs:
            c = o.outputs[0]
            d = ChatDecoder(self.tokenizer, stops, include_stop=(sampling_params or SamplingParams())
                            .include_stop_str_in_output).push(c.token_ids, final=True)
            c.text, c.reasoning = d.content, d.reasoning
            c.tool_calls = [{"name": t["name"], "arguments": t["arguments"]} for t in d.tool_calls]
        return outs


def normalize_prompts(prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return list(prompts)


def to_output(req: Request, tokenizer) -> RequestOutput:
    ids, p = req.output_ids, req.params
    text = tokenizer.decode(ids, p.skip_special_tokens) if tokenizer is not None else ""
    cut = stop_string_match(text, p.stop)
    if cut is not None:
        text = text[:cut + (stop_length_at(text, cut, p.stop) if p.include_stop_str_in_output else 0)]
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                         [CompletionOutput(0, text, ids, req.finish_reason, req.logprobs)], finished=req.finished,
                         spec_decode_stats=req.stats, num_cached_tokens=req.num_cached_tokens or 0,
                         metrics={"arrival_time": req.arrival_time, "first_token_time": req.first_token_time or 0.0,
                                  "finished_time": req.finished_time or 0.0, "num_preemptions": req.num_preemptions,
                                  "num_steps": req.num_steps})
