"""Which prefill:decode split the observed traffic wants, for the workers the cluster has.

`recommend` simulates the window's traffic (traffic.py) on every split of the
current worker count (P >= 1 prefill + D >= 1 decode, P + D fixed: a switch moves
a worker between pools, it adds none) and picks the one with the highest
predicted SLO attainment. The current split stays unless another beats it by
`margin` (a switch costs a drain and the moved worker's prefix cache, so noise
in a window must not flip roles back and forth), and a recommended change moves
one worker per decision: the next window re-plans with the new split measured.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster.bench.metrics import SLO
from pdserve.cluster.planner.costs import CostModel
from pdserve.cluster.planner.sim_engine import EngineSettings
from pdserve.cluster.planner.sim_metrics import Latencies
from pdserve.cluster.planner.simulator import ClusterShape, simulate
from pdserve.cluster.planner.traffic import TrafficWindow
from pdserve.cluster.router.policy import WorkerRole

DEFAULT_MARGIN = 0.05  # attainment a new split must gain over the current one
DEFAULT_SIM_REQUESTS = 200


@dataclass(frozen=True, order=True)
class Split:
    prefill: int
    decode: int

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(f"split: needs >= 1 prefill and >= 1 decode worker, got {self.prefill}P+{self.decode}D")

    @property
    def label(self) -> str:
        return f"{self.prefill}P+{self.decode}D"


@dataclass(frozen=True)
class Recommendation:
    current: Split
    best: Split  # the split the prediction prefers (current unless another wins by the margin)
    predicted: dict[Split, float]  # predicted attainment per split
    observed_attainment: float | None  # the window's own, from the gateway's histograms (a lower bound)
    rate: float
    mean_prompt: float | None
    mean_output: float | None

    @property
    def move(self) -> tuple[WorkerRole, WorkerRole] | None:
        """(from, to) for one worker toward `best`; None to keep the split."""
        if self.best.prefill > self.current.prefill:
            return WorkerRole.DECODE, WorkerRole.PREFILL
        if self.best.prefill < self.current.prefill:
            return WorkerRole.PREFILL, WorkerRole.DECODE
        return None

    def describe(self) -> str:
        preds = ", ".join(f"{s.label} {a:.0%}" for s, a in sorted(self.predicted.items()))
        obs = "n/a" if self.observed_attainment is None else f"{self.observed_attainment:.0%}"
        what = "keep" if self.move is None else f"move one worker {self.move[0].value} -> {self.move[1].value}"
        return (f"planner: {self.rate:.2f} req/s, mean prompt {self.mean_prompt or 0:.0f} / output "
                f"{self.mean_output or 0:.0f} tokens; SLO attainment observed {obs}, predicted {preds}; "
                f"{self.current.label} -> {self.best.label}: {what}")


def splits(num_workers: int) -> list[Split]:
    return [Split(p, num_workers - p) for p in range(1, num_workers)]


def predicted_attainment(costs: CostModel, engine: EngineSettings, window: TrafficWindow, split: Split, slo: SLO,
                         num_requests: int = DEFAULT_SIM_REQUESTS, dispatch_s: float = 0.0, seed: int = 0) -> float:
    requests = window.synthetic_requests(num_requests, engine.block_size, seed, engine.max_model_len)
    shape = ClusterShape.disaggregated(split.prefill, split.decode, dispatch_s=dispatch_s)
    return Latencies.of(simulate(costs, engine, shape, requests)).attainment(slo)


def observed_attainment(window: TrafficWindow, slo: SLO) -> float | None:
    """The window's SLO attainment as its histograms tell it: the lowest of the shares
    within the TTFT, the TPOT and the E2E SLO, each that is set (the histograms are separate,
    so a request's values together are not known: the joint share is at most this). An E2E
    SLO counts as the prediction counts it: left out, a window of late requests read as met."""
    from pdserve.cluster.planner.traffic import fraction_at_most

    limits = ((window.ttft, slo.ttft), (window.tpot, slo.tpot), (window.e2e, slo.e2e))
    parts = [fraction_at_most(b, lim) for b, lim in limits if lim is not None]
    known = [p for p in parts if p is not None]
    return min(known) if known else None


def recommend(costs: CostModel, engine: EngineSettings, window: TrafficWindow, current: Split, slo: SLO,
              margin: float = DEFAULT_MARGIN, num_requests: int = DEFAULT_SIM_REQUESTS, dispatch_s: float = 0.0,
              seed: int = 0) -> Recommendation:
    """The split the window's traffic wants among every split of `current`'s worker count."""
    n = current.prefill + current.decode
    predicted = {s: predicted_attainment(costs, engine, window, s, slo, num_requests, dispatch_s, seed)
                 for s in splits(n)}
    # Best by attainment; among equals, the one nearest the current split (fewest moves).
    best = max(predicted, key=lambda s: (predicted[s], -abs(s.prefill - current.prefill)))
    if predicted[best] < predicted[current] + margin:
        best = current
    return Recommendation(current, best, predicted, observed_attainment(window, slo), window.rate,
                          window.mean("prompt_tokens"), window.mean("generation_tokens"))
