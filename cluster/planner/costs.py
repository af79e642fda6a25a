"""Cost models fitted to a profile's points: seconds for any step the simulator needs.

The models are the shapes these costs have, fitted by non-negative least squares:

    prefill step   a + b*new + c*new*(cached + new/2)      linear work plus causal attention
    decode step    a + b*batch + c*batch*context            per-row work plus reading each row's KV
    mixed step     prefill(new, cached) + decode(batch, ctx) - decode's fixed part (one step, one overhead)
    KV transfer    a + bytes / bandwidth

Non-negative coefficients keep every prediction monotone in the work, so a
planner never sees a bigger batch get cheaper by fitting noise.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pdserve.cluster.planner.profile import Profile


def _nnls(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Non-negative least squares, weighted by relative error (a decode step of 5 ms
    fitted 2 ms off is as useless as a prefill of 500 ms fitted 200 ms off). With 2-3
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


@dataclass(frozen=True)
class CostModel:
    """Seconds for any step, from a profile's fitted coefficients."""

    prefill_coef: tuple[float, float, float]  # a, b (per new token), c (per new token x attended token)
    decode_coef: tuple[float, float, float]  # a, b (per row), c (per row x context token)
    transfer_coef: tuple[float, float]  # a, seconds per byte
    kv_bytes_per_token: int
    tokens_per_step: float = 1.0

    @classmethod
    def fit(cls, p: Profile) -> CostModel:
        pre = np.array([[1.0, q.new_tokens, q.new_tokens * (q.cached_tokens + q.new_tokens / 2)] for q in p.prefill])
        dec = np.array([[1.0, q.batch, q.batch * q.context] for q in p.decode])
        pc = _nnls(pre, np.array([q.seconds for q in p.prefill]))
        dc = _nnls(dec, np.array([q.seconds for q in p.decode]))
        if p.transfer:
            tr = np.array([[1.0, q.bytes] for q in p.transfer])
            tc = _nnls(tr, np.array([q.seconds for q in p.transfer]))
        else:
            tc = np.zeros(2)
        tps = p.speculative.tokens_per_step if p.speculative is not None else 1.0
        return cls((float(pc[0]), float(pc[1]), float(pc[2])), (float(dc[0]), float(dc[1]), float(dc[2])),
                   (float(tc[0]), float(tc[1])), p.kv_bytes_per_token, tps)

    def prefill_s(self, new_tokens: int, cached_tokens: int = 0) -> float:
        a, b, c = self.prefill_coef
        return a + b * new_tokens + c * new_tokens * (cached_tokens + new_tokens / 2)

    def decode_s(self, batch: int, context: float) -> float:
        if batch <= 0:
            return 0.0
        a, b, c = self.decode_coef
        return a + b * batch + c * batch * context

    def mixed_s(self, new_tokens: int, cached_tokens: int, batch: int, context: float) -> float:
        """A colocated step: a prefill chunk and `batch` decode rows in one forward pass."""
        if batch <= 0:
            return self.prefill_s(new_tokens, cached_tokens)
        if new_tokens <= 0:
            return self.decode_s(batch, context)
        return self.prefill_s(new_tokens, cached_tokens) + self.decode_s(batch, context) - self.decode_coef[0]

    def step_s(self, chunks: list[tuple[int, int]], rows: int, context_sum: float) -> float:
        """One engine step: prefill `chunks` ((new, cached) tokens of each prompt) and `rows`
        decode rows whose contexts sum to `context_sum`, in one forward pass (one fixed
        overhead: the prefill's when it prefills, else the decode's). With one chunk and no
        rows it is prefill_s; with rows only, decode_s; with both, mixed_s."""
        if not chunks:
            if rows <= 0:
                return 0.0
            a, b, c = self.decode_coef
            return a + b * rows + c * context_sum
        pa, pb, pc = self.prefill_coef
        t = pa + sum(pb * n + pc * n * (cached + n / 2) for n, cached in chunks)
        if rows > 0:
            _, b, c = self.decode_coef
            t += b * rows + c * context_sum
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
