"""A request inside the engine: its tokens, its progress, and its lifecycle."""

from __future__ import annotations

import enum
import math
import time
from typing import TYPE_CHECKING

import torch

from pdserve.workers.lifecycle import Lifecycle
from pdserve.workers.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pdserve.workers.detokenizer import IncrementalDetokenizer
    from pdserve.workers.grammar import GrammarState
    from pdserve.workers.spec.ngram import TokenBuffer


_CPU = torch.device("cpu")


class FinishReason(str, enum.Enum):
    """Why the engine stopped generating for a request (the API's `finish_reason`).
    Not a state: the request's state is its lifecycle (`Request.life`)."""

    STOP = "stop"  # a stop token or string
    LENGTH = "length"  # max_tokens, or the model's length
    ABORT = "abort"  # aborted before either


class Request:
    """Tokens are `prompt + outputs`; `num_computed_tokens` of them have KV in the cache.

    Everything the engine knows of one request lives here: its tokens and
    progress, its lifecycle (`life`: the one state it has in a worker), its text
    (`detok`) and what of its output has been handed out (`sent_*`), its drafts.
    The scheduler moves its lifecycle; nothing else in the engine does.
    """

    def __init__(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
        prompt: str | None = None, eos_token_ids: tuple[int, ...] = (), max_tokens: int,
        device: torch.device = _CPU, hold_kv: bool = False, life: Lifecycle | None = None,
        ends_in_engine: bool | None = None,
    ) -> None:
        """`life`: the worker's lifecycle of this request (its `AsyncEngine` job's), which
        the scheduler moves and the worker ends once the request has left (its last
        delta sent, its KV handed over). None: the engine's own, with no deadline.
        `ends_in_engine`: whether finishing in the engine ends `life` (default: when
        it is the engine's own: offline use, tests)."""
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.max_tokens = max_tokens  # params.max_tokens, or what max_model_len leaves
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set when first scheduled
        self.block_hashes: list[int] = []  # of every full block of all_token_ids (lazily extended)
        self.life = life if life is not None else Lifecycle(request_id, math.inf)
        self.ends_in_engine = life is None if ends_in_engine is None else ends_in_engine
        self.finish_reason: FinishReason | None = None  # set once, when it finishes in the engine
        self.stop_reason: int | str | None = None
        self.stop_token_ids = frozenset(params.stop_token_ids or ()) | (
            frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        )
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator(device=device)
            self.generator.manual_seed(params.seed)
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # Entry i: prompt token i's log-prob given tokens < i, with the top-N (None for token 0).
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.cumulative_logprob = 0.0
        self.arrival_time = time.monotonic()
        # Seconds from arrival to its first step (metrics); a decode worker's request
        # takes the prefill worker's, the queue it really waited in.
        self.queue_time_s: float | None = None
        # Its text so far and the stop-string matcher (None: no text wanted, no stop strings).
        self.detok: IncrementalDetokenizer | None = None
        # DELTA outputs: output tokens and text characters already handed out, and
        # whether any was (prompt_logprobs ride in the first one only).
        self.sent_tokens = 0
        self.sent_chars = 0
        self.sent_any = False
        # Prefill side of a handoff: when it finishes it keeps its blocks (the
        # scheduler holds it, finished) until its KV is sent and it is released.
        self.hold_kv = hold_kv
        # Drafted tokens to verify in the next step (speculative decoding); not
        # part of all_token_ids until the target accepts them.
        self.spec_token_ids: list[int] = []
        # [len(spec_token_ids), V]: the distribution each draft was sampled from (a draft model
        # sampling for a random request); None for deterministic drafts (one-hot).
        self.spec_draft_probs: torch.Tensor | None = None
        # Rolling (exponentially weighted) rate at which this request's drafts are
        # accepted; starts at the engine's recent rate (1 at first: drafting gets a chance). Steps since the
        # request last drafted, for an occasional probe when the rate is low.
        self.spec_acceptance = 1.0
        self.spec_idle_steps = 0
        self.token_buffer: TokenBuffer | None = None  # numpy mirror of all_token_ids for n-gram lookup
        # bad_words' token sequences (workers/bad_words.py): the engine sets them from its tokenizer.
        self.bad_words_token_ids: list[list[int]] = []
        # Its place in its grammar (structured outputs), or None: the engine sets it.
        self.grammar: GrammarState | None = None
        # Sampled tokens not on the host yet (0 or 1): a step in flight sampled it (async
        # scheduling, workers/in_flight.py). It counts in `num_tokens`, so the scheduler gives the
        # request its next decode row, whose input comes from the device; not in the token lists.
        self.num_pending = 0

    @property
    def finished(self) -> bool:
        """Whether it finished in the engine (a held prefill keeps its blocks after)."""
        return self.finish_reason is not None

    @property
    def schedulable(self) -> bool:
        """Whether a step may run it: not while its grammar is still compiling."""
        return self.grammar is None or self.grammar.matcher is not None

    @property
    def num_tokens(self) -> int:
        """Its tokens, the one a step in flight sampled included (`num_pending`)."""
        return len(self.all_token_ids) + self.num_pending

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
