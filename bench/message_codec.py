"""Build, encode and decode of one step's token deltas (a TokenDeltaBatch of `--batch` one-token
deltas), in microseconds per batch: the typed-message cost the decode worker (build, encode)
and the gateway (decode) pay per step. For an A/B, run it from two checkouts, alternating
(docs/engine.md shows how with a git worktree).

    python bench/message_codec.py [--batch 16] [--calls 2000]
"""

from __future__ import annotations

import argparse
import timeit

from pdserve.workers.messages import TokenDelta, TokenDeltaBatch, decode_as, encode


def delta(i: int) -> TokenDelta:
    return TokenDelta(request_id=f"cmpl-{i:032x}", offset=i, token_ids=(1234,), text=" hello", finish_reason=None,
                      stop_token=None, stop_string=None, num_cached_tokens=0, cumulative_logprob=None, logprobs=None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--calls", type=int, default=2000)
    a = p.parse_args()
    deltas = tuple(delta(i) for i in range(a.batch))
    data = encode(TokenDeltaBatch(worker_id="d0", seq=5, deltas=deltas))
    assert decode_as(data, TokenDeltaBatch).deltas == deltas  # the round trip holds before it is timed
    for name, fn in (("build", lambda: tuple(delta(i) for i in range(a.batch))),
                     ("encode", lambda: encode(TokenDeltaBatch(worker_id="d0", seq=5, deltas=deltas))),
                     ("decode", lambda: decode_as(data, TokenDeltaBatch))):
        print(f"{name} {a.batch} deltas: {timeit.timeit(fn, number=a.calls) / a.calls * 1e6:.1f} us", flush=True)


if __name__ == "__main__":
    main()
