#!/usr/bin/env python3
"""The one table of bench/gpu_check.sh: reads what its steps left in $OUT (pytest's JUnit
XML reports, kernels_gpu.json, e2e.json), judges issue 15's GPU bars, and writes gpu_check.json and
gpu_check.txt (Markdown, ready for docs/gpu.md) beside them.

    python3 bench/gpu_summary.py OUT_DIR [--seconds S]

Exit status 1 when a test or a correctness check failed, a step left no result, or a step
raised; an unmet speed bar is reported, not a failure (the bars are what to reach).
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

# issue 15's bars for the end-to-end decode of the Llama-3-8B shape, with CUDA graphs
DECODE_BARS = {1: 70.0, 64: 60.0}  # % of the bytes / HBM-bandwidth limit


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def pytest_counts(path: Path) -> dict[str, int] | None:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def summarise(out: Path, seconds: float | None) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []  # {what, result, bar, ok}; ok None: information only

    def row(what: str, result: str, bar: str = "", ok: bool | None = None) -> None:
        rows.append({"what": what, "result": result, "bar": bar, "ok": ok})

    for name, what in (("pytest_gpu.xml", "tests/gpu: the engine on CUDA"),
                       ("pytest_kernels.xml", "tests/kernels on the device")):
        tests = pytest_counts(out / name)
        if tests is None:
            row(what, "no result", ok=False)
        else:
            row(what, f"{tests['passed']} passed, {tests['failures'] + tests['errors']} failed, "
                f"{tests['skipped']} skipped", "all pass", tests["failures"] + tests["errors"] == 0)

    kernels = _load(out / "kernels_gpu.json")
    device = None
    if kernels is None:
        row("kernels: bf16 checks against float64", "no result", ok=False)
    else:
        device = kernels.get("header", {}).get("device")
        checks = kernels.get("checks", [])
        passed = sum(c.get("status") == "PASS" for c in checks)
        row("kernels: bf16 checks against float64", f"{passed}/{len(checks)} PASS", "all pass",
            passed == len(checks) and bool(checks) and not kernels.get("errors"))
        for bar in kernels.get("bars", []):
            value = bar.get("value")
            shown = "n/a" if value is None else (f"{value:.1f}%" if "%" in str(bar.get("target")) else f"{value:.2f}x")
            row(f"kernel: {bar.get('name')}", shown, str(bar.get("target")), bool(bar.get("met")))
        ceilings = kernels.get("ceilings", {})
        if ceilings:
            row("ceilings", ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"
                                      for k, v in ceilings.items() if not isinstance(v, (dict, list))))

    e2e = _load(out / "e2e.json")
    if e2e is None:
        row("end to end", "no result", ok=False)
    else:
        device = device or e2e.get("device")
        for c in e2e.get("checks", []):
            row(f"e2e: {c['check']}", c["detail"], "holds", bool(c["ok"]))
        for err in e2e.get("errors", []):
            row("e2e: error", err, ok=False)
        for r in e2e.get("tiny", []) + e2e.get("llama", []):
            pct = r.get("pct_of_limit_peak", r.get("pct_of_limit_copy"))
            basis = "datasheet" if "pct_of_limit_peak" in r else "copy"
            bar_pct = DECODE_BARS.get(r["batch"]) if r["label"] == "llama cuda graphs" else None
            row(f"decode {r['label']}, batch {r['batch']}",
                f"{r['tok_s']:.0f} tok/s, {r['step_ms']:.2f} ms/step, {pct:.1f}% of the {basis} limit "
                f"({r.get('pct_of_limit_copy', 0):.1f}% of copy)",
                f">= {bar_pct:.0f}% of the limit" if bar_pct else "",
                None if bar_pct is None else pct >= bar_pct)
        for r in e2e.get("fp8_speedup", []):
            bar = r["batch"] == 1
            row(f"decode llama fp8 against bf16, batch {r['batch']}",
                f"{r['fp8_tok_s']:.0f} against {r['bf16_tok_s']:.0f} tok/s: {r['ratio']:.2f}x",
                ">= 1.6x" if bar else "", r["ratio"] >= 1.6 if bar else None)
        parity = e2e.get("chunked_prefill")
        if parity:
            row("prefill, one long step", f"{parity['prompt']} tokens in {parity['one_step_s'] * 1e3:.0f} ms, "
                f"{parity['one_step_tflops']:.1f} TFLOP/s")
    served = (e2e or {}).get("served")
    if served is not None:  # bench/gpu_served.py (step 3c) adds its results to e2e.json
        for c in served.get("checks", []):
            row(f"served: {c['name']}", c["detail"], "holds", bool(c["ok"]))
        for err in served.get("errors", []):
            row(f"served: error in {err['section']}", err["traceback"].strip().splitlines()[-1], ok=False)
        if sp := served.get("speed"):
            row(f"served over HTTP, {sp['streams']} streams (1P+1D on the card, ZeroMQ)",
                f"{sp['served_tok_s']:.0f} tok/s against the engine's {sp['engine_tok_s']:.0f}: "
                f"{sp['ratio']:.2f}x; TTFT {sp['ttft_median_ms']:.0f} ms, TPOT {sp['tpot_median_ms']:.1f} ms",
                ">= 0.85x", sp["ratio"] >= 0.85)
    failed = [r["what"] for r in rows if r["ok"] is False and not r["bar"].startswith((">=", "target"))]
    return {"device": device, "seconds": seconds, "rows": rows, "failed": failed}


def markdown(summary: dict[str, Any]) -> str:
    head = f"Device: {summary['device'] or 'unknown'}"
    if summary["seconds"] is not None:
        head += f"; bench/gpu_check.sh took {summary['seconds']:.0f} s"
    lines = [head, "", "| what | result | bar | |", "|---|---|---|---|"]
    for r in summary["rows"]:
        mark = {True: "met" if r["bar"].startswith(">=") else "pass", False: "NOT met"
                if r["bar"].startswith(">=") else "FAIL", None: ""}[r["ok"]]
        lines.append(f"| {r['what']} | {r['result']} | {r['bar']} | {mark} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--seconds", type=float, default=None, help="the whole check's wall time")
    args = ap.parse_args()
    summary = summarise(args.out, args.seconds)
    text = markdown(summary)
    (args.out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    (args.out / "gpu_check.txt").write_text(text)
    print(text)
    print("FAILED: " + "; ".join(summary["failed"]) if summary["failed"] else "no failures")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
