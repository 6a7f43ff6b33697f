"""P-EAGLE serving core: GPT-OSS target, EAGLE-3/P-EAGLE drafters and the speculative engine."""
from peagle_core.engine.llm import LLM
from peagle_core.engine.types import CompletionOutput, RequestOutput, SamplingParams, SpecDecodeStats

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "SpecDecodeStats"]
