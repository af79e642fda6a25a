"""Constrained decoding with xgrammar (what vLLM and SGLang use by default): a request's
`StructuredOutputs` compiled once per worker (cached by its text, compiled on threads of
their own so a request waiting for its grammar never stalls the batch, nor waits behind
another request's slow grammar), a matcher per request that fills that request's row of
the step's token bitmask, and the bitmask applied to the logits before sampling.

A request's matcher state is its output tokens: a matcher is built when its grammar is
ready and replays the tokens the request already has (a prefill worker's first token, a
migrated request's output, a preempted request's), so every path that moves a request
between workers carries the grammar's state exactly, with nothing but the tokens.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import numpy as np
import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from pdserve.workers.structured_outputs import StructuredOutputs

log = logging.getLogger(__name__)

# xgrammar (0.2.9) writes the characters of a string with a length bound (maxLength) as this
# class, which lets a raw control character (U+0000-U+001F) through: JSON forbids those
# unescaped, and a parser refuses the output. The class its unbounded strings use excludes them.
_LOOSE_CHAR = r'[^\"\\\r\n]'
_JSON_CHAR = r'[^\0-\x1f\"\\\r\n]'
# Compiled grammars a worker (and a gateway) keeps, least recently used out first (xgrammar's own
# cache is off: see GrammarCompiler): at most this many, and at most CACHE_BYTES of them. A
# grammar's token-mask cache grows with the vocabulary: a 150-property schema is ~3 MB with a
# 49k vocabulary, a 1,000-property one ~6 MB, so 1,024 entries alone let distinct schemas (each
# agent session's tools, or a client cycling schemas) hold gigabytes in every worker and gateway.
CACHE_ENTRIES = 1024
CACHE_BYTES = 256 << 20
# Grammars compiled at once. One thread made every grammar wait behind the one before it: a
# schema that takes seconds (3,000 properties: 4.9 s on a 2-core EPYC) held up a 5 ms one from
# another client until it too ran into the compile deadline and was refused. A compile cannot be
# cut short, so a few threads keep a few slow ones from holding up the rest (xgrammar compiles
# outside the GIL: with two threads the small one took 5 ms beside the big one). vLLM sizes its
# pool at half the cores; at least 4 here, whatever the machine.
COMPILE_THREADS = max(4, (os.cpu_count() or 1) // 2)


@dataclass
class GrammarStats:
    compiles: int = 0  # grammars compiled (cache misses)
    cache_hits: int = 0  # requests whose grammar was compiled already (counted where they are checked)
    compile_s: float = 0.0  # seconds spent compiling
    constrained_requests: int = 0


class GrammarCompiler:
    """Compiles `StructuredOutputs` for one tokenizer and vocabulary (the model's: its
    logits' width), caching the results. `compile` raises ValueError naming the field
    when the backend refuses the spec; `submit` does it on the compile thread."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: tuple[int, ...]) -> None:
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids) or None)
        self.vocab_size = vocab_size
        # Without xgrammar's own cache: `_cache` is the one, bounded (CACHE_ENTRIES). xgrammar's is
        # unbounded unless told otherwise, and kept every grammar ever compiled besides (each
        # distinct schema a client sent), for the life of the worker or gateway.
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._cache: dict[tuple[str, str], Future[xgr.CompiledGrammar]] = {}
        self._sizes: dict[tuple[str, str], int] = {}  # the compiled ones' memory (xgrammar's count)
        self.cache_bytes = 0  # their sum
        # Callers waiting on a queued compile with a deadline (`wait`, `ready`), and the compiles a
        # request in the engine holds (`state`): one that every waiter gave up on, and no request
        # holds, leaves the queue. Without that, a client sending schemas that each take longer
        # than the deadline queued compiles without bound, each refused request's still to run,
        # and everyone's grammars waited behind them.
        self._waiters: dict[tuple[str, str], int] = {}
        self._held: set[Future[xgr.CompiledGrammar]] = set()
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="pd-grammar")
        self.stats = GrammarStats()

    def submit(self, spec: StructuredOutputs, count: bool = True) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of `spec`, compiling it on the compile thread unless cached
        (a cached one's future may be done already). `count`: a cached one is a cache hit
        (once per request: where it is checked, not again where it is queued)."""
        key = spec.key()
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None and not fut.cancelled() and not (fut.done() and fut.exception() is not None):
                self.stats.cache_hits += count
                self._cache[key] = self._cache.pop(key)  # the most recently used now
                return fut
            self._drop(key)
            fut = self._pool.submit(self._compile, spec)
            self._cache[key] = fut
            self._evict()
        # Outside the lock: a compile already done runs the callback here, and it takes the lock.
        fut.add_done_callback(lambda done: self._sized(key, done))
        return fut

    def _sized(self, key: tuple[str, str], fut: Future[xgr.CompiledGrammar]) -> None:
        """Count a finished compile's memory against CACHE_BYTES (while it is still the cached one)."""
        if fut.cancelled() or fut.exception() is not None:
            return
        with self._lock:
            if self._cache.get(key) is fut and key not in self._sizes:
                self._sizes[key] = fut.result().memory_size_bytes
                self.cache_bytes += self._sizes[key]
                self._evict()

    def _evict(self) -> None:
        """Drop the least recently used grammars while over either bound (lock held). A request
        holding a dropped one keeps it; the next request with its spec compiles it again."""
        while len(self._cache) > CACHE_ENTRIES or (self.cache_bytes > CACHE_BYTES and len(self._cache) > 1):
            self._drop(next(iter(self._cache)))

    def _drop(self, key: tuple[str, str]) -> None:
        """Forget `key`'s grammar (lock held)."""
        self._cache.pop(key, None)
        self.cache_bytes -= self._sizes.pop(key, 0)

    def compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        """Compile now (or take the cached result), on the caller's thread."""
        return self.submit(spec).result()

    def wait(self, spec: StructuredOutputs, timeout_s: float) -> xgr.CompiledGrammar:
        """The compiled grammar, within `timeout_s` (TimeoutError otherwise, and the compile
        leaves the queue if it has not started and nobody else wants it); ValueError when the
        backend refuses it. Blocking."""
        key, fut = self._join(spec)
        try:
            return fut.result(timeout=timeout_s)
        except CancelledError:  # the pool shut down under it
            raise TimeoutError from None
        finally:
            self._leave(key, fut)

    async def ready(self, spec: StructuredOutputs, timeout_s: float) -> None:
        """`wait` for a caller on an event loop: the compile runs on the pool."""
        key, fut = self._join(spec)
        try:
            async with asyncio.timeout(timeout_s):
                # Shielded: this caller's cancellation is `_leave`'s to judge, not a cancel of
                # a compile others may share.
                await asyncio.shield(asyncio.wrap_future(fut))
        except asyncio.CancelledError:
            if not fut.cancelled():
                raise  # this caller was cancelled
            raise TimeoutError from None  # the pool shut down under it
        finally:
            self._leave(key, fut)

    def _join(self, spec: StructuredOutputs) -> tuple[tuple[str, str], Future[xgr.CompiledGrammar]]:
        key = spec.key()
        fut = self.submit(spec)
        with self._lock:
            self._waiters[key] = self._waiters.get(key, 0) + 1
        return key, fut

    def _leave(self, key: tuple[str, str], fut: Future[xgr.CompiledGrammar]) -> None:
        with self._lock:
            left = self._waiters[key] - 1
            if left:
                self._waiters[key] = left
                return
            del self._waiters[key]
            if fut not in self._held and self._cache.get(key) is fut and fut.cancel():
                self._drop(key)  # never started: gone from the pool's queue too

    def _compile(self, spec: StructuredOutputs) -> xgr.CompiledGrammar:
        start = time.perf_counter()
        kind, text = spec.key()
        try:
            if kind in ("json", "json_object"):  # json_object: an object (OpenAI's), not any JSON value
                schema = text if kind == "json" else '{"type": "object"}'
                ebnf = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
                compiled = self._compiler.compile_grammar(ebnf.replace(_LOOSE_CHAR, _JSON_CHAR))
            elif kind == "regex":
                compiled = self._compiler.compile_regex(text)
            elif kind == "choice":
                choices = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text))
                compiled = self._compiler.compile_grammar(f"root ::= {choices}")
            elif kind == "grammar":
                compiled = self._compiler.compile_grammar(text)
            else:
                compiled = self._structural_tag(text)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError (and others) with the parser's words
            raise ValueError(f"{spec.field}: {_reason(e)}") from None
        # A grammar that compiles but that nothing can match (an empty character class, a rule
        # defined only by itself) left the request no first token: the engine failed it as a
        # fault, a 500, for the client's own spec.
        first = allocate_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(first, 0)
        if not bool(first.any()):
            raise ValueError(f"{spec.field}: no output can match it")
        with self._lock:  # compiles end on several threads
            self.stats.compiles += 1
            self.stats.compile_s += time.perf_counter() - start
        return compiled

    def _structural_tag(self, text: str) -> xgr.CompiledGrammar:
        """xgrammar's structural tag (`{"type": "structural_tag", "format": ...}`), or the form vLLM
        also takes, `{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`."""
        tag = json.loads(text)
        if isinstance(tag, dict) and "structures" in tag:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                     for s in tag["structures"]]
            return self._compiler.compile_structural_tag(items, list(tag.get("triggers", [])))
        return self._compiler.compile_structural_tag(text)

    def state(self, spec: StructuredOutputs) -> GrammarState:
        fut = self.submit(spec, count=False)
        with self._lock:
            self.stats.constrained_requests += 1
            hold = not fut.done() and fut not in self._held
            if hold:  # a request in the engine waits for it: never taken off the queue
                self._held.add(fut)
        if hold:
            fut.add_done_callback(self._unhold)
        return GrammarState(spec, fut, spec.after_token)

    def _unhold(self, fut: Future[xgr.CompiledGrammar]) -> None:
        with self._lock:
            self._held.discard(fut)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _reason(e: BaseException) -> str:
    """xgrammar's message without its time and C++ source location."""
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = re.sub(r"^\[[^\]]*\]\s*\S+\.(?:cc|h):\d+:\s*", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false:\s*", "", text) or type(e).__name__


class GrammarState:
    """One request's place in its grammar. Its matcher is built once the grammar is
    compiled (`ready`), replaying the output the request has by then; after that every
    appended token is accepted into it (`accept`).

    `after`: a token the grammar starts after (a thinking model's end of thinking, vLLM's
    structured outputs with a reasoning parser): until the output has it, the state is
    `dormant`: it allows every token and its matcher takes none."""

    def __init__(self, spec: StructuredOutputs, compiled: Future[xgr.CompiledGrammar],
                 after: int | None = None) -> None:
        self.spec = spec
        self._compiled = compiled
        self.matcher: xgr.GrammarMatcher | None = None
        self._ahead: int | None = None  # a token `take` accepted that the request has not appended yet
        self.after = after
        self.dormant = after is not None

    def ready(self, output_token_ids: list[int]) -> bool:
        """Whether the request can be scheduled: its grammar is compiled (its matcher is
        then built, with `output_token_ids` accepted). Raises the compile's ValueError, or
        one when the output so far does not match the grammar."""
        if self.matcher is not None:
            return True
        if not self._compiled.done():
            return False
        matcher = xgr.GrammarMatcher(self._compiled.result())
        start = 0
        if self.after is not None:  # the output the grammar applies to: after the first `after`
            start = output_token_ids.index(self.after) + 1 if self.after in output_token_ids else len(output_token_ids)
            self.dormant = self.after not in output_token_ids
        for i, token in enumerate(output_token_ids[start:], start):
            if not matcher.accept_token(token):
                raise ValueError(f"{self.spec.field}: output token {i} ({token}) does not match the grammar")
        self.matcher = matcher
        return True

    def wait(self, timeout_s: float) -> None:
        """Block until the grammar is compiled or `timeout_s` passed."""
        wait_futures([self._compiled], timeout=timeout_s)

    def accept(self, token: int) -> None:
        """Advance past a token the request appended (before its matcher exists, nothing:
        `ready` replays it; one `take` accepted already, nothing either). A token the
        grammar refuses is the request's fault."""
        if self.dormant:
            self.dormant = token != self.after  # (before its matcher exists `ready` finds it again)
            return
        if self._ahead is not None and self._ahead == token:
            self._ahead = None
            return
        self._settle()
        if self.matcher is not None and not self.matcher.accept_token(token):
            raise ValueError(f"{self.spec.field}: token {token} does not match the grammar")

    def take(self, token: int) -> bool:
        """Whether the grammar allows `token` next; if so it is accepted now, and the `accept`
        of the same token when the request appends it does nothing. Checking the pick costs
        one accept where masking ahead costs a whole row's mask (model_runner, on a CPU)."""
        assert self.matcher is not None, "sampling for a request whose grammar is not ready"
        if self.dormant:
            return True  # (`accept` sees the token when it is appended)
        self._settle()
        if not self.matcher.accept_token(token):
            return False
        self._ahead = token
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of `bitmask`: what the grammar allows next."""
        assert self.matcher is not None, "a constrained request was scheduled before its grammar was ready"
        if self.dormant:
            bitmask[row] = -1  # every bit: every token
            return
        self._settle()
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def _settle(self) -> None:
        """Undo a `take` whose token the request never appended (its step was dropped), so
        every other use sees the matcher where the request's output leaves it."""
        if self._ahead is not None:
            assert self.matcher is not None
            self.matcher.rollback(1)
            self._ahead = None

    def valid_drafts(self, drafts: list[int], keep_refused: bool = False) -> int:
        """How many leading `drafts` the grammar accepts from here (it stops at the first it
        refuses, and after one that completes it); the matcher is left where it was.
        `keep_refused`: count the first refused one too (drafts sampled from a draft model's q:
        verification must reject it, p being 0 there, and draw from the residual; cut, its
        position was drawn from p, and whether it was cut hung on the draft sampled, which
        biased the output away from the target's law)."""
        assert self.matcher is not None, "drafting for a request whose grammar is not ready"
        if self.dormant:
            # Every draft is allowed, up to `after` (kept: the grammar's first mask is then the
            # position after the last draft's, which `fill_along` gives); none past it, whose
            # masks would need the grammar to have taken the drafts before them.
            return drafts.index(self.after) + 1 if self.after in drafts else len(drafts)
        self._settle()
        n, refused = 0, False
        for token in drafts:
            if not self.matcher.accept_token(token):
                refused = True
                break
            n += 1
            if self.matcher.is_terminated():
                break
        self.matcher.rollback(n)
        return n + 1 if refused and keep_refused else n

    def fill_along(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Rows row..row+len(drafts) of `bitmask`: what the grammar allows at each position of
        a verification (here, then after each draft token); the matcher is left where it was.
        The drafts are ones `valid_drafts` kept: valid, but for a sampled draft's last one,
        which the grammar may refuse (verification rejects it there; no later row is read)."""
        assert self.matcher is not None, "verifying a request whose grammar is not ready"
        if self.dormant:
            bitmask[row : row + len(drafts) + 1] = -1
            if drafts and drafts[-1] == self.after:  # (`valid_drafts` cut them there) the grammar's start
                self.matcher.fill_next_token_bitmask(bitmask, row + len(drafts))
            return
        self._settle()
        self.matcher.fill_next_token_bitmask(bitmask, row)
        for i, token in enumerate(drafts):
            if not self.matcher.accept_token(token):
                if i != len(drafts) - 1:
                    raise ValueError(f"{self.spec.field}: draft token {token} does not match the grammar")
                bitmask[row + i + 1] = 0  # after a rejected draft: never read
                self.matcher.rollback(i)
                return
            if self.matcher.is_terminated():  # nothing may follow: the position is masked out whole
                bitmask[row + i + 1 :row + len(drafts) + 1] = 0
                self.matcher.rollback(i + 1)
                return
            self.matcher.fill_next_token_bitmask(bitmask, row + i + 1)
        self.matcher.rollback(len(drafts))

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and not self.dormant and self.matcher.is_terminated()

    def allowed(self, vocab_size: int) -> np.ndarray:
        """[vocab_size] bool: the tokens the grammar allows next (a row's mask, unpacked)."""
        mask = allocate_bitmask(1, vocab_size)
        self.fill(mask, 0)
        return np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")[:vocab_size].astype(bool)

    def allows_only(self, token_ids: Iterable[int], vocab_size: int) -> bool:
        """Whether nothing but `token_ids` may come next (a grammar at its end allows only the
        stop tokens), or nothing at all."""
        allowed = self.allowed(vocab_size)
        allowed[[t for t in token_ids if 0 <= t < vocab_size]] = False
        return not allowed.any()


def fill_bitmask(states: list[GrammarState | None], vocab_size: int) -> torch.Tensor | None:
    """[N, ceil(V / 32)] int32: row i allows what request i's grammar allows next (all
    bits set for a request without one, or whose grammar is dormant); None when no request
    has one that masks (a thinking answer's steps allocate and apply no mask)."""
    if all(s is None or s.dormant for s in states):
        return None
    bitmask = allocate_bitmask(len(states), vocab_size)
    for i, s in enumerate(states):
        if s is not None and not s.dormant:
            s.fill(bitmask, i)
    return bitmask


def verify_bitmask(states: list[GrammarState | None], drafts: list[list[int]], vocab_size: int) -> torch.Tensor | None:
    """[sum(len(d) + 1), ceil(V / 32)]: for verification's rows (each request's drafts and one
    more position, in order), what each position's grammar allows; None when no request has one
    that masks (a dormant one masks only the position after its drafts' `after`)."""
    if all(s is None or (s.dormant and not (d and d[-1] == s.after)) for s, d in zip(states, drafts)):
        return None
    bitmask = allocate_bitmask(sum(len(d) + 1 for d in drafts), vocab_size)
    row = 0
    for s, d in zip(states, drafts):
        if s is not None:
            s.fill_along(bitmask, row, d)
        row += len(d) + 1
    return bitmask


def allocate_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(V / 32)] int32 with every bit set (every token allowed)."""
    return xgr.allocate_token_bitmask(rows, vocab_size)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of tokens each row's grammar refuses."""
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
