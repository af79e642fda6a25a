"""KV transfer over loopback: pdserve's ZeroMQ transport vs a raw TCP socket moving the same bytes.

One request's KV moves from a "prefill" process (this one) to a "decode" process,
layer by layer, for Llama-3-8B-like shapes: 32 layers, 8 KV heads, head dim 128,
block 16, float16 (bf16 on a GPU; same bytes). Per prompt length, three ways,
alternating A B C A B C ... over `--repeats` repeats after one warm-up each, medians:

  raw TCP   a plain socket: per layer an 8-byte length, then K and V bytes straight
            from the cache (contiguous source blocks: no gather), read with
            recv_into into one preallocated buffer; a 1-byte reply at the end.
            This is the loopback link itself, the bar to compare with.
  raw ZMQ   the same bytes as [tag, K, V] zero-copy frames DEALER -> ROUTER, received
            and dropped; a reply at the end. ZeroMQ's own cost, for diagnosis.
  pdserve   `ZmqKVSender.send` per layer (the source blocks are consecutive, so
            their frames are views of the cache; checksum, header, zero-copy
            frames, credits) into `ZmqKVReceiver` (checksum check, copy into the
            receiver's cache at scattered destination blocks), then `finish`, which
            returns once the receiver acked every layer as verified: end to end.
            Twice: with crc32 (always available) and with xxh3_64 (when the
            `xxhash` package is installed; else that column says so). Every
            message carries a Poly1305 tag (one-time key) over its header and K/V bytes,
            made by the sender and checked by the receiver (the cluster secret
            is handed to the receiving process, as Ray hands it to a worker).

Time is measured in the sending process from the first byte to the final reply.
GB/s = request KV bytes / time (1 GB = 1e9 B). Bar: pdserve >= 0.7x raw TCP.
CPU seconds of both processes per GB moved are reported too: on a loopback
link the "wire" is the kernel copying on the same cores, so every extra pass
over the bytes (gather, checksums, scatter) shows up in throughput, and this
machine may be shared, which moves wall times more than CPU times.
A component table gives the single-thread cost of each checksum (crc32 as the
transport computes it, through libdeflate when the system has it, and through
zlib for comparison), gather and scatter on one layer's K+V: the per-byte work
the transport adds to the link.

    python bench/kv_transfer.py [--tokens 256,1024,4096] [--layers 32] [--repeats 5] [--credits 8]
        [--max-message-kib 2048] [--quick]
"""

# One file (over 450 lines): a script run as is, whose spawned receiver processes run functions of this file.

from __future__ import annotations

import argparse
import hashlib
import hmac
import multiprocessing as mp
import os
import platform
import shlex
import socket
import statistics
import struct
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import zmq
from machine import cpu_name

from pdserve.workers.messages import ChecksumKind
from pdserve.workers.transfer import auth, frames
from pdserve.workers.transfer.zmq_backend import (
    DEFAULT_CREDITS,
    DEFAULT_MAX_MESSAGE_BYTES,
    ZmqKVReceiver,
    ZmqKVSender,
)

BLOCK_SIZE, KV_HEADS, HEAD_DIM = 16, 8, 128
DTYPE = torch.float16
CHILD_TIMEOUT_S = 120.0  # a child that hears nothing this long exits (its parent died)
REPLY_TIMEOUT_MS = 60_000


# -- caches in workers/kv/cache.py's layout -----------------------------------------------


KVCaches = list[tuple[torch.Tensor, torch.Tensor]]


def allocate(num_layers: int, num_blocks: int, fill: bool) -> tuple[KVCaches, torch.Tensor]:
    """Per layer (K, V) views into one [L, 2, NB, bs, H, D] tensor, as allocate_kv_caches makes them."""
    full = torch.zeros(num_layers, 2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE)
    if fill:  # random bits, cheaply: the transport must not care what the values are
        full.view(torch.int16).copy_(torch.randint(-(1 << 15), 1 << 15, full.shape, dtype=torch.int16))
    return [(full[i, 0], full[i, 1]) for i in range(num_layers)], full


def dst_blocks(n: int, num_blocks: int) -> list[int]:
    """Scattered destination blocks, as a decode worker's pool hands them out after a while."""
    return torch.randperm(num_blocks, generator=torch.Generator().manual_seed(n))[:n].tolist()


def crc_of_blocks(full: torch.Tensor, block_ids: list[int]) -> int:
    return zlib.crc32(as_bytes(full[:, :, block_ids].contiguous()))


def as_bytes(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


# -- receivers (child processes) --------------------------------------------------------------


def _child_wait(conn: mp.connection.Connection) -> object:
    if not conn.poll(CHILD_TIMEOUT_S):
        raise SystemExit("no word from the parent")
    return conn.recv()


def raw_tcp_receiver(conn: mp.connection.Connection, max_bytes: int) -> None:
    srv = socket.create_server(("127.0.0.1", 0))
    conn.send(srv.getsockname()[1])
    srv.settimeout(CHILD_TIMEOUT_S)
    sock, _ = srv.accept()
    sock.settimeout(CHILD_TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = memoryview(bytearray(max_bytes))
    size_buf = memoryview(bytearray(8))
    while True:
        _recv_exact(sock, size_buf)
        (size,) = struct.unpack("<Q", size_buf)
        if size == 0:  # end of a request (or a ping): reply with this process's CPU seconds
            sock.sendall(struct.pack("<d", time.process_time()))
        elif size == (1 << 64) - 1:
            return
        else:
            _recv_exact(sock, buf[:size])


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise SystemExit("sender went away")
        got += n


def raw_zmq_receiver(conn: mp.connection.Connection) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:*")
    conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while True:
        if not sock.poll(int(CHILD_TIMEOUT_S * 1000)):
            return
        parts = sock.recv_multipart(copy=False)
        tag = parts[1].bytes
        if tag == b"end":  # end of a request (or a ping): reply with this process's CPU seconds
            sock.send_multipart([parts[0].bytes, struct.pack("<d", time.process_time())])
        elif tag == b"quit":
            break
    sock.close()
    ctx.term()


def pdserve_receiver(conn: mp.connection.Connection, num_layers: int, num_blocks: int, credits: int,
                     secret: auth.ClusterSecret) -> None:
    torch.set_num_threads(1)
    kv, full = allocate(num_layers, num_blocks, fill=False)
    rx = ZmqKVReceiver(kv, "tcp://127.0.0.1:*", credits=credits, secret=secret)
    conn.send(rx.address)
    try:
        while True:
            cmd, *args = _child_wait(conn)  # type: ignore[misc]
            if cmd == "register":
                rx.register(*args)
                conn.send(time.process_time())
            elif cmd == "check":  # after a request: its status, CPU seconds, a crc of what landed; then forget it
                request_id, ids = args
                status = rx.wait(request_id, time.monotonic() + 5)
                cpu = time.process_time()
                conn.send((status.state.value, status.detail, cpu, crc_of_blocks(full, ids)))
                rx.release(request_id)
            else:
                return
    finally:
        rx.close()


# -- senders (this process) ------------------------------------------------------------------------


@dataclass
class Setup:
    kv: KVCaches
    full: torch.Tensor
    layers: int
    num_blocks: int
    recv_blocks: int


@dataclass
class Sample:
    wall: float  # seconds, first byte to the final reply
    cpu: float  # CPU seconds of the sending and the receiving process together (all their threads)


def run_raw_tcp(sock: socket.socket, s: Setup, n: int) -> Sample:
    rx0 = _tcp_end(sock)  # a ping: the receiver's CPU clock before
    t0, c0 = time.perf_counter(), time.process_time()
    for layer in range(s.layers):
        k, v = s.kv[layer]
        kb, vb = as_bytes(k[:n]), as_bytes(v[:n])
        sock.sendall(struct.pack("<Q", kb.nbytes + vb.nbytes))
        sock.sendall(kb)
        sock.sendall(vb)
    rx1 = _tcp_end(sock)
    return Sample(time.perf_counter() - t0, time.process_time() - c0 + rx1 - rx0)


def _tcp_end(sock: socket.socket) -> float:
    sock.sendall(struct.pack("<Q", 0))
    reply = memoryview(bytearray(8))
    _recv_exact(sock, reply)
    return float(struct.unpack("<d", reply)[0])


def run_raw_zmq(sock: zmq.Socket, s: Setup, n: int) -> Sample:
    rx0 = _zmq_end(sock)
    t0, c0 = time.perf_counter(), time.process_time()
    for layer in range(s.layers):
        k, v = s.kv[layer]
        sock.send_multipart([b"d", as_bytes(k[:n]), as_bytes(v[:n])], copy=False)
    rx1 = _zmq_end(sock)
    return Sample(time.perf_counter() - t0, time.process_time() - c0 + rx1 - rx0)


def _zmq_end(sock: zmq.Socket) -> float:
    sock.send_multipart([b"end"])
    if not sock.poll(REPLY_TIMEOUT_MS):
        raise RuntimeError("raw ZMQ receiver did not reply")
    return float(struct.unpack("<d", sock.recv())[0])


def run_pdserve(tx: ZmqKVSender, conn: mp.connection.Connection, s: Setup, n: int, rep: int) -> Sample:
    request_id = f"req-{tx.checksum.value}-{n}-{rep}"
    dst, src = dst_blocks(n, s.recv_blocks), list(range(n))
    conn.send(("register", request_id, dst, s.layers))
    assert conn.poll(60)
    rx0 = conn.recv()
    deadline = time.monotonic() + 60
    t0, c0 = time.perf_counter(), time.process_time()
    for layer in range(s.layers):
        tx.send(request_id, layer, src, dst, deadline)
    tx.finish(request_id, deadline)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    conn.send(("check", request_id, dst))
    assert conn.poll(60)
    state, detail, rx1, crc = conn.recv()
    if state != "done" or crc != crc_of_blocks(s.full, src):
        raise RuntimeError(f"pdserve transfer wrong: {state} {detail} crc match={crc == crc_of_blocks(s.full, src)}")
    return Sample(wall, cpu + rx1 - rx0)


# -- components ----------------------------------------------------------------------------------------


def time_it(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def components(s: Setup, n: int) -> list[tuple[str, float]]:
    """GB/s of each per-byte step the transport adds, on one layer's K+V of `n` blocks, one thread."""
    k, v = s.kv[0]
    src = list(range(n))
    kb, vb = frames.gather(s.kv, 0, src)
    nbytes = kb.nbytes + vb.nbytes
    staging = torch.empty(nbytes, dtype=torch.uint8)
    _, rfull = allocate(1, s.recv_blocks, fill=False)
    rkv = [(rfull[0, 0], rfull[0, 1])]
    geom = frames.CacheGeometry.of(rkv)
    dst = dst_blocks(n, s.recv_blocks)
    scattered = dst_blocks(n, s.num_blocks)
    steps = [(f"checksum {kind.value}", lambda kind=kind: frames.checksum(kind, kb, vb)) for kind in frames.CHECKSUMS]
    steps += [("crc32 through zlib", lambda: zlib.crc32(vb, zlib.crc32(kb)))]
    key = auth.default_secret().key
    steps += [("MAC: Poly1305, one-time key (what the transport uses)",
               lambda: auth.seal(key, auth.KV_TO_RECEIVER, 1, [kb, vb])),
              ("MAC: HMAC-SHA256 (for comparison)", lambda: _hmac_sha256(key, kb, vb)),
              ("MAC: keyed BLAKE2b (for comparison)", lambda: _blake2b(key, kb, vb))]
    steps += [
        ("frames of contiguous blocks (views of the cache)", lambda: frames.cache_frames(s.kv, 0, src)),
        ("gather, contiguous blocks, fresh buffer", lambda: frames.gather(s.kv, 0, src)),
        ("gather, contiguous blocks, reused buffer", lambda: frames.gather(s.kv, 0, src, out=staging)),
        ("gather, scattered blocks, reused buffer", lambda: frames.gather(s.kv, 0, scattered, out=staging)),
        ("scatter (scattered blocks)", lambda: frames.scatter(rkv, geom, 0, dst, kb, vb)),
        ("memcpy (torch clone)", lambda: (k[:n].clone(), v[:n].clone())),
    ]
    return [(name, nbytes / time_it(fn) / 1e9) for name, fn in steps]


def _hmac_sha256(key: bytes, kb: np.ndarray, vb: np.ndarray) -> bytes:
    h = hmac.new(key, kb, "sha256")
    h.update(vb)
    return h.digest()


def _blake2b(key: bytes, kb: np.ndarray, vb: np.ndarray) -> bytes:
    h = hashlib.blake2b(key=key, digest_size=32)
    h.update(kb)
    h.update(vb)
    return h.digest()


# -- main ------------------------------------------------------------------------------------------------


def machine() -> str:
    model = cpu_name()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return (f"{model}, {cores} cores; Linux {platform.release()}; Python {platform.python_version()}, "
            f"torch {torch.__version__}, pyzmq {zmq.__version__} (libzmq {zmq.zmq_version()}), "
            f"zlib {zlib.ZLIB_RUNTIME_VERSION}, crc32 by {frames.CRC32_BY}, "
            f"xxhash {'installed' if frames.xxhash is not None else 'not installed'}")


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def parse_args() -> tuple[argparse.Namespace, list[int]]:
    """The arguments (with --quick applied) and the prompt lengths, each a multiple of the block size."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="256,1024,4096", help="prompt lengths, comma-separated")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--credits", type=int, default=DEFAULT_CREDITS, help="receiver credit window (messages)")
    ap.add_argument("--max-message-kib", type=int, default=DEFAULT_MAX_MESSAGE_BYTES >> 10,
                    help="pdserve splits a layer into messages of at most this size")
    ap.add_argument("--quick", action="store_true", help="256,1024 tokens, 8 layers, 3 repeats")
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.layers, args.repeats = "256,1024", 8, 3
    tokens = [int(t) for t in args.tokens.split(",")]
    if any(t % BLOCK_SIZE for t in tokens):
        raise SystemExit(f"--tokens: multiples of the block size {BLOCK_SIZE}")
    return args, tokens


def print_header(args: argparse.Namespace) -> None:
    print("# KV transfer over loopback: pdserve ZeroMQ transport vs raw TCP")
    print(f"# command: python {shlex.join(sys.argv)}")
    print(f"# machine: {machine()}")
    print(f"# shapes: {args.layers} layers x {KV_HEADS} KV heads x head dim {HEAD_DIM}, block {BLOCK_SIZE}, "
          f"{str(DTYPE).removeprefix('torch.')}; pdserve: credits {args.credits}, "
          f"messages <= {args.max_message_kib} KiB; "
          f"{args.repeats} repeats, medians")


@dataclass
class Peers:
    """The three receiver processes, and this process's connection to each: the socket, and pdserve's senders."""

    pipes: dict[str, mp.connection.Connection]
    procs: list[mp.process.BaseProcess]
    tcp: socket.socket
    zctx: zmq.Context
    zsock: zmq.Socket
    senders: dict[ChecksumKind, ZmqKVSender]


def start_peers(args: argparse.Namespace, setup: Setup, layer_bytes: int) -> Peers:
    """Spawn the receivers (raw TCP, raw ZMQ, pdserve) and connect to each."""
    ctx = mp.get_context("spawn")
    pipes, procs = {}, []
    for name, target, extra in (("tcp", raw_tcp_receiver, (layer_bytes,)), ("zmq", raw_zmq_receiver, ()),
                                ("pdserve", pdserve_receiver,
                                 (args.layers, setup.recv_blocks, args.credits, auth.default_secret()))):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(child, *extra), daemon=True, name=f"recv-{name}")
        p.start()
        pipes[name], procs = parent, [*procs, p]
    for name, conn in pipes.items():
        if not conn.poll(60):
            raise SystemExit(f"{name} receiver did not start")
    tcp = socket.create_connection(("127.0.0.1", pipes["tcp"].recv()), timeout=60)
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    zctx = zmq.Context()
    zsock = zctx.socket(zmq.DEALER)
    zsock.setsockopt(zmq.LINGER, 0)
    zsock.connect(pipes["zmq"].recv())
    pd_address = pipes["pdserve"].recv()
    senders = {kind: ZmqKVSender(setup.kv, pd_address, context=zctx, sender_id=f"bench-{kind.value}", checksums=[kind],
                                 max_message_bytes=args.max_message_kib << 10)
               for kind in frames.CHECKSUMS}
    return Peers(pipes, procs, tcp, zctx, zsock, senders)


def stop_peers(peers: Peers) -> None:
    """Tell every receiver to quit, close this side, and reap the processes."""
    peers.tcp.sendall(struct.pack("<Q", (1 << 64) - 1))
    peers.zsock.send_multipart([b"quit"])
    peers.pipes["pdserve"].send(("quit",))
    for tx in peers.senders.values():
        tx.close()
    peers.zsock.close()
    for p in peers.procs:
        p.join(10)
        if p.is_alive():
            p.terminate()
    peers.zctx.term()


Row = tuple[int, int, dict[str, float], dict[str, float]]  # tokens, bytes, GB/s and CPU s per GB by way


def measure(n_tokens: int, args: argparse.Namespace, setup: Setup, peers: Peers) -> Row:
    """One prompt length, every way in turn over the repeats (after a warm-up): medians."""
    n = n_tokens // BLOCK_SIZE
    runs: dict[str, Callable[[int], Sample]] = {
        "tcp": lambda rep: run_raw_tcp(peers.tcp, setup, n),
        "zmq": lambda rep: run_raw_zmq(peers.zsock, setup, n),
    }
    for kind, tx in peers.senders.items():
        runs[kind.value] = lambda rep, tx=tx: run_pdserve(tx, peers.pipes["pdserve"], setup, n, rep)
    samples: dict[str, list[Sample]] = {k: [] for k in runs}
    for rep in range(args.repeats + 1):  # rep 0 warms up
        for name, run in runs.items():
            sample = run(rep)
            if rep:
                samples[name].append(sample)
        progress(f"{n_tokens} tokens: repeat {rep}/{args.repeats} "
                 + " ".join(f"{k}={v[-1].wall * 1e3:.1f}ms" for k, v in samples.items() if v))
    nbytes = 2 * args.layers * n * BLOCK_SIZE * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    return (n_tokens, nbytes,
            {k: nbytes / statistics.median(s.wall for s in v) / 1e9 for k, v in samples.items()},
            {k: statistics.median(s.cpu for s in v) / (nbytes / 1e9) for k, v in samples.items()})


def print_throughput(rows: list[Row], kinds: list[str]) -> None:
    print()
    print("| prompt tokens | KV MB | raw TCP GB/s | raw ZMQ GB/s | "
          + " | ".join(f"pdserve {k} GB/s | {k} / raw TCP" for k in kinds) + " |")
    print("|---:|---:|---:|---:|" + "---:|---:|" * len(kinds))
    for n_tokens, nbytes, gbs, _cpu in rows:
        cells = []
        for k in kinds:
            if k not in gbs:
                cells += ["not installed", "-"]
                continue
            ratio = gbs[k] / gbs["tcp"]
            cells += [f"{gbs[k]:.2f}", f"{ratio:.2f}x {'(>= 0.7x)' if ratio >= 0.7 else '(< 0.7x)'}"]
        print(f"| {n_tokens} | {nbytes / 1e6:.0f} | {gbs['tcp']:.2f} | {gbs['zmq']:.2f} | " + " | ".join(cells) + " |")


def print_cpu(rows: list[Row], kinds: list[str]) -> None:
    print()
    print("CPU seconds per GB moved, sender + receiver process (all threads), medians: what each way costs")
    print("the two cores that also run the loopback link.")
    print()
    names = ["tcp", "zmq", *kinds]
    print("| prompt tokens | raw TCP | raw ZMQ | " + " | ".join(f"pdserve {k}" for k in kinds) + " |")
    print("|---:|" + "---:|" * len(names))
    for n_tokens, _, _, cpu in rows:
        print(f"| {n_tokens} | " + " | ".join(f"{cpu[k]:.2f}" if k in cpu else "-" for k in names) + " |")


def print_components(comp: list[tuple[str, float]], tokens: int, layer_bytes: int) -> None:
    print()
    print(f"Per-byte steps on one layer's K+V of {tokens} tokens ({layer_bytes / 1e6:.1f} MB), one thread:")
    print()
    print("| step | GB/s |")
    print("|---|---:|")
    for name, gbs_ in comp:
        print(f"| {name} | {gbs_:.2f} |")


def main() -> None:
    args, tokens = parse_args()
    torch.set_num_threads(1)
    print_header(args)
    max_blocks = max(tokens) // BLOCK_SIZE
    setup = Setup(*allocate(args.layers, max_blocks, fill=True), layers=args.layers, num_blocks=max_blocks,
                  recv_blocks=max_blocks + max_blocks // 4 + 8)
    layer_bytes = 2 * max_blocks * BLOCK_SIZE * KV_HEADS * HEAD_DIM * DTYPE.itemsize
    peers = start_peers(args, setup, layer_bytes)
    try:
        rows = [measure(n_tokens, args, setup, peers) for n_tokens in tokens]
        comp = components(setup, max_blocks)
    finally:
        stop_peers(peers)
    kinds = [k.value for k in ChecksumKind]
    print_throughput(rows, kinds)
    print_cpu(rows, kinds)
    print_components(comp, max(tokens), layer_bytes)


if __name__ == "__main__":
    main()
