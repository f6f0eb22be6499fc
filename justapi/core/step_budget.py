"""What one scheduler step may still take: prefill tokens (``--chunk-size``) and rows of each kind (``--max-prefill``
prompts being prefilled, ``--max-decode`` decodes). One object, spent as the step is filled."""

from __future__ import annotations

from ..config import SchedulerConfig


class StepBudget:
    def __init__(self, config: SchedulerConfig) -> None:
        self.tokens = config.chunk_size  # prefill tokens left
        self.prefills = 0  # prompt chunks scheduled
        self.decodes = 0  # decode rows scheduled
        self._max_prefill, self._max_decode = config.max_prefill, config.max_decode

    def may_decode(self) -> bool:
        return self.decodes < self._max_decode

    def may_prefill(self) -> bool:
        return self.prefills < self._max_prefill and self.tokens > 0

    def spend(self, num_tokens: int, decode: bool) -> None:
        """A decode row, or a prompt chunk of ``num_tokens`` (a whole prompt may take more than is left)."""
        if decode:
            self.decodes += 1
        else:
            self.prefills += 1
            self.tokens = max(0, self.tokens - num_tokens)
