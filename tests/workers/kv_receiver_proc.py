"""A KV receiver in a process of its own, for the tests that kill or stop it (test_kv_link_liveness.py).

    python kv_receiver_proc.py real CREDITS [REQUEST_ID:DST_BLOCK:LAYERS ...]
        a ZmqKVReceiver over a small CPU cache, stalled (it never drains data: no acks, no verdict),
        with those requests registered; the torch import makes it take a few seconds to start.
    python kv_receiver_proc.py fake CREDITS
        a bare ROUTER that answers each new connection's first message (a sender's hello) with a
        credit grant of CREDITS, under the connection's key, and ignores everything else: a stalled
        receiver that starts at once (it imports neither torch nor pdserve, only the stdlib-only
        `auth` module from its file).

Both take the cluster secret from PDSERVE_CLUSTER_SECRET (the test's own).

Both print their address on one line once they listen, and exit when their stdin closes, so that they
never outlive the test that started them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path
from typing import Any

import msgpack
import zmq


def _exit_with_stdin() -> None:
    def watch() -> None:
        sys.stdin.read()
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def _auth_module() -> Any:
    path = Path(__file__).resolve().parents[2] / "workers" / "transfer" / "auth.py"
    spec = importlib.util.spec_from_file_location("kv_auth", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["kv_auth"] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


def fake(credits: int) -> None:
    auth = _auth_module()
    secret = auth.default_secret()
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind("tcp://127.0.0.1:*")
    print(sock.getsockopt_string(zmq.LAST_ENDPOINT), flush=True)
    seen: set[bytes] = set()
    while True:
        peer, _, hello, *_ = sock.recv_multipart()
        if peer not in seen:
            seen.add(peer)
            nonce = auth.new_nonce()
            key = auth.session_key(secret, msgpack.unpackb(hello)[2]["nonce"], nonce)
            grant = msgpack.packb([2, 2, {"credits": credits, "checksum": "crc32", "nonce": nonce}])  # KVCreditGrant
            sock.send_multipart([peer, auth.seal(key, auth.KV_TO_SENDER, 1, [grant]), grant])


def real(credits: int, registrations: list[str]) -> None:
    sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # tests/ (faults.py), as pytest's conftest has it
    from faults import Faults
    from kv_links import make_cache

    from pdserve.workers.transfer.zmq_backend import ZmqKVReceiver

    kv, _ = make_cache(2, 8)
    faults = Faults()
    faults.stall_receiver()
    receiver = ZmqKVReceiver(kv, "tcp://127.0.0.1:*", credits=credits, faults=faults)
    for spec in registrations:
        request_id, block, layers = spec.split(":")
        receiver.register(request_id, [int(block)], int(layers))
    print(receiver.address, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    _exit_with_stdin()
    if sys.argv[1] == "fake":
        fake(int(sys.argv[2]))
    else:
        real(int(sys.argv[2]), sys.argv[3:])
