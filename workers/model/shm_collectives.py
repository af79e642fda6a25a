"""All-reduce and all-gather between the tensor-parallel ranks of one CPU node through shared
memory, spinning instead of sleeping: gloo over loopback took 1.6 ms an all-reduce of 2k floats
on a 2-core VM (two thread wake-ups a message hop), which made a TP=2 step of the tiny model 5.5x
a TP=1 step (docs/tensor-parallel.md). vLLM's CPU backend reduces through shared memory too.

One file in /dev/shm, mapped by every rank: a row of flags per rank (the round it wrote, the
round it finished reading) and a data slot per rank. A round: wait until every rank finished
reading the last round; write this rank's tensor into its slot; raise its `wrote` flag; wait for
every rank's; combine the slots (a sum in rank order, or the slots side by side: the same bytes
on every rank); raise its `read` flag. Stores are seen in program order on x86-64 (TSO), which
is what makes the flags a fence; elsewhere the ranks use gloo. A tensor larger than a slot goes
through gloo too (every rank decides alike: the shapes are the same on all).
"""

from __future__ import annotations

import glob
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

log = logging.getLogger(__name__)

# Spins between looks at the clock (and between yields of the core: a rank preempted by another
# process must get to run), and how long a round waits for a rank before the group is broken.
_SPINS = 2000
_ROUND_TIMEOUT_S = 600.0  # long: ranks compile their warm-up steps side by side, not in step
_FLAG_WORDS = 8  # a 64-byte line of int64 per rank: no two ranks' flags share a cache line


F = TypeVar("F", bound=Callable[..., Any])


def _opaque(fn: F) -> F:
    """`fn`, run as it is under torch.compile (a graph break), never traced. Called when a group
    is made, not at import: `torch.compiler.disable` imports torch._dynamo (1.4-2.5 s), which every
    process importing the model would pay, the gateway and the driver among them."""
    return cast(F, torch.compiler.disable(fn))  # type: ignore[no-untyped-call]


class ShmCollectiveError(RuntimeError):
    """A rank did not reach a round within its deadline (gone, or stuck): the group is broken."""


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


def create(size: int, slot_bytes: int) -> str | None:
    """A zeroed shared file for `size` ranks' flags and slots, its pages reserved now; its path
    (rank 0 unlinks it once every rank mapped it). None where shared memory cannot be used: not
    x86-64, or a /dev/shm too small for it (a container's 64 MiB default): then gloo."""
    if not supported():
        return None
    sweep_orphans()
    fd, path = tempfile.mkstemp(prefix=f"pdserve-tp-{os.getpid()}-", dir="/dev/shm")
    os.close(fd)
    return path if reserve(path, size * (_FLAG_WORDS * 8 + slot_bytes), "the ranks reduce through gloo") else None


def sweep_orphans(directory: str = "/dev/shm") -> list[str]:
    """Remove the tensor-parallel files (collectives', KV caches') of groups whose rank 0 is gone:
    each file's name carries its maker's pid, and a rank 0 killed outright (the OOM killer, a
    worker's restart by `ray.kill`) unlinks nothing; a KV file holds every rank's cache, GBs of
    RAM, until reboot. A pid reused since leaves its file (a live process: not ours to judge).
    Returns the paths removed."""
    removed = []
    for path in glob.glob(os.path.join(directory, "pdserve-tp*-*")):
        parts = os.path.basename(path).split("-")  # pdserve, tp or tpkv, pid, suffix
        if len(parts) < 4 or parts[1] not in ("tp", "tpkv") or not parts[2].isdigit():
            continue  # not ours, or named before the pid was in the name
        try:
            os.kill(int(parts[2]), 0)
            continue  # its maker runs (or a process of someone else's has its pid)
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        unlink(path)
        removed.append(path)
    if removed:
        log.warning("tensor parallel: removed %d shared-memory file(s) of groups whose rank 0 is gone: %s",
                    len(removed), removed)
    return removed


def reserve(path: str, nbytes: int, otherwise: str) -> bool:
    """Give the file at `path` (created if missing) `nbytes` of zeroed pages now; False, the file
    removed and a warning saying `otherwise`, when /dev/shm has no room for them. Reserved, not
    sparse: a page that had no room would kill the process that first touched it (SIGBUS)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        log.warning("tensor parallel: no room for %d bytes in /dev/shm (%s): %s", nbytes, e, otherwise)
        unlink(path)
        return False
    finally:
        os.close(fd)
    return True


def unlink(path: str) -> None:
    """Remove the file (its mappings stay valid)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmCollectives:
    def __init__(self, path: str, size: int, rank: int, slot_bytes: int,
                 round_timeout_s: float = _ROUND_TIMEOUT_S) -> None:
        self.size, self.rank, self.slot_bytes, self.path = size, rank, slot_bytes, path
        self.round_timeout_s = round_timeout_s
        # Whether the other ranks still run (rank 0 sets it: its followers' processes): a round
        # waiting on a rank that is gone fails at once, not at its deadline.
        self.alive: Callable[[], bool] = lambda: True
        raw = torch.from_file(path, shared=True, size=size * (_FLAG_WORDS * 8 + slot_bytes), dtype=torch.uint8)
        self._raw = raw
        self.flags = raw[: size * _FLAG_WORDS * 8].view(torch.int64).view(size, _FLAG_WORDS)
        self.data = raw[size * _FLAG_WORDS * 8 :].view(size, slot_bytes)
        self.round = 0
        # Opaque to torch.compile (a graph break at each): their flags and spins are side effects
        # on shared memory that a traced graph would fold or reorder.
        self.all_reduce = _opaque(self._all_reduce)
        self.all_gather = _opaque(self._all_gather)

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes and x.device.type == "cpu"

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place: slots added in rank order, the same bits on every rank."""
        slots = self._exchange(x)
        torch.sum(slots, dim=0, out=x.view(-1)) if x.is_contiguous() else x.copy_(slots.sum(0).view_as(x))
        self._done()
        return x

    def _all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' `x` side by side on the last dimension (the vocabulary's shards)."""
        slots = self._exchange(x)
        out = torch.cat([slots[r].view(x.shape) for r in range(self.size)], dim=-1)
        self._done()
        return out

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x`, as [size, numel] views of the slots (valid until `_done`)."""
        self.round += 1
        self._wait(1, self.round - 1)  # every rank read the last round's slots: ours may be rewritten
        nbytes = x.numel() * x.element_size()
        slots = self.data[:, :nbytes].view(x.dtype)
        slots[self.rank].copy_(x.reshape(-1))
        self.flags[self.rank, 0] = self.round  # after the data: a rank that sees it sees the data
        self._wait(0, self.round)
        return slots

    def _done(self) -> None:
        self.flags[self.rank, 1] = self.round

    def _wait(self, column: int, value: int) -> None:
        flags = self.flags[:, column]
        deadline = None
        while bool((flags < value).any()):
            for _ in range(_SPINS):
                if not bool((flags < value).any()):
                    return
            time.sleep(0)
            now = time.monotonic()
            deadline = deadline or now + self.round_timeout_s
            if now > deadline or not self.alive():
                late = [r for r in range(self.size) if int(flags[r]) < value]
                why = "are gone" if now <= deadline else f"did not reach it in {self.round_timeout_s:g} s"
                raise ShmCollectiveError(f"tensor parallel: rank(s) {late} of round {value} {why}")

