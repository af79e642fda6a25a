"""bench/kernels_gpu.py is run on a lent GPU with minutes of device time and
no second chance: its dry run (CPU, Triton interpreter, tiny shapes) must go
through every section and the --tune sweep here, with every check passing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


# On a GPU the script itself runs (no dry run needed), and the lent machines'
# Triton 3.6 interpreter fails on numpy >= 2.4 (int() of a 1-element array in
# its `range` over tensor bounds); the compiled kernels are unaffected.
@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU, run bench/kernels_gpu.py itself")
def test_dry_run_with_tune_sweep(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "kernels_gpu.py"), "--dry-run", "--tune"],
                          env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "kernels_gpu.json").read_text())
    assert not report["errors"], report["errors"]
    kernels = {c["kernel"] for c in report["checks"]}
    assert {"decode", "prefill", "write_kv", "rms_norm", "rope", "rope_kv", "silu_mul"} <= kernels
    assert all(c["status"] == "PASS" for c in report["checks"])

    rows = report["tuning"]
    from pdserve.kernels import configs

    for kernel, sweep in (("decode", configs.DECODE_SWEEP), ("prefill", configs.PREFILL_SWEEP)):
        mine = [r for r in rows if r["kernel"] == kernel]
        timed = {r["config"] for r in mine if r["us"] is not None}
        assert {c.label() for c in sweep} <= timed, \
            f"{kernel}: configs not timed: {set(c.label() for c in sweep) - timed}"
        assert any(r["default"] for r in mine), f"{kernel}: the default config was not in the sweep"
        # every config computed the attention (float32 under the interpreter)
        assert all(r["rel"] is not None and r["rel"] < 1e-4 for r in mine if r["us"] is not None)
    text = (tmp_path / "kernels_gpu.txt").read_text()
    assert "tuning sweep" in text and "-> decode" in text and "-> prefill" in text
