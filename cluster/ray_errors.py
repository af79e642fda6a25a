"""Ray's exception types, where the cluster code catches them, importable without Ray.

A lent GPU machine cannot install Ray (its wheel is over what can travel there), yet its
check serves requests through the same gateway, backend and worker services in one
process (bench/gpu_served.py). Without Ray nothing raises these, so stand-ins do.
"""

from __future__ import annotations

try:
    from ray.exceptions import RayActorError, RayError
except ImportError:  # no Ray on this machine: the services run in this process

    class RayError(Exception):  # type: ignore[no-redef]
        """Stands in for ray.exceptions.RayError (never raised without Ray)."""

    class RayActorError(RayError):  # type: ignore[no-redef,misc]
        """Stands in for ray.exceptions.RayActorError (never raised without Ray)."""

__all__ = ["RayActorError", "RayError"]
