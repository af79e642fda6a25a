"""What a process pays to start. The gateway replica, the `pdserve serve` driver and an eager
worker do not import torch._dynamo: 1-2.5 s of each start on a 2-core machine, and a gateway
replica that Serve restarts after a crash serves again that much later. A compiled worker
imports it when it compiles, not before. The CLI reads its flags and the serve settings without
torch at all (`pdserve --help` in 0.3 s, not 2.7)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pdserve.workers.tiny.builder import default_model_dir

SETTINGS_ONLY = """
import json, sys
from pdserve.cluster.cli import build_parser
build_parser().parse_args(["serve", "--model", "tiny", "--mode", "colocated"])
import pdserve.cluster.serve_app, pdserve.cluster.serve_config
print(json.dumps(sorted(m for m in ("torch", "transformers") if m in sys.modules)))
"""

CHILD = """
import json, sys
import torch
import pdserve.cluster.openai_app, pdserve.cluster.serve_app  # the gateway replica's and the driver's imports
after_imports = sorted(m for m in ("torch._dynamo", "transformers.modeling_utils") if m in sys.modules)
from pdserve import LLM, SamplingParams
llm = LLM("tiny", enforce_eager=True)
out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=4, temperature=0))
print(json.dumps({
    "after_imports": after_imports,
    "after_engine": sorted(m for m in ("torch._dynamo", "transformers.modeling_utils") if m in sys.modules),
    "tokens": len(out[0].outputs[0].token_ids),
    # The model is built with torch's random init switched off; anyone else's layers still draw theirs.
    "linear_init_restored": bool(torch.nn.Linear(8, 8).weight.abs().sum() > 0),
    "embedding_init_restored": bool(torch.nn.Embedding(8, 8).weight.abs().sum() > 0),
}))
"""


def test_the_gateway_the_driver_and_an_eager_engine_start_without_dynamo() -> None:
    default_model_dir(progress=False)  # built here if it is not yet: building it imports transformers' models
    env = {**os.environ, "PDSERVE_DTYPE": "float32"}
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen["after_imports"] == [], seen
    assert seen["after_engine"] == [], seen
    assert seen["tokens"] == 4
    assert seen["linear_init_restored"] and seen["embedding_init_restored"]


def test_the_cli_and_the_serve_settings_import_no_torch() -> None:
    run = subprocess.run([sys.executable, "-c", SETTINGS_ONLY], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.strip().splitlines()[-1]) == []
