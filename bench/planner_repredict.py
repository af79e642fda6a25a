"""The planner's predictions, again, against the measured numbers of a saved validation.

bench/planner_validation.py prints `pred / meas` per cell; this re-simulates the very same
requests (its workload: random lengths fixed, Poisson arrivals, a seed per rate, dispatch
7 ms) with the cost model as it is now and prints old prediction / new prediction /
measured per cell, with both errors. No server runs: a model change checked offline.

    python bench/planner_repredict.py   # the 2026-11-27 tiny and SmolLM2 runs
    python bench/planner_repredict.py --run smollm2 PROFILE.json VALIDATION.txt   # another pair
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from pdserve.cluster.bench.config import BenchConfig
from pdserve.cluster.planner.planner import parse_shape
from pdserve.cluster.planner.profile import Profile
from pdserve.cluster.planner.sim_metrics import summary
from pdserve.cluster.planner.sim_workload import Workload
from pdserve.cluster.planner.simulator import engine_settings, simulate

RESULTS = Path(__file__).parent / "results"
# name -> (requests per rate, input, output, rates in the order run: seed i for rate i), as the saved runs were
RUNS = {"tiny": (150, 256, 64, [4.0, 8.0, 16.0]), "smollm2": (40, 256, 32, [0.5, 1.0, 2.0])}
CELLS = [("TTFT p50", "ttft_s", "median"), ("TTFT p90", "ttft_s", "p90"), ("TPOT p50", "tpot_s", "median"),
         ("TPOT p90", "tpot_s", "p90")]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", nargs=3, action="append", metavar=("NAME", "PROFILE", "VALIDATION"),
                   help=f"a profile and a saved validation table of a run named as in {sorted(RUNS)}")
    a = p.parse_args()
    pairs = ([(name, Path(prof), Path(val)) for name, prof, val in a.run] if a.run else
             [(name, RESULTS / f"profile_{name}_2026-11-27.json", RESULTS / f"planner_validation_{name}_2026-11-27.txt")
              for name in RUNS])
    print("| model | config | rate | " + " | ".join(f"{c} old / new / meas ms | err old -> new" for c, _, _ in CELLS)
          + " |")
    print("|---|---|---:|" + "---:|---:|" * len(CELLS))
    for name, profile_path, validation in pairs:
        n, inp, out, rates = RUNS[name]
        profile = Profile.load(profile_path)
        engine, costs = engine_settings(profile), profile.costs()
        for line in validation.read_text().splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if not line.startswith("| ") or len(cells) != 10 or not cells[1][:1].isdigit():
                continue
            config, rate = cells[0], float(cells[1])
            cfg = BenchConfig("http://sim/v1", input_len=inp, output_len=out, num_requests=n,
                              seed=rates.index(rate), range_ratio=0.0, ignore_eos=True)
            shape = dataclasses.replace(parse_shape(config), dispatch_s=0.007)
            s = summary(simulate(costs, engine, shape, Workload.build(cfg, engine.block_size).at_rate(rate)))
            row = [name, config, f"{rate:g}"]
            for k, (_, metric, stat) in enumerate(CELLS):
                old, meas = (float(x) for x in cells[2 + 2 * k].split("/"))
                new = s[metric][stat] * 1000
                row += [f"{old:.1f} / {new:.{1 if new >= 10 else 2}f} / {meas:.1f}",
                        f"{(old - meas) / meas:+.0%} -> {(new - meas) / meas:+.0%}"]
            print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
