"""OpenAI-compatible request and response shapes (the subset pdserve serves).

Requests are pydantic models so FastAPI validates them and /openapi.json
describes them. Unknown fields are ignored, as vLLM does, so clients that send
extra OpenAI options still work.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.workers.sampling_params import SamplingParams


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float = Field(1.0, description="0 = greedy")
    top_p: float = 1.0
    top_k: int = Field(0, description="0 or -1 disables")
    min_p: float = 0.0
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float | None = Field(0.0, description="in [-2, 2]: minus this for each token already generated")
    frequency_penalty: float | None = Field(0.0, description="in [-2, 2]: minus this times each token's count so far")
    repetition_penalty: float | None = Field(1.0, description="> 0, 1 = off: divides the logits of tokens already "
                                                               "in the prompt or output (vLLM's extension)")
    logit_bias: dict[str, float] | None = Field(None, description="token id -> bias in [-100, 100] added to its logit")
    speculative: bool = Field(True, description="false: no speculative decoding for this request "
                                                "(when the server speculates)")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises ValueError naming the bad parameter."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return SamplingParams(
            n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            logit_bias=self.logit_bias,  # type: ignore[arg-type]  # JSON's string keys: SamplingParams parses them
            speculative=self.speculative,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        ..., description="text or token ids, or a batch of either: prompt p's sample j is choice p * n + j")
    echo: bool = Field(False, description="put the prompt before each completion's text (and, with logprobs, "
                                         "the prompt tokens' logprobs before the generated ones'); "
                                         "with max_tokens 0, return only the prompt")
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, description="return this many top log-probs per token")


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: int | None = Field(None, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        return (self.top_logprobs or 0) if self.logprobs else None


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
