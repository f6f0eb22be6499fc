"""What a request may ask for at all: its prompt plus its output within the model's context and within one KV pool.
Checked as a request arrives, before it is queued (a 4xx naming the limit), by the scheduler and by the engines that
route to workers or replicas (against the smallest pool among them)."""

from __future__ import annotations

from dataclasses import dataclass


class AdmissionError(ValueError):
    """A request that can never be served with this configuration (too long for the context or the pool)."""


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int  # tokens of context, output included
    num_blocks: int  # the KV pool a request must fit in whole
    block_size: int

    def check(self, num_prompt_tokens: int, max_tokens: int | None, prompt_only: bool = False) -> int:
        """Raise AdmissionError if such a request could never fit; return its max_tokens (by default, as many as
        fit: the rest of the context, capped by the pool, as llama.cpp and Ollama do). ``prompt_only``: a pooling
        request (an embedding, a score), which outputs nothing: its prompt may fill the context (BERT's 512)."""
        if num_prompt_tokens == 0:
            raise AdmissionError("the prompt is empty")
        limit, n = self.max_model_len, num_prompt_tokens
        capacity = self.num_blocks * self.block_size
        if prompt_only and n <= min(limit, capacity):
            return max_tokens if max_tokens is not None else 1
        if n >= limit:
            raise AdmissionError(
                f"the prompt has {n} tokens; the maximum context length is {limit} tokens including the output"
            )
        if n >= capacity:
            raise AdmissionError(f"the prompt has {n} tokens; the KV cache pool holds {capacity} tokens "
                                 f"({self.num_blocks} blocks of {self.block_size}) including the output")
        max_tokens = max_tokens if max_tokens is not None else min(limit, capacity) - n
        if n + max_tokens > limit:
            raise AdmissionError(
                f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the maximum context length of "
                f"{limit} tokens"
            )
        if n + max_tokens > capacity:
            raise AdmissionError(
                f"the prompt ({n} tokens) plus max_tokens ({max_tokens}) exceeds the KV cache pool of {capacity} "
                f"tokens ({self.num_blocks} blocks of {self.block_size})"
            )
        return max_tokens
