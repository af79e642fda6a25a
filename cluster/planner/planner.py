"""The planner: which pool sizes meet the SLOs, found by simulating each candidate.

Two questions, both answered by `simulate` on the bench's own workload:

  for_rate(rate)   the configurations (N colocated, or P prefill + D decode) that meet
                   the SLOs at `rate` for at least `target` of requests, with the fewest
                   workers: every split of 1, 2, ... workers is simulated, and the search
                   stops at the first count where any split meets them;
  for_workers(n)   DistServe's goodput (the highest rate with attainment >= target) of
                   n colocated and of every P+D = n, best first.

With profiles of workers of several tensor-parallel sizes (`pools`), a worker of N ranks
counts N devices, and the counts above are devices: every split of n devices into
prefill workers of one size and decode workers of another (the same or not), and into
colocated workers of each size, is a candidate.

Nothing here reads flags or prints: plan_cli.py does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.cluster.bench.metrics import SLO
from pdserve.cluster.bench.sweep import DISTSERVE_TARGET
from pdserve.cluster.planner.costs import CostModel
from pdserve.cluster.planner.sim_engine import EngineSettings
from pdserve.cluster.planner.sim_metrics import Latencies, goodput_rate
from pdserve.cluster.planner.sim_workload import Workload
from pdserve.cluster.planner.simulator import DEFAULT_MAX_IN_FLIGHT, ClusterShape, simulate
from pdserve.cluster.router.policy import RoutingPolicy

DEFAULT_MAX_WORKERS = 8


@dataclass(frozen=True)
class Evaluation:
    """One configuration simulated at one rate."""

    shape: ClusterShape
    rate: float
    attainment: float
    ttft_s: tuple[float | None, float | None, float | None]  # p50, p90, p99
    tpot_s: tuple[float | None, float | None, float | None]
    meets: bool  # attainment >= target

    def as_json(self) -> dict[str, object]:
        def ms(v: tuple[float | None, ...]) -> dict[str, float | None]:
            return {f"p{p}": None if x is None else x * 1000 for p, x in zip((50, 90, 99), v)}

        return {"config": self.shape.label, "workers": self.shape.num_workers, "devices": self.shape.devices,
                "colocated": self.shape.num_colocated, "prefill": self.shape.num_prefill,
                "decode": self.shape.num_decode, "prefill_tp": self.shape.prefill_tp,
                "decode_tp": self.shape.decode_tp, "colocated_tp": self.shape.colocated_tp, "rate": self.rate,
                "attainment": self.attainment,
                "ttft_ms": ms(self.ttft_s), "tpot_ms": ms(self.tpot_s), "meets": self.meets}


@dataclass(frozen=True)
class Goodput:
    """A configuration's goodput, and how it fares at that rate."""

    shape: ClusterShape
    rate: float | None  # None: even the lowest rate tried misses the target
    bounded: bool  # False: it met the target at every rate tried (the rate is a lower bound)
    at_goodput: Evaluation | None
    points: tuple[tuple[float, float], ...]  # (rate, attainment) simulated on the way

    def as_json(self) -> dict[str, object]:
        return {"config": self.shape.label, "workers": self.shape.num_workers, "devices": self.shape.devices,
                "goodput_rps": self.rate,
                "bounded": self.bounded, "at_goodput": self.at_goodput.as_json() if self.at_goodput else None,
                "points": [list(p) for p in self.points]}


@dataclass(frozen=True)
class RatePlan:
    rate: float
    best: tuple[Evaluation, ...]  # those meeting the SLOs with the fewest workers, best attainment first
    evaluated: tuple[Evaluation, ...]  # every configuration simulated, in search order


def parse_shape(text: str, policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE,
                max_in_flight: int = DEFAULT_MAX_IN_FLIGHT, dispatch_s: float = 0.0) -> ClusterShape:
    """'1P+2D' (prefill + decode workers) or '2' / '2C' / '2 colocated' -> a ClusterShape."""
    t = text.strip().upper().replace(" ", "")
    try:
        if "P" in t and "D" in t:
            p, _, d = t.partition("+")
            if not (p.endswith("P") and d.endswith("D")):
                raise ValueError
            num_p, num_d = int(p[:-1]), int(d[:-1])
            if min(num_p, num_d) < 1:  # `pdserve serve` needs a worker in each pool (--prefill/--decode >= 1)
                raise ValueError
            return ClusterShape.disaggregated(num_p, num_d, policy, max_in_flight, dispatch_s)
        n = int(t.removesuffix("COLOCATED").removesuffix("C"))
        if n < 1:
            raise ValueError
        return ClusterShape.colocated(n, max_in_flight, dispatch_s)
    except ValueError:
        raise ValueError(f"config: expected PP+DD (e.g. 1P+2D) or N colocated (e.g. 2 or 2C), got {text!r}") from None


def shapes(n: int, policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE, max_in_flight: int = DEFAULT_MAX_IN_FLIGHT,
           colocated: bool = True, dispatch_s: float = 0.0, sizes: tuple[int, ...] = (1,)) -> list[ClusterShape]:
    """Every way to run `n` devices on workers of the tensor-parallel `sizes` (one rank each: `n`
    workers): n / t colocated workers of t ranks, and P prefill workers of a ranks + D decode
    workers of b ranks for each P * a + D * b = n."""
    if n < 1:
        raise ValueError(f"workers: must be >= 1, got {n}")
    out = [ClusterShape.colocated(n // t, max_in_flight, dispatch_s, tp=t) for t in sizes if colocated and n % t == 0]
    for a in sizes:
        for b in sizes:
            out += [ClusterShape.disaggregated(p, (n - p * a) // b, policy, max_in_flight, dispatch_s, a, b)
                    for p in range(1, n) if n - p * a >= b and (n - p * a) % b == 0]
    return out


@dataclass(frozen=True)
class Planner:
    costs: CostModel
    engine: EngineSettings
    workload: Workload
    slo: SLO
    target: float = DISTSERVE_TARGET
    policy: RoutingPolicy = RoutingPolicy.CACHE_AWARE
    max_in_flight: int = DEFAULT_MAX_IN_FLIGHT
    colocated: bool = True  # colocated configurations are candidates
    dispatch_s: float = 0.0  # ClusterShape.dispatch_s: the gateway's time per request
    # A worker of each tensor-parallel size the planner may use: its profile's costs and engine
    # (empty: `costs` and `engine`, one rank).
    pools: Mapping[int, tuple[CostModel, EngineSettings]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.target <= 1:
            raise ValueError(f"attainment target: must be in (0, 1], got {self.target}")

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(self.pools)) or (1,)

    def shapes(self, n: int) -> list[ClusterShape]:
        return shapes(n, self.policy, self.max_in_flight, self.colocated, self.dispatch_s, self.sizes)

    def evaluate(self, shape: ClusterShape, rate: float | None) -> Evaluation:
        """Simulate `shape` on the workload sent at `rate` (None: the workload's own timing)."""
        reqs = self.workload.at_rate(rate)
        lat = Latencies.of(simulate(self.costs, self.engine, shape, reqs, self.pools))
        att = lat.attainment(self.slo)

        def pct(which: str) -> tuple[float | None, float | None, float | None]:
            return lat.percentile(which, 50), lat.percentile(which, 90), lat.percentile(which, 99)

        shown = self.workload.own_rate if rate is None else rate
        return Evaluation(shape, shown, att, pct("ttft"), pct("tpot"), att >= self.target)

    def for_rate(self, rate: float | None, max_workers: int = DEFAULT_MAX_WORKERS) -> RatePlan:
        """The configurations meeting the SLOs at `rate` with the fewest workers, or devices with
        pools of several ranks a worker (none found up to `max_workers`: `best` is empty,
        `evaluated` says how close each came)."""
        if max_workers < 1:
            raise ValueError(f"max workers: must be >= 1, got {max_workers}")
        # The rate every evaluation is at: the plan's too when none is (no shape fits the
        # devices), where it was NaN (a 'nan req/s' table, NaN in --json, which no JSON reads).
        shown = self.workload.own_rate if rate is None else rate
        evaluated: list[Evaluation] = []
        for n in range(1, max_workers + 1):
            here = [self.evaluate(s, rate) for s in self.shapes(n)]
            evaluated += here
            ok = sorted((e for e in here if e.meets), key=lambda e: (-e.attainment, _p90(e)))
            if ok:
                return RatePlan(shown, tuple(ok), tuple(evaluated))
        return RatePlan(shown, (), tuple(evaluated))

    def goodput(self, shape: ClusterShape, start: float, rel_tol: float = 0.02) -> Goodput:
        """DistServe's goodput of `shape`: the highest rate whose attainment is >= target."""
        search = goodput_rate(lambda r: self.evaluate(shape, r).attainment, start, self.target, rel_tol)
        at = self.evaluate(shape, search.rate) if search.rate is not None else None
        return Goodput(shape, search.rate, search.bounded, at, search.points)

    def for_workers(self, n: int, start: float | None = None) -> list[Goodput]:
        """Every configuration of `n` workers (devices) with its goodput, the highest first."""
        first = start if start is not None else self.start_rate(n)
        found = [self.goodput(s, first) for s in self.shapes(n)]
        return sorted(found, key=lambda g: -(g.rate or 0.0))

    def start_rate(self, n: int) -> float:
        """A first guess at `n` workers' goodput, to bracket from: the rate at which the
        workload's prefill alone would keep n workers busy."""
        reqs = self.workload.at_rate(None)
        mean_in = sum(r.prompt_len for r in reqs) / max(1, len(reqs))
        per_request = self.costs.prefill_s(max(1, round(mean_in)), 0)
        return max(1e-3, n / per_request / 4)


def _p90(e: Evaluation) -> float:
    return max(e.ttft_s[1] or 0.0, 0.0)
