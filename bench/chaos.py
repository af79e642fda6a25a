"""The chaos matrix of issue 13: real processes of a real `pdserve serve` killed,
stopped, crashed or cut off under streaming greedy load, and what the cluster made
of it (tests/chaos/scenarios.py has the matrix, the *_faults.py beside it the
scenarios, tests/chaos/harness.py the harness; docs/reliability.md the results).

Columns: requests of the scenario's load; ok (exactly the offline engine's greedy
text); clean errors and dropped connections that no survivor could have avoided
(the only decode worker, the gateway, the server itself down); wrong; hung (a read
or a request past its deadline); lost (not ok though a survivor could serve it);
what the workers held after the drain (KV blocks / KV registrations / asyncio tasks
and threads above their baseline); seconds from the fault's end to the pool back to
size and /health 200 "ok" (budget: 1.5 x model load + 10 s); requests after recovery.

    python bench/chaos.py                    # every scenario (~10 minutes on 2 cores)
    python bench/chaos.py --only a,e,f       # some (b, g, i: both of their rows)
    python bench/chaos.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from machine import cpu_name

# The harness is test tooling (tests/chaos/, the package `chaos`), not part of pdserve: tests/ goes first
# on sys.path, as pytest's conftest puts it, ahead of this script's own folder (this file is chaos.py too).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from chaos.scenarios import BY_KEY, MODEL_SPEC, SCENARIOS, counters_line, run_matrix, table  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="",
                    help="comma-separated scenario keys (a, a1, b, b1, ..., i2, j, k, k2, l, m, n); default: all")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--model", default=None, help="a model directory (default: a tiny model made in a temp dir)")
    ap.add_argument("--log-dir", default=None, help="where the servers' logs go (default: a temp dir)")
    return ap.parse_args()


def keys(only: str) -> list[str]:
    if not only:
        return [s.key for s in SCENARIOS]
    out: list[str] = []
    for k in (x.strip() for x in only.split(",") if x.strip()):
        expanded = [s.key for s in SCENARIOS if s.key == k or (s.key.startswith(k) and s.key[len(k):].isdigit())]
        if not expanded:
            raise SystemExit(f"--only: unknown scenario {k!r} (known: {', '.join(BY_KEY)})")
        out += expanded
    return out


def machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} cores"


def main() -> int:
    a = parse_args()
    chosen = keys(a.only)
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-chaos-"))
    log_dir = Path(a.log_dir) if a.log_dir else tmp / "logs"
    start = time.monotonic()

    def log(line: str) -> None:
        print(f"[chaos {time.monotonic() - start:6.1f}s] {line}", file=sys.stderr, flush=True)

    model = a.model
    if model is None:
        from pdserve.workers.tiny.builder import TinyModelSpec, make_tiny_model

        log("making the tiny model ...")
        model = str(make_tiny_model(tmp / "model", TinyModelSpec(**MODEL_SPEC), progress=False))  # type: ignore[arg-type]
    print(f"# pdserve chaos matrix\ncommand: python {' '.join(sys.argv)}\nmachine: {machine()}\n"
          f"model: {model}\nlogs: {log_dir}\n", flush=True)
    try:
        results = run_matrix(model, chosen, log_dir, log=log)
    finally:
        # The model it made goes (each run left one in /tmp); the logs stay where they were said to be.
        shutil.rmtree(tmp / "model", ignore_errors=True)
        if a.log_dir:
            shutil.rmtree(tmp, ignore_errors=True)
    print(table(results))
    for r in results:
        if r.fault is not None or r.notes:
            fault = r.fault
            what = f"{fault.what} {fault.target} (pid {fault.pid}) {fault.note}".strip() if fault else ""
            print(f"\n({r.key}) {what}")
            if r.counters:
                print(f"  - the cluster counted: {counters_line(r)}")
            for note in r.notes:
                print(f"  - {note}")
    passed = sum(r.passed for r in results)
    print(f"\n{passed} of {len(results)} passed in {time.monotonic() - start:.0f} s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": " ".join(sys.argv), "machine": machine(), "results": [r.as_dict() for r in results]},
                      f, indent=2)
    return 0 if all(r.passed or r.skipped for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
