"""Start, wait for and stop a server process group: what the serving benchmarks share.

Each server runs in a session of its own, so `stop` reaches everything it
started (Ray, HAProxy, workers) with one signal to the group; SIGINT first (a
clean shutdown), SIGTERM after `grace_s` (one that ignores SIGINT), SIGKILL last.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PDSERVE = str(Path(sys.executable).parent / "pdserve")  # the console script beside this interpreter


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:  # a background job's: the server would inherit it
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a handler, which exec resets to the default
    with log.open("wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, deadline_s: float = 900) -> None:
    """Until GET `url`/health answers 200; SystemExit (with the log's tail) if the server
    exits or `deadline_s` passes first."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"{url}: the server exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit(f"{url}: not healthy in {deadline_s:.0f} s")


def stop(proc: subprocess.Popen[bytes], grace_s: float = 60) -> None:
    # SIGTERM after SIGINT: a server started from a background shell job ignores SIGINT (the
    # shell sets it so, and children inherit it), and SIGKILL would orphan its Ray daemons.
    for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGTERM, 30.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(wait)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue


def profile_dtype(path: str) -> str:
    """The dtype a planner profile's steps were timed in: a server the planner predicts must
    compute in it too (the server's CPU default may differ: bfloat16 where the CPU has it)."""
    from pdserve.cluster.planner.profile import Profile

    return str(Profile.load(path).engine.dtype)
