"""Realistic records for the fault tests (~1 KB generations)."""

from __future__ import annotations

import numpy as np

from reef_stream.core.events import FinishReason, Generation, SamplingParams

_PROMPT = np.arange(32, dtype=np.int32)
_COMPLETION = np.arange(100, 200, dtype=np.int32)
_LOGPROBS = -np.linspace(0.01, 3.0, 100, dtype=np.float32)


def generation(i: int) -> Generation:
    return Generation(
        generation_id=f"gen-{i:07d}", request_id=f"req-{i}", prompt_id=f"prompt-{i % 97}",
        model="tiny", policy_version=i // 1000, replica_id="replica-a",
        prompt_token_ids=_PROMPT, completion_token_ids=_COMPLETION, completion_logprobs=_LOGPROBS,
        finish_reason=FinishReason.STOP, created_at=1_795_000_000_000 + i,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, max_tokens=100))
