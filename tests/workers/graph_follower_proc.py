"""A tensor-parallel follower rank (workers/tp_follower.py, its own code) whose CUDA graphs are
the CPU stand-in of tests/workers/test_cuda_graphs.py, for the test that has rank 0 replay
stand-in graphs (test_tp_devices.py): started in the follower's place with the follower's
argument. Each replay appends its bucket ("8x1") as a line to the file PDSERVE_TEST_REPLAY_LOG
names, so that the test sees which graphs this rank replayed.

    python graph_follower_proc.py '<json: spec, rank, size, store_port, parent>'
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
sys.path[:0] = [str(here), str(here.parent)]  # test_cuda_graphs and the helpers it imports

from test_cuda_graphs import FakeGraph  # noqa: E402

from pdserve.workers import cuda_graphs, tp_follower  # noqa: E402

cuda_graphs.capture = functools.partial(cuda_graphs.capture, graph_factory=FakeGraph)  # type: ignore[assignment]
_replay = cuda_graphs.DecodeGraphs.replay


def _logged_replay(self: cuda_graphs.DecodeGraphs, bucket: cuda_graphs.Bucket, step: object) -> object:
    with open(os.environ["PDSERVE_TEST_REPLAY_LOG"], "a") as f:
        f.write(f"{bucket.seqs}x{bucket.rows}\n")
    return _replay(self, bucket, step)  # type: ignore[arg-type]


cuda_graphs.DecodeGraphs.replay = _logged_replay  # type: ignore[assignment,method-assign]
tp_follower.main()
