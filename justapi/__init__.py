"""JustAPI: an OpenAI-compatible LLM inference server for GGUF models."""

from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":  # imported lazily: the pure-Python scheduler must not drag torch in
        from .engine.llm import LLM

        return LLM
    raise AttributeError(name)
