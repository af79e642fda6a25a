"""The gateway behind the OpenAI-compatible API, over any generation backend.

It refuses what a request may not ask for (cluster/limits.py: the bounds;
protocol.py: the fields pdserve does not honour; token ids outside the
vocabulary) before the request costs anything, admits requests (a bound on
engine requests in flight, 429 beyond it, taken at once), refuses a prompt
surely too long for the context before tokenizing it (token ids by their count,
text by its characters: prompt_bound.py), tokenizes in a pool of threads off
the event loop where short prompts never queue behind long ones
(tokenizer_pool.py), checks sampling parameters against the context length, and runs a request's prompts x n
samples on the backend as one interleaved stream of DELTA outputs (cancelling
it aborts them in the backend, which frees their KV blocks). HTTP routes live
in openai_app.py, response bodies and SSE chunks in responses.py, what runs
before a route (API keys, body size, write timeouts) in http_guard.py.

Errors reach the client as `client_error` makes them (api_errors.py): a message,
a type and the request id; a worker's traceback stays in the server log.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, cast

from jinja2 import TemplateError, TemplateSyntaxError

from pdserve.cluster.api_errors import RETRY_AFTER, APIError, bad_request, unicode_text
from pdserve.cluster.backend_api import GenerationBackend
from pdserve.cluster.cors import CorsSettings
from pdserve.cluster.disagg_backend import DEFAULT_DRAIN_TIMEOUT_S, DisaggregatedBackend
from pdserve.cluster.drain_flag import STOP_STREAMS_AFTER_S, DrainWatch
from pdserve.cluster.limits import RefusalReason, RequestLimits
from pdserve.cluster.metrics import GatewayMetrics, WorkerHandles
from pdserve.cluster.prompt_bound import CharBound, char_bound
from pdserve.cluster.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from pdserve.cluster.reasoning import ReasoningParser, ReasoningPlan, ThinkingEnd, closes_thinking
from pdserve.cluster.reports import RoleSwitch
from pdserve.cluster.request_log import RequestLog
from pdserve.cluster.router import WorkerRole
from pdserve.cluster.token_text import TokenText
from pdserve.cluster.tokenizer_pool import TokenizerPool
from pdserve.cluster.tool_calls import ToolParser, ToolPlan, template_messages
from pdserve.workers.engine import GRAMMAR_COMPILE_TIMEOUT_S
from pdserve.workers.grammar import GrammarCompiler
from pdserve.workers.inputs import (
    ContextOverflowError,
    check_request,
    check_template_kwargs,
    check_token_ids,
    max_new_tokens,
    truncate_prompt,
)
from pdserve.workers.outputs import RequestOutput
from pdserve.workers.sampling_params import SamplingParams, sample_seed

if TYPE_CHECKING:
    from pdserve.cluster.planner.role_loop import PlannerSettings, RolePlannerLoop

log = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class GatewayConfig:
    model_name: str
    max_model_len: int
    # Keys are never in a repr: a config may be logged, or shown in an error.
    api_key: str | None = field(default=None, repr=False)
    # The key GET /metrics wants (the API key is taken there too); None: the API key alone
    # opens it (open only when there is no API key either).
    metrics_api_key: str | None = field(default=None, repr=False)
    max_in_flight: int = 256  # admission bound: beyond it, 429 with Retry-After
    request_timeout_s: float = 600.0
    max_logprobs: int = 20  # -1: the vocabulary (the engines' --max-logprobs)
    limits: RequestLimits = RequestLimits()
    # Token ids a request may name (prompt, logit_bias, stop_token_ids): the model's
    # vocabulary. None: the tokenizer's size.
    vocab_size: int | None = None
    aliases: tuple[str, ...] = ()  # other names requests may use (vLLM's --served-model-name after the first)
    # /v1/models' `root` (vLLM's: the model path; `vllm bench serve` loads its tokenizer
    # from it when given no --model). None: the model name.
    model_root: str | None = None
    # The planner loop (cluster/planner/role_loop.py): re-plans the prefill:decode split on
    # the traffic of each window, and with `apply` moves workers. None: no planner.
    planner: PlannerSettings | None = None
    # This replica's rank among the gateway's Serve replicas (serve_app.replica_rank): every
    # response names it (x-pdserve-replica), so a client behind HAProxy can tell who served it.
    replica: int = 0
    replicas: int = 1  # how many the deployment has (metrics: cluster/metrics_peers.py)
    # The model's sampling defaults for fields a request leaves unset (its generation_config.json:
    # workers/generation_defaults.py; {} with --generation-config vllm).
    sampling_defaults: dict[str, float] = field(default_factory=dict)
    # tool_choice "none" shows the model its tools unless this is set (vLLM's flag of the name).
    exclude_tools_when_tool_choice_none: bool = False
    return_tokens_as_token_ids: bool = False  # logprobs' default token names `token_id:<id>` (vLLM's flag)
    # Chat answers' thinking split out of their content (vLLM's --reasoning-parser; cluster/reasoning.py).
    reasoning_parser: ReasoningParser | None = None
    # What every chat's chat_template_kwargs start from (vLLM's --default-chat-template-kwargs).
    default_template_kwargs: dict[str, object] = field(default_factory=dict)
    tool_call_parser: ToolParser | None = None  # the one format "auto" tool calls are parsed for (None: each)
    # vLLM's request log (cluster/request_log.py): a line per request, per answer, cut to max_log_len.
    log_requests: bool = False
    force_include_usage: bool = False  # every stream ends with a usage chunk (vLLM's --enable-force-include-usage)
    fastapi_docs: bool = True  # /docs, /redoc and /openapi.json (vLLM's --disable-fastapi-docs: False)
    log_outputs: bool = False
    max_log_len: int | None = None
    cors: CorsSettings = CorsSettings()  # browsers' cross-origin requests (cluster/cors.py): none by default
    # The HTTP server in front writes x-request-id on every response itself (Ray Serve's ingress):
    # the guard does not add a second one (cluster/http_guard.py).
    server_writes_request_id: bool = False

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request may use; responses report the first (vLLM's --served-model-name)."""
        return (self.model_name, *self.aliases)

    def __post_init__(self) -> None:
        if self.max_in_flight < 1:
            raise ValueError(f"max_in_flight: must be >= 1, got {self.max_in_flight}")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s: must be > 0, got {self.request_timeout_s}")
        if self.replica < 0:
            raise ValueError(f"replica: must be >= 0, got {self.replica}")


@dataclass
class Work:
    """One prompt of an API request: its tokens, its sampling parameters (n samples),
    and for `echo` the prompt text to put before each of its completions."""

    prompt_ids: list[int]
    params: SamplingParams
    echo: str | None = None
    prompt_only: bool = False  # echo with max_tokens 0: the one token generated is dropped
    tools: ToolPlan | None = None  # a chat request's tools: its answers are parsed for calls
    reasoning: ReasoningPlan | None = None  # a chat answer's thinking is split out (--reasoning-parser)
    tokens_as_ids: bool = False  # logprobs name tokens `token_id:<id>` (vLLM's return_tokens_as_token_ids)


class Admission:
    """A request's share of the admission bound (its prompts x n engine requests),
    taken whole by `Gateway.admit` and held until `release` (idempotent): by the
    handler until its response is ready, then by a stream until it ends.

    The request is in `pdserve:num_requests_in_flight` for as long: the count a stop's
    drain waits on (cluster/shutdown.py). Counted from its first token's request to the
    engine, it missed a request admitted and still tokenizing: the drain read 0 and cut it."""

    def __init__(self, gw: Gateway, num_requests: int) -> None:
        if num_requests < 1:  # a share below 1 would lower the count others are admitted under
            raise ValueError(f"num_requests: at least 1, got {num_requests}")
        self._gw, self.num_requests, self._held = gw, num_requests, True
        gw.admitted += num_requests
        gw.metrics.in_flight.inc()

    def release(self) -> None:
        if self._held:
            self._held = False
            self._gw.admitted -= self.num_requests
            self._gw.metrics.in_flight.dec()


class Gateway:
    def __init__(self, backend: GenerationBackend, tokenizer: Any, config: GatewayConfig,
                 pool: TokenizerPool | None = None) -> None:
        self.backend, self.tokenizer, self.config = backend, tokenizer, config
        self.metrics = GatewayMetrics(backend.router_stats, backend.reliability, config.replica, config.replicas)
        self.registry = self.metrics.registry
        self.requests_total = self.metrics.requests_total
        self.admitted = 0  # engine requests admitted and not released
        self.token_str = TokenText(tokenizer)  # one token's text and bytes (logprobs)
        self.request_log = RequestLog(tokenizer, config.log_requests, config.log_outputs, config.max_log_len)
        self.vocab_size = config.vocab_size or (len(tokenizer) if tokenizer is not None else None)
        # Where a thinking model's thinking ends, in its tokens (usage's reasoning tokens).
        self.thinking_end = ThinkingEnd.of(tokenizer) if config.reasoning_parser and tokenizer is not None else None
        self._grammars: GrammarCompiler | None = None  # structured outputs' compiler, made on first use
        self._grammars_lock = threading.Lock()  # the tokenizer pool's threads share it
        # Tokenizing and chat templates run in the pool, off the event loop: a long prompt
        # must not stall every stream on the replica, nor the short prompts behind it.
        self.pool = pool if pool is not None else TokenizerPool()
        # None: the tokenizer folds characters (or is not an HF one): prompts are measured by tokenizing.
        self.char_bound: CharBound | None = (char_bound(tokenizer, config.max_model_len)
                                             if tokenizer is not None else None)
        # True once `pdserve serve` began to stop (cluster/drain_flag.py): no new request, the
        # ones in flight finish. `drain_watch` (set by whoever builds the app) tells it.
        self.draining = False
        self.drain_watch: DrainWatch | None = None
        self._stop_timer: asyncio.TimerHandle | None = None  # the drain's end: what is left then ends (`drain`)
        self.planner: RolePlannerLoop | None = None
        if config.planner is not None:
            self.planner = self._planner_loop(config.planner)

    def _planner_loop(self, settings: PlannerSettings) -> RolePlannerLoop:
        from pdserve.cluster.planner.role_loop import RolePlannerLoop
        from pdserve.cluster.planner.role_planner import Split

        backend = self.backend
        if not isinstance(backend, DisaggregatedBackend):
            raise ValueError("planner: it sizes the prefill and decode pools; this gateway has none (colocated)")

        def split() -> Split | None:
            sizes = backend.pool_split()
            return Split(*sizes) if sizes is not None and min(sizes) >= 1 else None

        async def move(src: WorkerRole, dst: WorkerRole) -> RoleSwitch:
            wid = backend.worker_to_move(src)
            if wid is None:
                raise ValueError(f"planner: no live {src.value} worker to move")
            return await self.switch_role(wid, dst)

        return RolePlannerLoop(settings, self.registry, split, move, metrics=self.metrics.planner)

    def start_planner(self) -> None:
        """Start the planner loop and the drain watch (each if there is one) on the running
        event loop: the app's startup."""
        if self.planner is not None:
            self.planner.start()
        if self.drain_watch is not None:
            self.drain_watch.start()
        self.metrics.start_publishing()

    def drain(self, stop_after_s: float = STOP_STREAMS_AFTER_S) -> None:
        """Take no new request from now on (503 with Retry-After); those in flight go on for
        `stop_after_s`, and what is left then ends with a 503 (a stream: its error event and
        `[DONE]`), aborted on its workers, before the stop's shutdown would cut it unsaid.
        On the running event loop."""
        if not self.draining:
            log.info("the server is stopping: no new requests; %d in flight finish", self.admitted)
            self.draining = True
            self._stop_timer = asyncio.get_running_loop().call_later(stop_after_s, self._stop_all)

    def _stop_all(self) -> None:
        if self.admitted:
            log.warning("the server is stopping: ending %d request(s) still in flight", self.admitted)
        self.backend.stop_all()

    # -- request preparation ---------------------------------------------------

    def check_model(self, model: str | None) -> None:
        # No model, or "", is the served one (vLLM's `_is_model_supported`: `if not model_name`).
        if model and model not in self.config.served_names:
            raise APIError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def check_request(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """What can be refused before the request costs anything: the model, a field
        pdserve does not honour, a bound, a token id outside the vocabulary."""
        self.check_model(body.model)
        try:
            self._check_length(body)
            body.check_supported()
            body.check_limits(self.config.limits)
            if self.vocab_size is not None:
                self._check_vocab(body)
        except ValueError as e:
            raise bad_request(e) from None

    def _check_length(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """A prompt surely too long for the context, refused before it costs anything:
        token ids by their count (the refusal tokenizing would end in), text by its
        characters (`CharBound`; nothing when the tokenizer has no such bound)."""
        if body.truncate_prompt_tokens is not None:  # a long prompt is cut to fit, not refused
            return
        bound = self.char_bound
        if isinstance(body, ChatCompletionRequest):
            if bound is not None:
                bound.check("messages", sum(len(m.text()) for m in body.messages))
            return
        for p in _batch(body.prompt):
            if isinstance(p, str):
                if bound is not None:
                    bound.check("prompt", len(p))
            elif p:
                max_new_tokens(len(p), None, self.config.max_model_len)

    def _check_vocab(self, body: CompletionRequest | ChatCompletionRequest) -> None:
        """Prompt and stop token ids (logit_bias: `params`, once its keys are parsed)."""
        vocab = self.vocab_size
        assert vocab is not None
        if any(not 0 <= t < vocab for t in body.stop_token_ids or ()):
            raise ValueError(f"stop_token_ids: token ids must be in [0, {vocab})")
        if isinstance(body, CompletionRequest) and not isinstance(body.prompt, str) and body.prompt:
            batch = [body.prompt] if isinstance(body.prompt[0], int) else body.prompt
            for p in batch:
                if not isinstance(p, str) and p:
                    check_token_ids(p, vocab)

    async def off_loop(self, body: CompletionRequest | ChatCompletionRequest, fn: Callable[[], T]) -> T:
        """`fn()`, the tokenizer work of `body`, in the pool's lane for its size (on the
        loop when short, unless it may compile a grammar: that takes long whatever the size).
        Within the request's deadline, queue included: past it a 504, and its admission slot
        goes back (a job still queued is dropped; one running finishes unread)."""
        return await self.in_pool(prompt_chars(body), fn, may_inline=not compiles_grammar(body))

    async def in_pool(self, size: int, fn: Callable[[], T], may_inline: bool = True) -> T:
        """`off_loop` for work of `size` characters (text, plus one per token id)."""
        deadline = asyncio.timeout(self.config.request_timeout_s)
        try:
            async with deadline:
                return await self.pool.run(size, fn, may_inline=may_inline)
        except TimeoutError:
            if not deadline.expired():
                raise  # `fn`'s own
            raise APIError(504, "the request did not finish within its deadline (its prompt was still being "
                                "tokenized)", "Timeout") from None

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if not prompt:
            raise APIError(400, "prompt: must not be empty", "BadRequestError", "prompt",
                           reason=RefusalReason.MALFORMED)
        return list(self.tokenizer.encode(unicode_text("prompt", prompt))) if isinstance(prompt, str) else list(prompt)

    def prompts(self, prompt: str | list[str] | list[int] | list[list[int]],
                truncate: int | None = None) -> list[tuple[list[int], str | None]]:
        """The prompts of a completions request (OpenAI: a string, token ids, or a
        batch of either) as (token ids, text when given as text and kept whole), each
        cut to its last `truncate` tokens (truncate_prompt_tokens). Blocking: call it
        through `off_loop`."""
        out = []
        for p in _batch(prompt):
            ids = self.tokenize(p)
            kept = self.truncate(ids, truncate)
            out.append((kept, p if isinstance(p, str) and len(kept) == len(ids) else None))
        return out

    def truncate(self, ids: list[int], keep: int | None) -> list[int]:
        try:
            return truncate_prompt(ids, keep, self.config.max_model_len)
        except ValueError as e:
            raise bad_request(e) from None

    def chat_prompt(self, req: ChatCompletionRequest) -> tuple[list[int], bool]:
        """The chat's prompt ids, and whether the prompt already ended the thinking
        (`closes_thinking`). Blocking: call it through `off_loop`."""
        plan = req.tool_plan()
        tools = plan.template_tools(exclude_if_none=self.config.exclude_tools_when_tool_choice_none)
        text = self.chat_text(req.messages, tools, req.add_generation_prompt,
                              req.continue_final_message, req.template_kwargs())
        if self.char_bound is not None:  # the template's own text counts too
            try:
                self.char_bound.check("messages", len(text))
            except ValueError as e:
                raise bad_request(e) from None
        ids = self.truncate(list(self.tokenizer.encode(text, add_special_tokens=False)), req.truncate_prompt_tokens)
        if self.config.reasoning_parser is None:  # no thinking is split out: nothing to look for
            return ids, False
        continued = req.messages[-1].text() if req.continue_final_message else None
        return ids, closes_thinking(text, continued)

    def template_kwargs(self, given: dict[str, object] | None) -> dict[str, object]:
        """A chat's chat_template_kwargs: the server's defaults, then the request's (which win)."""
        return {**self.config.default_template_kwargs, **(given or {})}

    def chat_text(self, chat: Sequence[ChatMessage], tools: list[dict[str, object]] | None,
                  add_generation_prompt: bool = True, continue_final_message: bool = False,
                  template_kwargs: dict[str, object] | None = None) -> str:
        """The messages as the model's chat template renders them, with `template_kwargs` (the
        request's chat_template_kwargs) among its variables (a 400 for messages it refuses, or
        for a model with no template: a base model). Blocking: call it through `off_loop`."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            # transformers raises a plain ValueError here: it was a 500.
            raise bad_request(ValueError("messages: this model has no chat template (a base model); "
                                         "send the text to /v1/completions"))
        messages = template_messages([m.template_dict(unicode_text("messages", m.text())) for m in chat])
        try:
            extra = check_template_kwargs(self.template_kwargs(template_kwargs))
        except ValueError as e:
            raise bad_request(e) from None
        try:
            # Checked whole: tools, names and tool-call arguments reach the text too.
            return unicode_text("messages", str(self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **extra)))
        except TemplateSyntaxError:
            raise  # the model's template is broken: the server's fault, not this request's
        except TemplateError as e:
            # The template refused these messages (`raise_exception`: roles that do not alternate,
            # a system role it has none of, a field it needs): the client's to fix.
            raise bad_request(ValueError(f"messages: the model's chat template refused them: {e}")) from None
        except RecursionError:  # tools or tool-call arguments nested past the renderer's stack
            raise bad_request(ValueError("messages: nested too deeply to render (tools, tool-call arguments)")) \
                from None
        except (TypeError, ValueError) as e:
            # What the template does with the request's values failed: a null where it adds a
            # string, a list where it iterates an object's items (vLLM: a 400 too).
            raise bad_request(ValueError(f"messages: the model's chat template could not render them (or the "
                                         f"tools): {type(e).__name__}: {e}"[:500])) from None

    async def check_grammar(self, params: SamplingParams) -> None:
        """A 400 naming the field when the request's structured output does not compile (or
        not within the time limit), before any worker is touched. Awaited on the loop: the
        compile runs on the compiler's own threads. Waited for on a tokenizer thread, it held
        that thread up to the compile deadline, and a slow grammar per thread left every other
        request's tokenizing waiting behind them."""
        spec = params.constraint
        if spec is None:
            return
        grammars = self._grammars
        if grammars is None:  # made once: it reads the tokenizer's whole vocabulary
            grammars = await self.pool.run(0, self._grammar_compiler, may_inline=False)
        limit = min(GRAMMAR_COMPILE_TIMEOUT_S, self.config.request_timeout_s)
        try:
            await grammars.ready(spec, limit)
        except TimeoutError:
            raise bad_request(ValueError(f"{spec.field}: did not compile within {limit:g} s")) from None
        except ValueError as e:
            raise bad_request(e) from None

    def _grammar_compiler(self) -> GrammarCompiler:
        """The structured outputs' compiler, made on first use (blocking; any thread)."""
        with self._grammars_lock:
            if self._grammars is None:
                vocab = self.vocab_size if self.vocab_size is not None else len(self.tokenizer)
                eos = () if self.tokenizer.eos_token_id is None else (int(self.tokenizer.eos_token_id),)
                self._grammars = GrammarCompiler(self.tokenizer, vocab, eos)
            return self._grammars

    def params(self, prompt_ids: list[int], max_tokens: int | None,
               make: Callable[[int], SamplingParams], budget_field: str = "max_tokens",
               logprobs_field: str = "logprobs", prompt_field: str = "prompt") -> SamplingParams:
        """The checked parameters `make` builds for the completion's token budget
        (`max_tokens`, or all the context the prompt leaves). `budget_field`, `logprobs_field`,
        `prompt_field`: the request's names for that budget, for the number of top logprobs
        (chat's `top_logprobs`) and for its prompt (chat's `messages`), named in its errors."""
        default_budget = self.config.sampling_defaults.get("max_tokens")
        if max_tokens is None and default_budget is not None and len(prompt_ids) < self.config.max_model_len:
            # The model's max_new_tokens, within what the context leaves (vLLM's rule).
            max_tokens = min(int(default_budget), self.config.max_model_len - len(prompt_ids))
        try:
            params = make(max_new_tokens(len(prompt_ids), max_tokens, self.config.max_model_len))
            if self.vocab_size is not None:
                check_request(params, self.vocab_size, self.config.max_logprobs)
        except ValueError as e:
            # Named as the request names them: a chat request's top_logprobs of -1 or 21 was
            # refused naming `logprobs`, a boolean there, which the client had set right.
            for ours, theirs in (("max_tokens", budget_field), ("logprobs", logprobs_field),
                                 ("prompt", prompt_field)):
                if theirs != ours and str(e).startswith(ours + ":"):
                    renamed = theirs + str(e).removeprefix(ours)
                    e = ContextOverflowError(renamed) if isinstance(e, ContextOverflowError) else ValueError(renamed)
            raise bad_request(e) from None
        if params.logprobs is not None and params.logprobs > self.config.max_logprobs != -1:
            raise APIError(400, f"{logprobs_field}: at most {self.config.max_logprobs}", "BadRequestError",
                           logprobs_field, reason=RefusalReason.LIMIT)
        return params

    def admit(self, num_requests: int = 1) -> Admission:
        """Room for `num_requests` engine requests (a call's prompts x n), taken at
        once (no await between the check and the count), or 429; 503 while no
        worker can serve. A call bigger than this replica's bound (its share of
        `--max-in-flight`) still runs when nothing else does here (the bounds on n
        and prompts keep it finite): with N replicas the tier may then hold up to N
        such calls, over the tier's bound, rather than refuse a call for good."""
        if self.draining:
            raise APIError(503, "the server is shutting down; retry later", "ServiceUnavailableError",
                           headers=RETRY_AFTER, reason=RefusalReason.UNAVAILABLE)
        if self.admitted > 0 and self.admitted + num_requests > self.config.max_in_flight:
            raise APIError(429, "server is at capacity; retry later", "RateLimitError", headers=RETRY_AFTER,
                           reason=RefusalReason.CAPACITY)
        if not self.backend.healthy:
            raise APIError(503, "no healthy workers to serve the request", "ServiceUnavailableError",
                           headers=RETRY_AFTER, reason=RefusalReason.UNAVAILABLE)
        return Admission(self, num_requests)

    # -- generation ------------------------------------------------------------

    async def run(self, rid: str, works: list[Work]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(choice index, delta) for each of the n samples of every prompt, interleaved
        as they come; prompt p's sample j is choice p * n + j (OpenAI's numbering)."""
        # One sample: its params as they are (a copy re-runs their checks, ~10 us a request).
        subs = [(w.prompt_ids, w.params if w.params.n == 1
                 else dataclasses.replace(w.params, n=1, seed=sample_seed(w.params.seed, j)))
                for w in works for j in range(w.params.n)]
        self.request_log.received(rid, works)
        answers = self.request_log.answers(rid, works)
        if len(subs) == 1:
            async with contextlib.aclosing(self.backend.generate(rid, subs[0][0], subs[0][1],
                                                                 self.config.request_timeout_s)) as one:
                async for out in one:
                    if answers is not None:
                        answers.add(0, out)
                    yield 0, out
            return
        async with contextlib.aclosing(_merge([self.backend.generate(f"{rid}-{i}", ids, sp,
                                                                     self.config.request_timeout_s)
                                               for i, (ids, sp) in enumerate(subs)])) as merged:
            async for item in merged:
                if answers is not None:
                    answers.add(*item)
                yield item

    async def close(self) -> None:
        if self._stop_timer is not None:
            self._stop_timer.cancel()
        await self.metrics.close()
        if self.drain_watch is not None:
            await self.drain_watch.close()
        if self.planner is not None:
            await self.planner.close()
        await self.backend.close()
        self.pool.shutdown()

    async def switch_role(self, worker: str, role: WorkerRole,
                          drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> RoleSwitch:
        """Move `worker` (its router id, p0 or d1, or its actor name) into the `role` pool
        while serving, on this event loop: `DisaggregatedBackend.switch_role`, which says
        what it waits for and refuses. No HTTP route calls it (an admin key would be
        needed first: docs/security.md); a planner in this process does.
        ValueError without pools to move between (colocated, or one in-process engine)."""
        if not isinstance(self.backend, DisaggregatedBackend):
            raise ValueError("role: workers change role only in the disaggregated mode")
        return await self.backend.switch_role(self.backend.worker_id(worker), role, drain_timeout_s)

    def worker_handles(self) -> WorkerHandles:
        """Every worker whose metrics `GET /metrics` merges (none for an in-process engine)."""
        return self.backend.worker_handles()


def _batch(prompt: str | list[str] | list[int] | list[list[int]]) -> list[str | list[int]]:
    """The prompts of a completions request's `prompt` (OpenAI: one text or token-id
    list, or a batch of either)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt or isinstance(prompt[0], int):
        return [cast(list[int], prompt)]
    return list(prompt)


def compiles_grammar(body: CompletionRequest | ChatCompletionRequest) -> bool:
    """Whether tokenizing `body` may compile a structured-output grammar (or render tools
    into its template): work whose cost its prompt's length does not tell."""
    if body.response_format is not None or body.structured_outputs is not None:
        return True
    return isinstance(body, ChatCompletionRequest) and bool(body.tools)


# What a chat message adds to its template's text beyond its own (roles, markers: ~34 characters a
# message in SmolLM2's), and about what rendering it costs: 513 one-character messages took 6 ms to
# render and encode (bench/experiments/tokenize_inline.py), which must not run on the event loop.
TEMPLATE_CHARS_PER_MESSAGE = 32


def prompt_chars(body: CompletionRequest | ChatCompletionRequest) -> int:
    """What tokenizing `body` costs, roughly: its text's characters (a chat's as its
    template renders them), one per token id."""
    if isinstance(body, ChatCompletionRequest):
        return sum(len(m.text()) + TEMPLATE_CHARS_PER_MESSAGE for m in body.messages)
    return sum(len(p) for p in _batch(body.prompt))


async def _merge(streams: list[AsyncGenerator[RequestOutput, None]]) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async with contextlib.aclosing(stream):
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
