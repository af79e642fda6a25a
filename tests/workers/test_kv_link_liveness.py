"""Liveness and resync of the KV link (the control plane's heartbeats and socket monitor, `workers/link_monitor.py`).

A sender waiting on a receiver that died, hangs or was never there gives up within seconds with PEER_LOST,
not at the (long) deadline it was given; after a lost connection the sender reconnects, says hello again
and takes the receiver's fresh, full window of credits. Receivers that are killed or stopped run in a
process of their own (`kv_receiver_proc.py`), always killed (and continued first) in `finally`.

Loopback only; every wait is bounded, each test takes a few seconds at most.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest
import torch.distributed as dist
from faults import Faults
from kv_links import GROUP_TIMEOUT_S, eventually, make_cache, soon

zmq = pytest.importorskip("zmq")

from pdserve.workers import link_monitor  # noqa: E402
from pdserve.workers.messages import FailReason, TransferState  # noqa: E402
from pdserve.workers.transfer import TransferError, auth  # noqa: E402
from pdserve.workers.transfer.nccl_backend import NcclKVReceiver, NcclKVSender  # noqa: E402
from pdserve.workers.transfer.zmq_backend import ZmqKVReceiver, ZmqKVSender  # noqa: E402

pytestmark = pytest.mark.skipif(not link_monitor.heartbeats_supported(), reason="libzmq < 4.2: no heartbeats")

PROC = Path(__file__).with_name("kv_receiver_proc.py")
LONG = 60.0  # the deadline the sender is given: every give-up below must come long before it
HEARTBEAT_S = (link_monitor.HEARTBEAT_IVL_MS + link_monitor.HEARTBEAT_TIMEOUT_MS) / 1000  # a hang is seen within


@contextmanager
def receiver_process(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """Start `kv_receiver_proc.py args`; yields (process, its address). Continued and killed on the way out."""
    env = {**os.environ, auth.SECRET_ENV: auth.default_secret().key.hex()}  # the link's two ends must agree
    proc = subprocess.Popen([sys.executable, str(PROC), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, cwd=PROC.parent, env=env)
    try:
        assert proc.stdout is not None
        address = proc.stdout.readline().strip()
        assert address.startswith("tcp://"), f"receiver process did not start (rc {proc.poll()})"
        yield proc, address
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        assert proc.stdin is not None
        proc.stdin.close()
        if proc.stdout is not None:
            proc.stdout.close()


def fake_receiver(credits: int) -> AbstractContextManager[tuple[subprocess.Popen[str], str]]:
    """A stalled receiver process that starts at once: it grants `credits` and never acks."""
    return receiver_process("fake", str(credits))


def later(seconds: float, action: Callable[[], None]) -> threading.Timer:
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


def raises_peer_lost(call: Callable[[], None]) -> tuple[TransferError, float]:
    """Run `call`; it must raise TransferError(PEER_LOST). Returns the error and how long the call took."""
    start = time.monotonic()
    with pytest.raises(TransferError) as err:
        call()
    took = time.monotonic() - start
    assert err.value.reason is FailReason.PEER_LOST, err.value
    return err.value, took


def rebind(make: Callable[[], ZmqKVReceiver]) -> ZmqKVReceiver:
    """`make()` a receiver on the port another just left (libzmq frees a closed listener asynchronously)."""
    end = soon(3)
    while True:
        try:
            return make()
        except zmq.ZMQError:
            if time.monotonic() > end:
                raise
            time.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TcpProxy:
    """Forwards each TCP connection made to `address` to `upstream` (tcp://host:port); `cut()` drops the
    connections open now, as a network failure would, and later ones are forwarded again. One thread."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream[len("tcp://"):].rpartition(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"
        self._peer: dict[socket.socket, socket.socket] = {}
        self._cut = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tcp-proxy", daemon=True)
        self._thread.start()

    def cut(self) -> None:
        self._cut.set()
        assert eventually(lambda: not self._cut.is_set())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self._drop_all()
        self._listener.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._cut.is_set():
                self._drop_all()
                self._cut.clear()
            ready, _, _ = select.select([self._listener, *self._peer], [], [], 0.02)
            for sock in ready:
                if sock is self._listener:
                    client, _ = self._listener.accept()
                    try:
                        server = socket.create_connection(self._upstream, timeout=1)
                    except OSError:
                        client.close()
                        continue
                    self._peer[client], self._peer[server] = server, client
                elif sock in self._peer:
                    try:
                        data = sock.recv(1 << 16)
                        if data:
                            self._peer[sock].sendall(data)
                    except OSError:
                        data = b""
                    if not data:
                        self._drop(sock)

    def _drop(self, sock: socket.socket) -> None:
        other = self._peer.pop(sock, None)
        sock.close()
        if other is not None:
            self._peer.pop(other, None)
            other.close()

    def _drop_all(self) -> None:
        for sock in list(self._peer):
            self._drop(sock)


# -- the monitor on its own ---------------------------------------------------------------------------


def test_the_monitor_sees_a_link_come_up_and_get_lost() -> None:
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    router.bind("tcp://127.0.0.1:*")
    dealer = ctx.socket(zmq.DEALER)
    assert link_monitor.apply_heartbeats(dealer)
    assert dealer.getsockopt(zmq.HEARTBEAT_IVL) == link_monitor.HEARTBEAT_IVL_MS
    monitor = link_monitor.LinkMonitor(dealer)
    try:
        assert not monitor.connected and not monitor.ever_connected and monitor.poll() == []
        dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
        events: list[link_monitor.LinkEvent] = []
        assert eventually(lambda: events.extend(monitor.poll()) or monitor.connected)
        assert [e.name for e in events if e.up] == ["HANDSHAKE_SUCCEEDED"] and monitor.num_ups == 1
        router.close(linger=0)
        events.clear()
        assert eventually(lambda: events.extend(monitor.poll()) or not monitor.connected)
        lost = [e for e in events if e.lost]
        assert len(lost) == 1 and lost[0].event == zmq.EVENT_DISCONNECTED and monitor.num_lost == 1
        assert monitor.ever_connected
    finally:
        monitor.close()
        monitor.close()  # idempotent
        dealer.close(linger=0)
        router.close(linger=0)


# -- (a) a receiver that is gone ---------------------------------------------------------------------


def test_a_sender_waiting_for_credit_fails_at_once_when_its_receiver_closes() -> None:
    src_kv, _ = make_cache(2, 8, seed=1)
    dst_kv, _ = make_cache(2, 20)
    faults = Faults()
    faults.stall_receiver()  # takes data, acks nothing: the sender runs out of credit
    receiver = ZmqKVReceiver(dst_kv, credits=1, faults=faults)
    sender = ZmqKVSender(src_kv, receiver.address)
    try:
        receiver.register("req", [3], expected_layers=2)
        sender.send("req", 0, [0], [3], soon(2))  # the one credit
        timer = later(0.3, receiver.close)
        _, took = raises_peer_lost(lambda: sender.send("req", 1, [0], [3], soon(LONG)))
        timer.join()
        print(f"credit wait: receiver closed after 0.3 s, sender raised PEER_LOST after {took:.2f} s")
        assert took < 0.3 + 2.0
        assert sender.credits == 0 and sender.num_links_lost == 1 and sender.num_resyncs == 0
    finally:
        sender.close()
        receiver.close()


def test_a_finishing_sender_fails_within_seconds_when_its_receiver_process_is_killed() -> None:
    src_kv, _ = make_cache(2, 8, seed=1)
    with receiver_process("real", "4", "req:3:1") as (proc, address):
        sender = ZmqKVSender(src_kv, address, connect_budget_s=1.0)
        try:
            sender.send("req", 0, [0], [3], soon(5))  # waits for the grant: the process is up and listening
            timer = later(0.5, lambda: os.kill(proc.pid, signal.SIGKILL))
            error, took = raises_peer_lost(lambda: sender.finish("req", soon(LONG)))  # stalled: no verdict
            timer.join()
            print(f"finish: receiver SIGKILLed after 0.5 s, sender raised PEER_LOST after {took:.2f} s")
            assert took < 0.5 + 2.0 and "lost" in error.detail
            # The receiver does not come back: a new transfer waits no longer than the connect budget.
            _, took = raises_peer_lost(lambda: sender.send("next", 0, [0], [3], soon(LONG)))
            print(f"after the kill: a new transfer raised PEER_LOST after {took:.2f} s (budget 1 s)")
            assert took < 1.0 + 0.5
            _, took = raises_peer_lost(lambda: sender.send("again", 0, [0], [3], soon(LONG)))
            assert took < 0.2  # down for longer than the budget already: at once
        finally:
            sender.close()


def test_a_receiver_never_reached_fails_after_the_connect_budget_or_at_an_earlier_deadline() -> None:
    src_kv, _ = make_cache(1, 8, seed=1)
    sender = ZmqKVSender(src_kv, f"tcp://127.0.0.1:{free_port()}", connect_budget_s=1.0)  # nothing listens there
    try:
        start = time.monotonic()
        with pytest.raises(TransferError) as err:  # the deadline comes first: TIMEOUT, as ever
            sender.send("a", 0, [0], [3], start + 0.3)
        assert err.value.reason is FailReason.TIMEOUT and 0.29 <= time.monotonic() - start < 0.8
        sender2 = ZmqKVSender(src_kv, sender.address, connect_budget_s=1.0)
        try:
            error, took = raises_peer_lost(lambda: sender2.send("b", 0, [0], [3], soon(LONG)))
            print(f"never reached: PEER_LOST after {took:.2f} s (budget 1 s)")
            assert 0.9 <= took < 1.5 and "never made" in error.detail
        finally:
            sender2.close()
    finally:
        sender.close()


# -- (b) a receiver that hangs ---------------------------------------------------------------------


def test_a_sender_gives_up_on_a_stopped_receiver_within_the_heartbeat_timeout() -> None:
    src_kv, _ = make_cache(2, 8, seed=1)
    with fake_receiver(credits=1) as (proc, address):
        sender = ZmqKVSender(src_kv, address)
        try:
            sender.send("req", 0, [0], [3], soon(5))  # the grant came: the link is up; the one credit is spent
            assert sender.link_up
            os.kill(proc.pid, signal.SIGSTOP)  # hung: the TCP connection stays open, nothing answers
            _, took = raises_peer_lost(lambda: sender.send("req", 1, [0], [3], soon(LONG)))
            print(f"SIGSTOPped receiver: PEER_LOST after {took:.2f} s (heartbeat ivl + timeout {HEARTBEAT_S} s)")
            assert took < HEARTBEAT_S + 1.5
            assert sender.num_links_lost == 1 and not sender.link_up
        finally:
            os.kill(proc.pid, signal.SIGCONT)
            sender.close()


# -- (c) resync ------------------------------------------------------------------------------------


def test_after_a_lost_link_the_sender_resyncs_and_gets_a_full_window() -> None:
    src_kv, src = make_cache(2, 8, seed=1)
    dst_kv, dst = make_cache(2, 20)
    faults = Faults()
    faults.stall_receiver()
    first = ZmqKVReceiver(dst_kv, "tcp://127.0.0.1:*", credits=2, faults=faults)
    address = first.address
    sender = ZmqKVSender(src_kv, address)
    second = None
    try:
        first.register("old", [3, 4], expected_layers=2)
        sender.send("old", 0, [0], [3], soon(2))
        sender.send("old", 1, [1], [4], soon(2))
        assert sender.credits == 0  # both credits out, neither will come back
        first.close()
        # Same port, new receiver (a restarted decode worker): the sender reconnects on its own.
        second = rebind(lambda: ZmqKVReceiver(dst_kv, address, credits=2))
        assert second.address == address
        _, took = raises_peer_lost(lambda: sender.finish("old", soon(LONG)))  # the old transfer died with the link
        assert took < 2.0
        assert eventually(lambda: sender.credits == 2, 5.0)  # the new grant, a full window; not 0, not 0 + stale
        assert sender.num_links_lost == 1 and sender.num_resyncs == 1
        before = dst.clone()
        second.register("new", [5, 6], expected_layers=2)
        start = time.monotonic()
        sender.send("new", 0, [2, 3], [5, 6], soon(LONG))
        sender.send("new", 1, [2, 3], [5, 6], soon(LONG))
        sender.finish("new", soon(LONG))
        assert time.monotonic() - start < 2.0
        assert second.poll("new").state is TransferState.DONE
        want = before.clone()
        want[:, :, [5, 6]] = src[:, :, [2, 3]]
        assert (dst == want).all()
        assert eventually(lambda: sender.credits == 2) and sender.num_resyncs == 1
    finally:
        sender.close()
        first.close()
        if second is not None:
            second.close()


@pytest.mark.parametrize("backend", ["zmq", "nccl"])
def test_a_network_blip_fails_what_was_in_flight_tells_the_receiver_and_resyncs(backend: str) -> None:
    """The connection breaks while both ends live (a proxy between them drops it): the transfer in flight fails
    on the sender, the receiver hears of it as soon as the link is back (not at its own deadline), and the
    link carries new transfers with a full window again (torch.distributed: over a new pair)."""
    if backend == "nccl" and not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is needed")
    src_kv, src = make_cache(2, 8, seed=1)
    dst_kv, dst = make_cache(2, 20)
    receiver: ZmqKVReceiver | NcclKVReceiver
    sender: ZmqKVSender | NcclKVSender
    if backend == "zmq":
        receiver = ZmqKVReceiver(dst_kv, credits=4)
    else:
        receiver = NcclKVReceiver(dst_kv, credits=4, group_timeout_s=GROUP_TIMEOUT_S)
    proxy = TcpProxy(receiver.address)
    if backend == "zmq":
        sender = ZmqKVSender(src_kv, proxy.address)
    else:
        sender = NcclKVSender(src_kv, proxy.address, group_timeout_s=GROUP_TIMEOUT_S)
    try:
        receiver.register("req", [3], expected_layers=2)
        sender.send("req", 0, [0], [3], soon(5))
        assert eventually(lambda: sender.credits == 4)  # acked: the receiver has bound the transfer
        proxy.cut()

        def rest_of_the_transfer() -> None:
            # The send fails if the sender has seen the cut already; on a loaded machine the event may come
            # later, and the send goes into the dead connection: then the end marker's wait fails.
            sender.send("req", 1, [0], [3], soon(LONG))
            sender.finish("req", soon(LONG))

        _, took = raises_peer_lost(rest_of_the_transfer)
        print(f"{backend}: link cut, PEER_LOST after {took:.2f} s")
        assert took < 2.0
        # Its aborts go under the new connection's key, so right after its grant, which the sender reads when
        # called (`credits` reads what arrived; a worker's send queue calls it every idle second).
        assert eventually(lambda: sender.credits == 4 and sender.num_resyncs == 1, 5.0)
        status = receiver.wait("req", soon(5))
        assert status.reason is FailReason.ABORTED and "lost the link" in status.detail, status
        before = dst.clone()
        receiver.register("new", [7, 8], expected_layers=2)
        for layer in range(2):
            sender.send("new", layer, [4, 5], [7, 8], soon(5))
        sender.finish("new", soon(5))
        assert receiver.poll("new").state is TransferState.DONE
        want = before.clone()
        want[:, :, [7, 8]] = src[:, :, [4, 5]]
        assert (dst == want).all()
        assert sender.num_links_lost == 1 and sender.num_resyncs == 1
    finally:
        sender.close()
        proxy.close()
        receiver.close()
    assert not receiver.thread_alive


def test_both_ends_set_heartbeats() -> None:
    src_kv, _ = make_cache(1, 8, seed=1)
    dst_kv, _ = make_cache(1, 20)
    receiver = ZmqKVReceiver(dst_kv)
    sender = ZmqKVSender(src_kv, receiver.address)
    try:
        for sock in (receiver._control._sock, sender._sock):
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) == link_monitor.HEARTBEAT_IVL_MS
            assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == link_monitor.HEARTBEAT_TIMEOUT_MS
        assert eventually(lambda: sender.link_up)
    finally:
        sender.close()
        receiver.close()
