"""Cost models fitted to a profile's points: seconds for any step the simulator needs.

The models are the shapes these costs have, fitted by non-negative least squares:

    prefill step   a + b*new + c*new*(cached + new/2)      linear work plus causal attention
    decode step    a + b*batch + c*S + q*S^2,  S = batch*context (the batch's KV tokens)
                                                            per-row work plus reading each row's KV
    mixed step     prefill(new, cached) + decode(batch, ctx) - decode's fixed part (one step, one overhead)
    KV transfer    a + bytes / bandwidth

The decode step's q*S^2: reading a KV byte costs more once the batch's KV outgrows the
caches (the tiny model's profile on a 2-core Xeon: per row-token 0.26 us at batch 8 x
2032 tokens, 0.5 us at batch 64-128; the linear fit put batch 128 x 2032 at 79 ms, 118
measured). A convex term in S is the simplest shape with that property; NNLS leaves it
at 0 where the points are linear (SmolLM2's profile).

Non-negative coefficients keep every prediction monotone in the work, so a
planner never sees a bigger batch get cheaper by fitting noise.

Inside the profile's grid the fit is then scaled by the measured/fitted ratio at the
nearest points (cost_grid.py): the shapes above are right in kind but not in detail
(SmolLM2's CPU decode step was fitted 28% short at batch 8), and the simulator's
queues amplify a step's error.

`HostCPU`: on a CPU profile the workers share the machine's cores with CPU work the
profile's step times leave out (the KV handoff's sender and receiver threads, the
gateway, HAProxy and a local client streaming every token); the simulator charges it
to the workers' steps when no core is idle (simulator.py, `_Cluster.charge`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from pdserve.cluster.planner.cost_grid import Ratio2D
from pdserve.cluster.planner.profile import Profile


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares, weighted by relative error (a decode step of 5 ms
    fitted 2 ms off is as useless as a prefill of 500 ms fitted 200 ms off). With 2-4
    coefficients every subset of free ones is tried: the best feasible fit is exact."""
    w = 1.0 / np.maximum(y, 1e-9)
    aw, yw = a * w[:, None], y * w
    n = a.shape[1]
    best, best_err = np.zeros(n), float(np.sum(yw**2))
    for mask in range(1, 1 << n):
        cols = [j for j in range(n) if mask >> j & 1]
        sol, *_ = np.linalg.lstsq(aw[:, cols], yw, rcond=None)
        if np.any(sol < 0):
            continue
        coef = np.zeros(n)
        coef[cols] = sol
        err = float(np.sum((aw @ coef - yw) ** 2))
        if err < best_err:
            best, best_err = coef, err
    return best


# CPU seconds per streamed token spent outside the workers on the serving host: the gateway
# replica 0.17 ms, the bench client 0.12 ms, HAProxy 0.02 ms. Measured by
# bench/serving_profile.py (each process's CPU time from /proc over a 10 s window inside
# the load, divided by the tokens streamed in it: 31.1%, 21.7% and 4.0% of a core at
# 1,829 tok/s; tiny model, Intel Xeon 2 cores, 2026-11-27, docs/performance.md). Not
# fitted to the planner's validation. A profile may carry its own (`serving_cpu_per_token_s`;
# without the client when it runs on another host).
DEFAULT_SERVING_CPU_PER_TOKEN_S = 0.31e-3


@dataclass(frozen=True)
class HostCPU:
    """A CPU profile's host: what competes with the workers' engine threads for its cores.

    `cores`: the profile machine's cores. `worker_threads`: torch threads per worker (the
    cores one worker's step keeps busy). `serving_cpu_per_token_s`: CPU outside the workers
    per streamed token. `transfer_cpu`: a KV handoff's threads are CPU work on both workers'
    hosts — each end costs the profile's transfer time: the profile times sender and
    receiver running side by side (profile_transfer.py), and py-spy put the decode worker's
    receiver thread at ~2.9 ms CPU per 256-token tiny-model handoff served, where the
    profile's transfer of 256 tokens takes 3.1 ms (docs/performance.md); the sender's
    side (gather, MAC, frames) is taken to cost the same."""

    cores: int
    worker_threads: int = 1
    serving_cpu_per_token_s: float = DEFAULT_SERVING_CPU_PER_TOKEN_S
    transfer_cpu: bool = True

    def __post_init__(self) -> None:
        if self.cores < 1 or self.worker_threads < 1 or not self.serving_cpu_per_token_s >= 0:
            raise ValueError(f"host: cores and worker_threads must be >= 1, the per-token CPU >= 0: {self}")

    @classmethod
    def of(cls, p: Profile) -> HostCPU | None:
        """The host of a profile measured on a CPU whose core count it recorded, else None
        (a GPU's steps do not share the host's cores; the KV moves on copy engines and NICs)."""
        cores = p.machine.get("cores")
        if not str(p.engine.device).startswith("cpu") or not isinstance(cores, int) or cores < 1:
            return None
        per_token = p.serving_cpu_per_token_s
        return cls(cores, max(1, p.engine.torch_threads),
                   DEFAULT_SERVING_CPU_PER_TOKEN_S if per_token is None else per_token)


@dataclass(frozen=True)
class CostModel:
    """Seconds for any step, from a profile's fitted coefficients."""

    prefill_coef: tuple[float, float, float]  # a, b (per new token), c (per new token x attended token)
    decode_coef: tuple[float, float, float]  # a, b (per row), c (per row x context token)
    transfer_coef: tuple[float, float]  # a, seconds per byte
    kv_bytes_per_token: int
    tokens_per_step: float = 1.0
    decode_quad: float = 0.0  # q: seconds per (KV token in the batch)^2
    host: HostCPU | None = None  # a CPU profile's host (None: the workers' steps are all the CPU there is)
    decode_ratio: Ratio2D | None = None  # measured / fitted decode step over (batch, context)
    prefill_ratio: Ratio2D | None = None  # measured / fitted prefill over (new tokens, cached tokens + 1)

    @classmethod
    def fit(cls, p: Profile) -> CostModel:
        pre = np.array([[1.0, q.new_tokens, q.new_tokens * (q.cached_tokens + q.new_tokens / 2)] for q in p.prefill])
        dec = np.array([[1.0, q.batch, q.batch * q.context, float(q.batch * q.context) ** 2] for q in p.decode])
        pc = _nnls(pre, np.array([q.seconds for q in p.prefill]))
        dc = _nnls(dec, np.array([q.seconds for q in p.decode]))
        if p.transfer:
            tr = np.array([[1.0, q.bytes] for q in p.transfer])
            tc = _nnls(tr, np.array([q.seconds for q in p.transfer]))
        else:
            tc = np.zeros(2)
        tps = p.speculative.tokens_per_step if p.speculative is not None else 1.0
        shape = cls((float(pc[0]), float(pc[1]), float(pc[2])), (float(dc[0]), float(dc[1]), float(dc[2])),
                    (float(tc[0]), float(tc[1])), p.kv_bytes_per_token, tps, float(dc[3]), HostCPU.of(p))
        decode_ratio = Ratio2D.of(((q.batch, q.context, q.seconds) for q in p.decode), shape.decode_s)
        # over (new tokens, cached + 1): a column per cached prefix the profile measured
        prefill_ratio = Ratio2D.of(((q.new_tokens, q.cached_tokens + 1, q.seconds) for q in p.prefill),
                                   lambda new, cached1: shape.prefill_s(new, cached1 - 1))
        return dataclasses.replace(shape, decode_ratio=decode_ratio, prefill_ratio=prefill_ratio)

    @property
    def fitted(self) -> CostModel:
        """The fitted shapes alone, without the grid's correction (for their own errors)."""
        return dataclasses.replace(self, decode_ratio=None, prefill_ratio=None)

    def _decode_step(self, rows: int, kv_tokens: float) -> float:
        """A decode-only step of `rows` rows reading `kv_tokens` of KV: the fixed part, per row,
        and the KV read; the grid's ratio scales the whole step."""
        a, b, c = self.decode_coef
        t = a + b * rows + c * kv_tokens + self.decode_quad * kv_tokens * kv_tokens
        if self.decode_ratio is None or rows <= 0:
            return t
        return t * self.decode_ratio.at(rows, kv_tokens / rows)

    def _decode_var(self, rows: int, kv_tokens: float) -> float:
        """The decode rows' part of a step that also prefills (whose fixed part it shares)."""
        return max(0.0, self._decode_step(rows, kv_tokens) - self.decode_coef[0])

    def _prefill_chunk(self, new_tokens: int, cached_tokens: int) -> float:
        """One prompt's chunk in a step, the step's fixed part included."""
        a, b, c = self.prefill_coef
        t = a + b * new_tokens + c * new_tokens * (cached_tokens + new_tokens / 2)
        return t * self.prefill_ratio.at(new_tokens, cached_tokens + 1) if self.prefill_ratio is not None else t

    def decode_growth(self, rows: int, kv_tokens: float, steps: int) -> float:
        """How much longer each step of a decode-only segment gets than the one before: the
        batch's KV grows `rows * tokens_per_step` a step. Exact when the model is linear in
        the KV; with `decode_quad` the mean over the segment's `steps` (its first and last
        step exact, the ones between a little long: the model is convex)."""
        grow = rows * self.tokens_per_step
        if self.decode_ratio is None and (self.decode_quad == 0.0 or steps <= 1):
            return self.decode_coef[2] * grow + self.decode_quad * (2 * kv_tokens + grow) * grow
        last = kv_tokens + max(1, steps - 1) * grow
        return (self._decode_step(rows, last) - self._decode_step(rows, kv_tokens)) / max(1, steps - 1)

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        return self._prefill_chunk(new_tokens, cached_tokens)

    def decode_s(self, batch: int, context: float) -> float:
        if batch <= 0:
            return 0.0
        return self._decode_step(batch, batch * context)

    def mixed_s(self, new_tokens: int, cached_tokens: int, batch: int, context: float) -> float:
        """A colocated step: a prefill chunk and `batch` decode rows in one forward pass."""
        if batch <= 0:
            return self.prefill_s(new_tokens, cached_tokens)
        if new_tokens <= 0:
            return self.decode_s(batch, context)
        return self.prefill_s(new_tokens, cached_tokens) + self._decode_var(batch, batch * context)

    def step_s(self, chunks: list[tuple[int, int]], rows: int, context_sum: float) -> float:
        """One engine step: prefill `chunks` ((new, cached) tokens of each prompt) and `rows`
        decode rows whose contexts sum to `context_sum`, in one forward pass (one fixed
        overhead: the prefill's when it prefills, else the decode's). With one chunk and no
        rows it is prefill_s; with rows only, decode_s; with both, mixed_s."""
        if not chunks:
            if rows <= 0:
                return 0.0
            return self._decode_step(rows, context_sum)
        pa = self.prefill_coef[0]
        t = pa + sum(self._prefill_chunk(n, cached) - pa for n, cached in chunks)
        if rows > 0:
            t += self._decode_var(rows, context_sum)
        return t

    def transfer_s(self, num_tokens: int) -> float:
        """One request's KV of `num_tokens` tokens handed over: the fixed part once, then the bytes."""
        a, per_byte = self.transfer_coef
        return a + per_byte * num_tokens * self.kv_bytes_per_token

    def transfer_bytes_s(self, num_tokens: int) -> float:
        """The link time of `num_tokens` tokens' KV alone (a part streamed while the prompt is computed)."""
        return self.transfer_coef[1] * num_tokens * self.kv_bytes_per_token

    def fit_errors(self, p: Profile) -> dict[str, tuple[float, str]]:
        """The worst relative error of each fitted model over the profile's points, with the point:
        how far to trust the simulator's times (a planner prints a warning past ~20%)."""
        rows: dict[str, list[tuple[float, str]]] = {
            "prefill": [(self.prefill_s(q.new_tokens, q.cached_tokens) / q.seconds - 1,
                         f"new={q.new_tokens} cached={q.cached_tokens}") for q in p.prefill],
            "decode": [(self.decode_s(q.batch, q.context) / q.seconds - 1, f"batch={q.batch} context={q.context}")
                       for q in p.decode],
            "transfer": [((self.transfer_coef[0] + self.transfer_coef[1] * q.bytes) / q.seconds - 1,
                          f"bytes={q.bytes}") for q in p.transfer],
        }
        return {k: max(v, key=lambda e: abs(e[0])) for k, v in rows.items() if v}
