"""Ranks of a torch.distributed group in processes of their own (spawned), for the tests that run
one rank's code beside another's: each gets its rank, a free loopback port for the group's
rendezvous and a queue, and puts (rank, *what it returns) on the queue once."""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
from collections.abc import Callable
from typing import Any

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def spawn_ranks(target: Callable[..., None], size: int, timeout_s: float, *args: Any) -> dict[int, tuple[Any, ...]]:
    """Run `target(rank, port, results, *args)` for each rank; what each put after its rank, by rank.
    A rank that puts nothing within `timeout_s` fails the test; every process is gone on return."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, port, results, *args), daemon=True) for r in range(size)]
    for p in procs:
        p.start()
    got: dict[int, tuple[Any, ...]] = {}
    try:
        for _ in range(size):
            rank, *rest = results.get(timeout=timeout_s)
            got[rank] = tuple(rest)
    except queue.Empty:
        pytest.fail(f"{size - len(got)} of {size} ranks returned nothing in {timeout_s:g} s")
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got
