"""The Ray actors: the plain worker services of cluster/actors.py, one process (and one
GPU) each. Apart from the services so that those import, and run in process, without Ray."""

from __future__ import annotations

import ray

from pdserve.cluster.actors import DecodeService, EngineService, PrefillService

EngineWorkerActor = ray.remote(EngineService)
PrefillWorkerActor = ray.remote(PrefillService)  # a WorkerService that starts as prefill
DecodeWorkerActor = ray.remote(DecodeService)  # ... as decode
