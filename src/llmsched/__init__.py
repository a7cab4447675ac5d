"""llmsched: an LLM serving engine built around an exact, explainable step scheduler."""

__version__ = "0.1.0"

# The engine and offline API load on first use, so `import llmsched.core`
# (and plain `import llmsched`) stays fast and free of torch.
_LAZY = {
    "LLM": "llmsched.engine.llm",
    "LLMEngine": "llmsched.engine.llm_engine",
    "EngineArgs": "llmsched.engine.args",
    "RequestOutput": "llmsched.engine.outputs",
    "CompletionOutput": "llmsched.engine.outputs",
    "LoRARequest": "llmsched.engine.lora_request",
    "SamplingParams": "llmsched.core.sampling_params",
    "StructuredOutputsParams": "llmsched.core.structured_params",
    "StreamingInput": "llmsched.engine.sessions",
    "LLMSession": "llmsched.engine.llm_session",
    "SessionClosedError": "llmsched.engine.llm_session",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'llmsched' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
