"""What a client is told when its request fails: OpenAI's error status, type and message,
the field at fault, and for anything but a refusal the request id (a worker's traceback, its
pid, address and file paths stay in the server log under that id)."""

from __future__ import annotations

import logging

from pdserve.cluster.backend_api import ServerStoppingError, WorkerLostError
from pdserve.cluster.limits import RefusalReason, Refused
from pdserve.cluster.ray_errors import RayError
from pdserve.cluster.router import NoHealthyWorkerError
from pdserve.workers.async_engine import RequestFaultError
from pdserve.workers.inputs import ContextOverflowError

log = logging.getLogger(__name__)
RETRY_AFTER = {"Retry-After": "1"}  # 429 and 503: workers restart, slots free, in seconds
_MAX_MESSAGE = 500  # characters of an error message a client is sent


class APIError(Exception):
    def __init__(self, status: int, message: str, err_type: str, param: str | None = None,
                 headers: dict[str, str] | None = None, reason: RefusalReason | None = None,
                 over_context: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.err_type, self.param, self.headers = status, message, err_type, param, headers
        self.reason = reason  # set when the request was refused before it ran (counted by reason)
        self.over_context = over_context  # the prompt does not fit the context (a shorter one may)


def client_error(e: BaseException, rid: str) -> APIError:
    """What the client is told of an error of request `rid`: ours say what went
    wrong and name the field; anything else (a worker's traceback with its pid,
    address and paths: Ray's errors carry them in their text) is logged here
    under `rid`, and the client gets a plain line with that id."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, RayError):
        log.error("request %s failed in a worker: %s", rid, e)
        cause = getattr(e, "cause", None)  # a RayTaskError's exception, raised on the worker
        if isinstance(cause, ValueError) and not isinstance(cause, RayError):
            return bad_request(cause)  # the worker refused the input: its first line says why
        if isinstance(cause, RequestFaultError):
            return fault_error(rid)
        return APIError(500, f"internal error (request id {rid}): a worker failed; the server log has the details",
                        "InternalServerError")
    if isinstance(e, ValueError):
        return bad_request(e)
    if isinstance(e, RequestFaultError):
        log.error("request %s: %s", rid, e)
        return fault_error(rid)
    if isinstance(e, TimeoutError):
        return APIError(504, "the request did not finish within its deadline", "Timeout")
    if isinstance(e, ServerStoppingError):
        return APIError(503, "the server is shutting down: the request was stopped before it finished; retry it",
                        "ServiceUnavailableError", headers=RETRY_AFTER)
    if isinstance(e, (NoHealthyWorkerError, WorkerLostError)):
        log.warning("request %s: %s", rid, e)
        return APIError(503, "no healthy worker could take the request; retry later", "ServiceUnavailableError",
                        headers=RETRY_AFTER)
    log.error("request %s failed", rid, exc_info=e)
    return APIError(500, f"internal error (request id {rid}): the server log has the details", "InternalServerError")


def fault_error(rid: str) -> APIError:
    """A request the engine failed alone (workers/row_faults.py): the worker and the other
    requests are fine; this one is not retried anywhere (the poison-pill rule)."""
    return APIError(500, f"request {rid} failed in the engine: its sampling produced no valid token or raised; "
                         "the other requests were not affected, and retrying it as it is will fail again",
                    "InternalServerError")


def bad_request(e: ValueError) -> APIError:
    """Our ValueErrors start with the parameter name ("top_p: must be ..."): report it as `param`.
    Only the first line goes out, cut short: the message is the client's to read, not a dump."""
    msg = (str(e).splitlines() or [""])[0][:_MAX_MESSAGE]
    param = msg.split(":", 1)[0] if ":" in msg and " " not in msg.split(":", 1)[0] else None
    over = isinstance(e, ContextOverflowError)
    if isinstance(e, Refused):
        return APIError(400, msg, "BadRequestError", e.param, reason=e.reason, over_context=over)
    return APIError(400, msg, "BadRequestError", param, reason=RefusalReason.MALFORMED, over_context=over)


def unicode_text(param: str, text: str) -> str:
    """`text`, if it is Unicode a tokenizer can take (JSON may carry lone surrogates: "\\ud800")."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param}: not valid Unicode (a lone surrogate)", "BadRequestError", param,
                       reason=RefusalReason.MALFORMED) from None
    return text
