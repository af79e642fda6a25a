"""bench/gpu_check.sh runs on a lent GPU with minutes of device time and no second try:
its dry run (CPU, tiny shapes) must go through every step and leave the files the device
tool can bring back (at most 8), with every check passing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, run bench/gpu_check.sh itself")
def test_gpu_check_dry_run_covers_every_step(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    files = sorted(p.name for p in out.iterdir())
    assert files == sorted(["gpu_check.log", "pytest_gpu.xml", "pytest_kernels.xml", "kernels_gpu.json",
                            "kernels_gpu.txt", "e2e.json", "gpu_check.json", "gpu_check.txt"])
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["failed"] == []
    what = [r["what"] for r in summary["rows"]]
    assert any(w.startswith("e2e: chunked prefill = chunked") for w in what)
    assert any(w.startswith("decode llama eager, batch") for w in what)
    assert any(w.startswith("kernel: decode") for w in what)
    e2e = json.loads((out / "e2e.json").read_text())
    assert e2e["errors"] == [] and all(c["ok"] for c in e2e["checks"])
    assert {r["batch"] for r in e2e["llama"]} == {1, 2}
    # step 3c: served over HTTP in one process, without Ray, its results inside e2e.json
    served = e2e["served"]
    assert served["errors"] == [] and served["checks"] and all(c["ok"] for c in served["checks"])
    assert served["correctness"]["equal"] == served["correctness"]["of"] > 0
    assert served["speed"]["served_tok_s"] > 0 and served["speed"]["engine_tok_s"] > 0
    assert any(w.startswith("served over HTTP") for w in what)
    assert "| what | result | bar |" in (out / "gpu_check.txt").read_text()


def test_summary_fails_when_a_step_left_nothing(tmp_path: Path) -> None:
    """A step that crashed before writing its result must turn the check red, not vanish from the table."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_summary.py"), str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(summary["failed"]) == {"tests/gpu: the engine on CUDA", "tests/kernels on the device",
                                      "kernels: bf16 checks against float64", "end to end"}
