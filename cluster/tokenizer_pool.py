"""Where the gateway tokenizes: threads sized to the cores, in two lanes, so that a
request's first token never waits behind another request's tokenization.

Tokenizing is the gateway's one per-request job that grows with the prompt (about
a microsecond a character with a byte-level BPE: a second for a megabyte), and it
runs before the first token. On one thread, a few long prompts delay every short
one behind them. Here:

* threads: a fast tokenizer's `encode` (transformers runs it as a batch of one)
  releases the GIL while Rust cuts the text, so threads tokenize in parallel, and
  the event loop keeps streaming meanwhile. Chat templates (Jinja, Python) hold
  the GIL, but they only join strings;
* two lanes: requests whose prompts total at most `short_chars` characters take
  the short lane (a thread per core), the others the long lane (a thread per core
  but one: that core stays with the event loop and the short lane). However many
  long prompts queue, a short one waits for none of them. With a thread per core
  in the long lane too, four long prompts on two cores took the event loop's
  share of the CPU and of the GIL: the short requests' p99 TTFT was 170-350 ms
  against 10-24 ms with one core left (bench/tokenizer_starvation.py --long 0,
  two runs each).

A short job runs on the event loop itself (`inline_chars`): handing it to a thread and
back costs more than it does (the hop ~100 us of CPU, with the GIL passed twice and the
loop woken; tokenizing "hello world" 16 us, 512 characters ~125 us, a one-message chat's
template and encode 75 us: bench/experiments/tokenize_inline.py, the Intel Xeon). Jobs that
may take long whatever their size (compiling a grammar) never run inline: the caller says so.

One tokenizer object is shared by every thread: transformers reconfigures the Rust
tokenizer (a mutable borrow, "Already borrowed" if another thread holds it) only
when truncation or padding change, and the gateway never asks for either.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

# A request whose prompts total at most this many characters takes the short lane:
# a few milliseconds of tokenizing (bench/tokenizer_starvation.py measures both lanes).
SHORT_CHARS = 8192
# ...and one of at most this many runs on the event loop (`TokenizerPool.run`): it
# holds the loop ~125 us at most, less than the hop to a thread would cost it.
INLINE_CHARS = 512


def available_cores() -> int:
    """The cores this process may run on (its affinity: a container's or Ray's share)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class TokenizerPool:
    """Runs blocking tokenizer work off the event loop. `threads`: the cores it sizes
    its lanes to (default: this process's); `short_chars` 0 makes one lane of
    `threads` threads (the bench's single-thread baseline: `TokenizerPool(1, 0, inline_chars=0)`);
    `inline_chars` 0 runs every job on a thread."""

    def __init__(self, threads: int | None = None, short_chars: int = SHORT_CHARS,
                 inline_chars: int = INLINE_CHARS) -> None:
        n = threads if threads is not None else available_cores()
        if n < 1:
            raise ValueError(f"threads: must be >= 1, got {n}")
        if short_chars < 0:
            raise ValueError(f"short_chars: must be >= 0, got {short_chars}")
        if inline_chars < 0:
            raise ValueError(f"inline_chars: must be >= 0, got {inline_chars}")
        self.threads, self.short_chars, self.inline_chars = n, short_chars, inline_chars
        self.long_threads = max(1, n - 1) if short_chars else n
        self._long = ThreadPoolExecutor(self.long_threads, thread_name_prefix="pdserve-tokenize-long")
        self._short = ThreadPoolExecutor(n, thread_name_prefix="pdserve-tokenize") if short_chars else self._long

    def lane(self, size: int) -> ThreadPoolExecutor:
        """The executor a job of `size` characters runs on."""
        return self._short if size <= self.short_chars else self._long

    async def run(self, size: int, fn: Callable[[], T], may_inline: bool = True) -> T:
        """`fn()` for a request of `size` characters (text, plus one per token id): here on
        the loop when it is that short and `may_inline` (False: `fn` may take long whatever
        the size), else on the lane for its size."""
        if may_inline and size <= self.inline_chars:
            return fn()
        return await asyncio.get_running_loop().run_in_executor(self.lane(size), fn)

    def shutdown(self) -> None:
        """Queued jobs are dropped (their requests are gone); running ones finish on their thread."""
        for lane in {self._short, self._long}:
            lane.shutdown(wait=False, cancel_futures=True)
