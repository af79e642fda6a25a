"""KV handoff time vs bytes, through the real KV sender and receiver classes on loopback.

What a disaggregated request pays between its prefill and its decode: the
prefill worker's sender pushes every layer's blocks of the prompt into the
blocks the decode worker reserved, then `finish` returns once the receiver has
verified every layer (the first token goes out after that). Measured here from
the first `send` to `finish` returning, for the transport the cluster would
use, with the workers' own construction: the sender reads the engine's own KV
cache, the receiver writes a cache of the same geometry; both sign with a
cluster secret and name the model's fingerprint, as actors.py makes them.

Both ends run in this process, on the cores the engine uses: on a real cluster
they are two processes (often two hosts), so this is the loopback bound of a
one-node cluster, not a network's. Source and destination blocks are scattered
(a long-running worker's free list is), so the sender gathers and the receiver
scatters, as they do in service.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable

import torch

from pdserve.cluster.planner.profile import TransferPoint
from pdserve.workers.engine import LLMEngine
from pdserve.workers.kv.cache import allocate_kv_caches, bytes_per_block
from pdserve.workers.transfer.auth import ClusterSecret
from pdserve.workers.transfer.base import KVReceiver, KVSender, TransferState, Transport
from pdserve.workers.transfer.fingerprint import module_fingerprint

TRANSFER_DEADLINE_S = 60.0  # one transfer's bound: a loopback link that takes longer is broken
LINK_READY_S = 30.0  # the NCCL/gloo pair's group forms within this, or the profile fails


def kv_bytes_per_token(engine: LLMEngine) -> int:
    """Bytes of K and V, every layer, one token: what a handoff moves per prompt token (every KV
    head: a tensor-parallel worker's ranks send the whole model's)."""
    return bytes_per_block(engine.full_model_config, engine.config.block_size, engine.dtype) // engine.config.block_size


def transport_classes(transport: Transport) -> tuple[Callable[..., KVSender], Callable[..., KVReceiver]]:
    """The sender and receiver classes a worker uses for `transport` (cluster/actors.py's
    `_sender_class` / `_receiver_class`; not imported from there: that module imports Ray)."""
    if transport is Transport.NCCL:
        from pdserve.workers.transfer.nccl_backend import NcclKVReceiver, NcclKVSender

        return NcclKVSender, NcclKVReceiver
    from pdserve.workers.transfer.zmq_backend import ZmqKVReceiver, ZmqKVSender

    return ZmqKVSender, ZmqKVReceiver


def measure_transfer(engine: LLMEngine, transport: Transport, tokens: tuple[int, ...], repeats: int,
                     progress: Callable[[str], None], seed: int = 0) -> list[TransferPoint]:
    """Per prompt length in `tokens` (each a multiple of the block size, at most the
    engine's pool): the median seconds of `repeats` handoffs after one warm-up."""
    bs = engine.config.block_size
    per_token = kv_bytes_per_token(engine)
    most = max(tokens) // bs
    rng = random.Random(seed)
    secret = ClusterSecret.generate()
    fingerprint = module_fingerprint(engine.model_dir, engine.model)
    sender_cls, receiver_cls = transport_classes(transport)
    # The decode side's cache: a one-rank worker's of the model, a few blocks more than the largest handoff.
    dst_caches = allocate_kv_caches(engine.full_model_config, most + 8, bs, engine.dtype, engine.device)
    receiver = receiver_cls(dst_caches, bind="tcp://127.0.0.1:*", secret=secret, fingerprint=fingerprint)
    sender = sender_cls(engine.transfer_kv, receiver.address, secret=secret, fingerprint=fingerprint)
    try:
        wait_ready = getattr(sender, "wait_ready", None)  # the NCCL/gloo pair forms its group first
        if wait_ready is not None and not wait_ready(LINK_READY_S):
            raise RuntimeError(f"transport {transport.value}: the link did not form within {LINK_READY_S:g} s")
        points = []
        for n in tokens:
            times = [_handoff(engine, sender, receiver, n // bs, most + 8, rng, f"{n}-{rep}")
                     for rep in range(repeats + 1)][1:]  # the first warms the link and the staging buffers
            seconds = statistics.median(times)
            points.append(TransferPoint(bytes=n * per_token, seconds=seconds))
            progress(f"transfer {n:>6} tokens ({n * per_token / 1e6:8.2f} MB): {seconds * 1e3:8.2f} ms "
                     f"({n * per_token / seconds / 1e9:.2f} GB/s)")
        return points
    finally:
        sender.close()
        receiver.close()


def _handoff(engine: LLMEngine, sender: KVSender, receiver: KVReceiver, num_blocks: int, dst_pool: int,
             rng: random.Random, tag: str) -> float:
    """One request's KV, every layer, from scattered engine blocks into scattered receiver blocks."""
    rid = f"profile-kv-{tag}"
    src = rng.sample(range(engine.num_kv_blocks), num_blocks)
    dst = rng.sample(range(dst_pool), num_blocks)
    layers = engine.model_config.num_layers
    receiver.register(rid, dst, expected_layers=layers)  # the decode worker does this before the prefill starts
    deadline = time.monotonic() + TRANSFER_DEADLINE_S
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for layer in range(layers):
        sender.send(rid, layer, src, dst, deadline)
    sender.finish(rid, deadline)  # returns once the receiver verified every layer
    seconds = time.perf_counter() - start
    status = receiver.wait(rid, deadline)
    receiver.release(rid)
    if status.state is not TransferState.DONE:
        raise RuntimeError(f"KV handoff of {num_blocks} blocks ended {status.state.value}: {status.detail}")
    return seconds
