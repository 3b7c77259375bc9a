"""The step loop (`EngineCore` and its batch queue), the offline `LLM` and asyncio front ends, the
tokenizer, incremental detokenizer and stop strings; never how the model runs.
"""
