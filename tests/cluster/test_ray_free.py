"""The serving path imports and runs without Ray: a lent GPU machine cannot install Ray
(its wheel is over what can travel there), and its served check drives the gateway,
the backend and the worker services in one process (bench/gpu_served.py)."""

from __future__ import annotations

import subprocess
import sys

MODULES = ["pdserve.cluster.gateway", "pdserve.cluster.openai_app", "pdserve.cluster.disagg_backend",
           "pdserve.cluster.backend", "pdserve.cluster.actors", "pdserve.cluster.router"]


def test_the_serving_path_imports_with_ray_missing() -> None:
    code = ("import sys\nsys.modules['ray'] = None  # `import ray` now raises ImportError\n"
            + "".join(f"import {m}\n" for m in MODULES)
            + "from pdserve.cluster.ray_errors import RayActorError, RayError\n"
            "assert issubclass(RayActorError, RayError) and RayError.__module__ == 'pdserve.cluster.ray_errors'\n"
            "print('ok')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_with_ray_the_errors_are_rays_own() -> None:
    from ray.exceptions import RayActorError as Real

    from pdserve.cluster.ray_errors import RayActorError

    assert RayActorError is Real
