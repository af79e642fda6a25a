"""The gateway behind the OpenAI-compatible API, over any generation backend.

It admits requests (a bound on engine requests in flight, 429 beyond it),
checks the API key and the model, tokenizes prompts, checks sampling
parameters against the context length, and runs a request's prompts x n
samples on the backend as one interleaved stream of DELTA outputs (cancelling
it aborts them in the backend, which frees their KV blocks). HTTP routes live
in openai_app.py, response bodies and SSE chunks in responses.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayError

from pdserve.cluster.backend import GenerationBackend, WorkerLostError
from pdserve.cluster.metrics import GatewayMetrics, WorkerHandles
from pdserve.cluster.protocol import ChatCompletionRequest
from pdserve.cluster.router import NoHealthyWorkerError
from pdserve.workers.inputs import max_new_tokens
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str
    max_model_len: int
    api_key: str | None = None
    max_in_flight: int = 256  # admission bound: beyond it, 429 with Retry-After
    request_timeout_s: float = 600.0
    max_logprobs: int = 20
    max_batch_prompts: int = 64  # prompts in one /v1/completions request
    aliases: tuple[str, ...] = ()  # other names requests may use (vLLM's --served-model-name after the first)
    # /v1/models' `root` (vLLM's: the model path; `vllm bench serve` loads its tokenizer
    # from it when given no --model). None: the model name.
    model_root: str | None = None

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request may use; responses report the first (vLLM's --served-model-name)."""
        return (self.model_name, *self.aliases)

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight: must be >= 1, got {self.max_in_flight}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s: must be > 0, got {self.request_timeout_s}")


class APIError(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param, self.headers = status, message, err_type, param, headers


def status_of(e: BaseException) -> int:
    """The HTTP status an error of the generation path maps to (also the code of an in-band stream error)."""
    if isinstance(e, APIError):
        return e.status
    if isinstance(e, ValueError):
        return 400
    if isinstance(e, TimeoutError):
        return 504
    if isinstance(e, (NoHealthyWorkerError, WorkerLostError)):
        return 503  # retry later: workers are restarting
    return 500


def public_error(e: BaseException) -> tuple[str, str]:
    """(message, type) the client is told of an error: ours say what went wrong;
    Ray's carry a worker's traceback and host names, so they are logged here and
    the client gets a plain line."""
    if isinstance(e, RayError):
        log.error("request failed in a worker: %s", e)
        return "internal error: a worker failed (the gateway's log has the details)", "InternalServerError"
    return str(e) or type(e).__name__, type(e).__name__


def bad_request(e: ValueError) -> APIError:
    """Our ValueErrors start with the parameter name ("top_p: must be ..."): report it as `param`."""
    msg = str(e)
    param = msg.split(":", 1)[0] if ":" in msg and " " not in msg.split(":", 1)[0] else None
    return APIError(400, msg, "BadRequestError", param)


@dataclass
class Work:
    """One prompt of an API request: its tokens, its sampling parameters (n samples),
    and for `echo` the prompt text to put before each of its completions."""

    prompt_ids: list[int]
    params: SamplingParams
    echo: str | None = None
    prompt_only: bool = False  # echo with max_tokens 0: the one token generated is dropped


class Gateway:
    def __init__(self, backend: GenerationBackend, tokenizer: Any, config: GatewayConfig) -> None:
        self.backend, self.tokenizer, self.config = backend, tokenizer, config
        self.metrics = GatewayMetrics(backend.router_stats, backend.reliability)
        self.registry = self.metrics.registry
        self.requests_total = self.metrics.requests_total
        self._admitted = 0

    # -- request preparation ---------------------------------------------------

    def check_auth(self, authorization: str) -> None:
        """`authorization`: the request's Authorization header ("" when it has none)."""
        if self.config.api_key is None:
            return
        token = authorization[7:] if authorization.lower().startswith("bearer ") else ""
        if not secrets.compare_digest(token.encode(), self.config.api_key.encode()):
            raise APIError(401, "invalid or missing API key", "AuthenticationError")

    def check_model(self, model: str | None) -> None:
        # No model, or "", is the served one (vLLM's `_is_model_supported`: `if not model_name`).
        if model and model not in self.config.served_names:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if not prompt:
            raise APIError(400, "prompt: must not be empty", "BadRequestError", "prompt")
        return list(self.tokenizer.encode(prompt)) if isinstance(prompt, str) else list(prompt)

    def prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[tuple[list[int], str | None]]:
        """The prompts of a completions request (OpenAI: a string, token ids, or a
        batch of either) as (token ids, text when given as text)."""
        if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
            one = prompt if isinstance(prompt, str) else None
            return [(self.tokenize(prompt), one)]  # type: ignore[arg-type]
        if len(prompt) > self.config.max_batch_prompts:
            raise APIError(400, f"prompt: at most {self.config.max_batch_prompts} prompts per request",
                           "BadRequestError", "prompt")
        return [(self.tokenize(p), p if isinstance(p, str) else None) for p in prompt]

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def params(self, prompt_ids: list[int], max_tokens: int | None,
               make: Callable[[int], SamplingParams]) -> SamplingParams:
        """The checked parameters `make` builds for the completion's token budget
        (`max_tokens`, or all the context the prompt leaves)."""
        try:
            params = make(max_new_tokens(len(prompt_ids), max_tokens, self.config.max_model_len))
        except ValueError as e:
            raise bad_request(e) from None
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs:
            raise APIError(400, f"logprobs: at most {self.config.max_logprobs}", "BadRequestError", "logprobs")
        return params

    def admit(self, num_requests: int = 1) -> None:
        """Room for `num_requests` engine requests (a call's prompts x n), or 429.
        A call bigger than the whole bound still runs when nothing else does."""
        if self._admitted > 0 and self._admitted + num_requests > self.config.max_in_flight:
            raise APIError(429, "server is at capacity; retry later", "RateLimitError", headers={"Retry-After": "1"})
        if not self.backend.healthy:
            raise APIError(503, "no healthy workers to serve the request", "ServiceUnavailableError",
                           headers={"Retry-After": "1"})  # workers restart in seconds

    # -- generation ------------------------------------------------------------

    async def run(self, rid: str, works: list[Work]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, delta) for each of the n samples of every prompt, interleaved
        as they come; prompt p's sample j is choice p * n + j (OpenAI's numbering)."""
        subs = [(w.prompt_ids, dataclasses.replace(w.params, n=1,
                                                   seed=None if w.params.seed is None else w.params.seed + j))
                for w in works for j in range(w.params.n)]
        self._admitted += len(subs)  # the admission bound counts engine requests
        try:
            if len(subs) == 1:
                async for out in self.backend.generate(rid, subs[0][0], subs[0][1], self.config.request_timeout_s):
                    yield 0, out
                return
            async for item in _merge([self.backend.generate(f"{rid}-{i}", ids, sp, self.config.request_timeout_s)
                                      for i, (ids, sp) in enumerate(subs)]):
                yield item
        finally:
            self._admitted -= len(subs)

    def worker_handles(self) -> WorkerHandles:
        """Every worker whose metrics `GET /metrics` merges (none for an in-process engine)."""
        return self.backend.worker_handles()

    def token_str(self, token_id: int) -> str:
        text: str = self.tokenizer.decode([token_id])
        return text


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        done = 0
        while done < len(tasks):
            item = await queue.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
