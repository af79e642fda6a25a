"""The HAProxy ingress's defences, written into the config Ray Serve generates.

Ray Serve renders haproxy.cfg from its template (ray/serve/_private/haproxy_templates.py)
and offers knobs for some of it (maxconn, `timeout client`: cluster/ingress.py sets
those), but none for these, which `harden` adds:

- the admin socket `mode 600` (Ray writes `mode 666 level admin`: any local user
  could drive the proxy); its directory is private too (cluster/ingress.py);
- the stats and metrics listeners bound to the HTTP frontend's own address
  (`--host`), not every interface;
- `timeout http-request` (headers, and with `option http-buffer-request` the
  start of the body, within so many seconds: a slow client cannot hold a
  connection open by trickling them) and `timeout http-keep-alive` (an idle
  connection between requests closes);
- at most so many connections at once per client address (a stick table that
  tracks `conn_cur` by source; one more is refused as it is accepted);
- no retry of a POST a gateway replica closed without an answer (only GET and HEAD
  are sent again: cluster/serve_app.py HAPROXY_RETRY_ENV);
- Serve's own watch of each request's client and deadline off (the gateway keeps its
  own): one task, one queue and one wait fewer a request in the replica;
- the answers HAProxy writes itself (a request that is not HTTP, headers too slow, no
  gateway replica to take it, one that closed without answering) as OpenAI's JSON error
  object, not HTML or plain text, each under its own status (Ray sends 500 for 502-504),
  and 503 with Retry-After: an OpenAI client reads what went wrong and retries as it would.

Every change is made at an exact line of the template as Ray 2.60 renders it; a
line that is not there exactly once is an `IngressConfigError` naming it, so a
Ray whose template changed fails loudly at start instead of serving unhardened.

Stdlib only: the wrapper that Ray starts in HAProxy's place (cluster/ingress.py)
loads this file by path, rewrites the config, and execs the real HAProxy.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import sys
from collections.abc import Sequence

# Ray Serve's per-request headers (ray/serve/_private/constants.py): with the first "?1" and the
# second <= 0, a replica's direct ingress runs the app in the request's own task, unwatched.
DISCONNECT_DISABLED_HEADER = "x-request-disconnect-disabled"
REQUEST_TIMEOUT_HEADER = "x-request-timeout-seconds"
# Request headers Ray Serve's replica decodes as UTF-8 before the app runs (replica.py, http_util.py;
# "-" and "_" alike in the multiplexed model id's and the session id's names).
UTF8_DECODED_HEADERS = ("x-request-id", "x-session-id", "x_session_id", "serve_multiplexed_model_id",
                        "serve-multiplexed-model-id")
# The first line of a config `harden` has adjusted: a second pass leaves it as it is.
MARKER = "# pdserve: hardened (cluster/ingress_config.py)"


# HAProxy's own answers (`http-error`): status -> (OpenAI error type, message, extra headers). No
# message has a single quote: the config quotes each body in them.
ERRORS: dict[int, tuple[str, str, tuple[str, ...]]] = {
    400: ("BadRequestError", "the request is not valid HTTP (its request line, a header, Content-Length or a "
                             "chunk size, or headers over 16 KiB)", ()),
    408: ("RequestTimeoutError", "the headers or the start of the body of the request did not come within the "
                                 "timeout of the server", ()),
    502: ("InternalServerError", "the gateway replica closed the connection without answering; retry", ()),
    503: ("ServiceUnavailableError", "no gateway replica is ready (starting, restarting or stopping); retry",
           ("Retry-After", "1")),
    504: ("InternalServerError", "the gateway replica did not answer in time", ()),
}


def error_body(status: int) -> str:
    """The JSON of HAProxy's answer of `status` (ERRORS), as the gateway's own errors are."""
    err_type, message, _ = ERRORS[status]
    return json.dumps({"error": {"message": message, "type": err_type, "param": None, "code": status}},
                      separators=(",", ":"))


class IngressConfigError(ValueError):
    """Ray Serve's HAProxy config is not what `harden` knows how to adjust (a ValueError:
    `pdserve serve` exits with `pdserve: error: ...` before Ray starts)."""


@dataclasses.dataclass(frozen=True)
class IngressSettings:
    """What `harden` writes (ServeConfig's flags, cluster/serve_config.py)."""

    max_connections_per_client: int = 256
    header_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 15.0

    def __post_init__(self) -> None:
        if self.max_connections_per_client < 1:
            raise ValueError(f"max_connections_per_client: must be >= 1, got {self.max_connections_per_client}")
        for name in ("header_timeout_s", "keep_alive_timeout_s"):
            value = getattr(self, name)
            if not 0 < value < 86400:
                raise ValueError(f"{name}: must be > 0 and < 86400 s, got {value}")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> IngressSettings:
        return cls(**json.loads(text))


def _ms(seconds: float) -> str:
    return f"{max(1, round(seconds * 1000))}ms"


def _one(pattern: str, text: str, what: str) -> re.Match[str]:
    found = list(re.finditer(pattern, text, flags=re.MULTILINE))
    if len(found) != 1:
        raise IngressConfigError(
            f"Ray Serve's HAProxy config has {len(found)} of {what} (pattern {pattern!r}), not 1: its template "
            "changed (a Ray other than 2.60?); pdserve cannot harden it. Use `--ingress proxy`, or a Ray version "
            "pdserve supports")
    return found[0]


def _replace(text: str, match: re.Match[str], new: str) -> str:
    return text[:match.start()] + new + text[match.end():]


def harden(text: str, settings: IngressSettings) -> str:
    """`text` (a haproxy.cfg Ray Serve rendered) with pdserve's defences; the same
    text again when it already has them. IngressConfigError if a line it adjusts is
    not there exactly once."""
    if text.startswith(MARKER):
        return text
    # Admin socket: owner only (Ray's manager, this user, still reaches it).
    m = _one(r"^(    stats socket \S+) mode 666 level admin expose-fd listeners$", text, "the admin socket line")
    text = _replace(text, m, f"{m.group(1)} mode 600 level admin expose-fd listeners")
    # The HTTP frontend's address, as Ray rendered it from `--host` ("*" for 0.0.0.0 and ::).
    m = _one(r"^frontend http_frontend\n    bind (\S+):(\d+)$", text, "the HTTP frontend's bind line")
    host = m.group(1)
    cap = settings.max_connections_per_client
    text = _replace(text, m, "\n".join([
        m.group(0),
        f"    # pdserve: at most {cap} connections at once per client address; one more is refused on accept",
        "    stick-table type ipv6 size 100k expire 60s store conn_cur",
        "    tcp-request connection track-sc0 src",
        f"    tcp-request connection reject if {{ sc0_conn_cur gt {cap} }}",
        "    # pdserve: a request a dying gateway replica closed unanswered is sent to another",
        "    # (retry-on empty-response, cluster/serve_app.py) only if it is a GET or HEAD: a POST may",
        "    # be what killed the replica, and would then kill the next (the poison-pill rule)",
        "    http-request disable-l7-retry if !METH_GET",
        "    # pdserve: the gateway watches each request's client and deadline itself (cluster/openai_app.py,",
        "    # --request-timeout); Serve's second watch in the replica (a task, a receive queue and a",
        "    # wait a request) is turned off, whatever the client sent",
        f"    http-request set-header {DISCONNECT_DISABLED_HEADER} ?1",
        f"    http-request set-header {REQUEST_TIMEOUT_HEADER} 0",
        "    # pdserve: a header Serve's replica decodes as UTF-8 (request id, session id, multiplexed model",
        "    # id) is dropped when it holds a byte outside printable ASCII: one such byte made every route",
        "    # a plain-text 500, /health included, before any of the gateway's code ran",
        *(f"    http-request del-header {name} if {{ req.fhdr({name}) -m reg [^[:print:]] }}"
          for name in UTF8_DECODED_HEADERS)]))
    m = _one(r"^frontend prometheus\n    bind :(\d+)$", text, "the metrics listener's bind line")
    text = _replace(text, m, f"frontend prometheus\n    bind {host}:{m.group(1)}")
    m = _one(r"^listen stats\n  bind \*:(\d+)$", text, "the stats listener's bind line")
    text = _replace(text, m, f"listen stats\n  bind {host}:{m.group(1)}")
    # Timeouts, in `defaults`: Ray renders no `timeout http-request` (no knob) and the
    # keep-alive one from Serve's HTTPOptions, which also sets the replicas' own servers.
    m = _one(r"^    timeout http-keep-alive \d+s$", text, "the `timeout http-keep-alive` line")
    text = _replace(text, m, f"    timeout http-keep-alive {_ms(settings.keep_alive_timeout_s)}")
    if re.search(r"^\s*timeout http-request ", text, flags=re.MULTILINE):
        raise IngressConfigError("Ray Serve's HAProxy config already sets `timeout http-request`: its template "
                                 "changed; pdserve cannot harden it")
    m = _one(r"^    timeout client \d+s$", text, "the `timeout client` line")
    text = _replace(text, m, "\n".join([
        m.group(0),
        "    # pdserve: a request's headers and the start of its body (a buffer's worth, or all of a",
        "    # smaller one) within this, else 408: trickling them does not hold a connection",
        f"    timeout http-request {_ms(settings.header_timeout_s)}",
        "    option http-buffer-request"]))
    # HAProxy's own answers as JSON (Ray's errorfile lines, which made 502-504 a plain-text 500, go).
    m = _one(r"^    errorfile 502 \S+\n    errorfile 503 \S+\n    errorfile 504 \S+$", text,
             "the `errorfile 502/503/504` lines")
    lines = ["    # pdserve: HAProxy's own answers as OpenAI's JSON error object, each under its own status"]
    for status, (_, _, header) in ERRORS.items():
        extra = f" hdr {header[0]} {header[1]}" if header else ""
        lines.append(f"    http-error status {status} content-type application/json{extra} "
                     f"string '{error_body(status)}'")
    text = _replace(text, m, "\n".join(lines))
    return f"{MARKER}\n{text}"


def harden_file(path: str, settings: IngressSettings) -> None:
    """Rewrite the config at `path` in place, under the lock Ray's writer takes
    (`<path>.lock`, ray/serve/_private/haproxy.py), so a reload never reads half of it."""
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
            hardened = harden(text, settings)
            if hardened != text:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(hardened)
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)


def config_paths(args: Sequence[str]) -> list[str]:
    """The config files of an HAProxy command line (`-f <file>`)."""
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == "-f"]


def wrapper_main(real_binary: str, settings_json: str, args: Sequence[str]) -> int:
    """What the wrapper Ray starts as HAProxy runs: harden each `-f` config, then
    become `real_binary` with the same arguments (the same pid, which Ray's manager
    watches). Returns 1, with the reason on stderr (Ray reports it as HAProxy's
    startup failure), when a config cannot be hardened."""
    try:
        settings = IngressSettings.from_json(settings_json)
        for path in config_paths(args):
            harden_file(path, settings)
    except (IngressConfigError, OSError, ValueError) as e:
        print(f"pdserve: the HAProxy ingress was not started: {e}", file=sys.stderr, flush=True)
        return 1
    try:
        os.execv(real_binary, [real_binary, *args])  # replaces this process
    except OSError as e:
        print(f"pdserve: cannot run HAProxy {real_binary}: {e}", file=sys.stderr, flush=True)
    return 127
