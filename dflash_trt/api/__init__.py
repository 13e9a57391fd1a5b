"""The Python front door: `LLM` over a Runtime on strings, `SamplingParams`, chat templates."""
