"""K/V blocks to contiguous byte frames and back, with their checksum.

The transport moves `(layer, block ids) → (layer, block ids)` in the cache
layout of `workers/kv/cache.py`: per layer K and V, each
`[num_blocks, block_size, num_kv_heads, head_dim]`. The sender gathers the
chosen blocks of one layer into one contiguous K frame and one V frame
(`[n, block_size, num_kv_heads, head_dim]` each, the cache's own dtype, no
repacking); the receiver views the received bytes as the same shape and
copies them into its blocks. Both backends share this file, so the in-process
one tests the same bytes the ZeroMQ one puts on the wire.

When the source blocks are consecutive ids of a CPU cache (the common case:
blocks allocated in a row), `cache_frames` returns the K and V frames as
views of the cache itself, so a sender can put them on the wire without the
gather's copy.

Checksum, over the K frame continued over the V frame: xxh3_64 when the
`xxhash` package is installed on both ends, else CRC-32 (the receiver picks
from what the sender offers). Either catches a frame corrupted in memory or
by a buggy peer (TCP already checks the link itself). CRC-32 is computed by
the system's libdeflate when it is there (`libdeflate.so.0`, PCLMUL-based;
the same values as zlib.crc32), else by zlib. zlib's runs at about the speed
of a loopback TCP copy, so it is a large share of a CPU-bound transfer;
libdeflate's is several times faster (rates, command and machine: the KV
transfer benchmark in docs/performance.md). All of them release the GIL on big
buffers.
"""

from __future__ import annotations

import ctypes
import dataclasses
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pdserve.workers.kv.shared_cache import ShardedKV
from pdserve.workers.messages import ChecksumKind, KVTransferHeader

try:
    import xxhash
except ImportError:  # optional: crc32 is always there
    xxhash = None

# Per layer (K, V): [num_blocks, block_size, kv_heads, head_dim]; or a tensor-parallel engine's
# ranks' caches, which move as the full model's heads (workers/kv/shared_cache.py).
KVCaches = Sequence[tuple[torch.Tensor, torch.Tensor]] | ShardedKV

# Only these names are accepted from a peer: a dtype string never reaches getattr(torch, ...).
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class CacheGeometry:
    """What both ends must agree on to copy blocks as raw bytes."""

    num_layers: int
    num_blocks: int
    block_shape: tuple[int, int, int]  # (block_size, num_kv_heads, head_dim)
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(kv_caches: KVCaches) -> CacheGeometry:
        if isinstance(kv_caches, ShardedKV):
            geometry = CacheGeometry.of(kv_caches.ranks[0])
            nb, bs, h, d = kv_caches.block_shape()
            return dataclasses.replace(geometry, block_shape=(bs, h, d))
        if not kv_caches:
            raise ValueError("kv_caches: empty")
        k0 = kv_caches[0][0]
        if k0.dtype not in _DTYPE_NAMES:
            raise ValueError(f"kv_caches: dtype {k0.dtype} is not transferable (known: {sorted(DTYPES)})")
        for i, (k, v) in enumerate(kv_caches):
            if k.shape != k0.shape or v.shape != k0.shape or k.dtype != k0.dtype or v.dtype != k0.dtype:
                raise ValueError(f"kv_caches: layer {i} K/V shape or dtype differs from layer 0's {tuple(k0.shape)}")
            if not (k.is_contiguous() and v.is_contiguous()):
                raise ValueError(f"kv_caches: layer {i} K/V must be contiguous")
        if k0.dim() != 4:
            raise ValueError(f"kv_caches: expected [num_blocks, block_size, kv_heads, head_dim], got {tuple(k0.shape)}")
        nb, bs, h, d = k0.shape
        return CacheGeometry(len(kv_caches), nb, (bs, h, d), k0.dtype, k0.device)

    @property
    def dtype_name(self) -> str:
        return _DTYPE_NAMES[self.dtype]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of K (or of V) of one layer."""
        bs, h, d = self.block_shape
        return bs * h * d * self.dtype.itemsize

    def check_blocks(self, what: str, block_ids: Sequence[int]) -> None:
        bad = [b for b in block_ids if not (type(b) is int and 0 <= b < self.num_blocks)]
        if bad:
            raise ValueError(f"{what}: block ids {bad[:8]} are outside [0, {self.num_blocks})")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"{what}: repeated block ids")

    def check_layer(self, layer: int) -> None:
        if not (type(layer) is int and 0 <= layer < self.num_layers):
            raise ValueError(f"layer: {layer!r} is outside [0, {self.num_layers})")


def gather(kv_caches: KVCaches, layer: int, block_ids: Sequence[int],
           out: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Copy K and V of `block_ids` of `layer` into host memory; return the K and V frames.

    `out` is a flat uint8 CPU tensor of at least `frame_bytes(...)` (reused staging
    memory: a fresh 16 MB buffer per message costs ~4k page faults); None allocates one.
    The frames are flat uint8 views of it: K blocks then V blocks, each [n, bs, kv_heads, head_dim].
    """
    if isinstance(kv_caches, ShardedKV):
        return _gather_sharded(kv_caches, layer, block_ids, out)
    k, v = kv_caches[layer]
    n = len(block_ids)
    per = n * k[0].numel() * k.element_size()
    if out is None:
        out = torch.empty(2 * per, dtype=torch.uint8)
    for i, cache in enumerate((k, v)):
        select_into(cache, block_ids, out[i * per : (i + 1) * per].view(cache.dtype).view(n, *cache.shape[1:]))
    return out[:per].numpy(), out[per : 2 * per].numpy()


def _gather_sharded(kv: ShardedKV, layer: int, block_ids: Sequence[int],
                    out: torch.Tensor | None) -> tuple[np.ndarray, np.ndarray]:
    """`gather` of a tensor-parallel engine's ranks' caches: each frame holds the full heads."""
    n = len(block_ids)
    if out is None:
        out = torch.empty(frame_bytes(CacheGeometry.of(kv), n), dtype=torch.uint8)
    filled = gather_sharded(kv, layer, block_ids, out)
    half = filled.numel() // 2
    return filled[:half].numpy(), filled[half:].numpy()


def gather_sharded(kv: ShardedKV, layer: int, block_ids: Sequence[int], out: torch.Tensor) -> torch.Tensor:
    """K then V of `block_ids` of `layer`, the full heads of every rank's cache, into the flat uint8
    `out` (host memory, or a device's: a transport's staging); returns the filled prefix."""
    geometry = CacheGeometry.of(kv)
    n, per = len(block_ids), len(block_ids) * geometry.block_bytes
    k_out, v_out = (out[i * per : (i + 1) * per].view(geometry.dtype).view(n, *geometry.block_shape) for i in (0, 1))
    kv.gather_into(layer, block_ids, k_out, v_out)
    return out[: 2 * per]


def cache_frames(kv_caches: KVCaches, layer: int, block_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray] | None:
    """K and V of `block_ids` of `layer` as flat uint8 views of the cache itself, or None when that
    would need a copy (a device cache, ids that are not consecutive, the ranks' caches of a
    tensor-parallel engine: then `gather`).

    The views alias the cache: whoever sends them must not let the blocks change until they are sent.
    """
    if isinstance(kv_caches, ShardedKV):
        return None
    k, v = kv_caches[layer]
    if k.device.type != "cpu" or not _is_run(block_ids):
        return None
    first, end = block_ids[0], block_ids[0] + len(block_ids)
    return _byte_view(k[first:end]), _byte_view(v[first:end])


def _byte_view(t: torch.Tensor) -> np.ndarray:
    return t.reshape(-1).view(torch.uint8).numpy()


def frame_bytes(geometry: CacheGeometry, num_blocks: int) -> int:
    """Staging bytes `gather` needs for `num_blocks` blocks (K and V)."""
    return 2 * num_blocks * geometry.block_bytes


class StagingPool:
    """Host buffers for gathered frames, reused: a fresh 16 MB buffer per message costs ~4k page
    faults, which on a loopback link cost more than the copy itself.

    A sender holds a buffer from a message's send until the receiver acks it: the receiver then has
    every byte, so the transport no longer reads it. At most `credits` buffers are held; a message
    whose ack never comes keeps its buffer until the sender is closed or its link is lost. Pinned
    memory for a CUDA cache, so the device-to-host copy of the gather runs at full speed.
    """

    def __init__(self, pin_memory: bool = False) -> None:
        self._pin = pin_memory
        self._free: list[torch.Tensor] = []
        self._held: dict[tuple[str, int, int], torch.Tensor] = {}

    def take(self, nbytes: int) -> torch.Tensor:
        buf = self._free.pop() if self._free else None
        if buf is None or buf.numel() < nbytes:  # grows to the largest message; then reused
            buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self._pin)
        return buf

    def give(self, buf: torch.Tensor) -> None:
        self._free.append(buf)

    def hold(self, key: tuple[str, int, int], buf: torch.Tensor) -> None:
        self._held[key] = buf

    def release(self, key: tuple[str, int, int]) -> None:
        buf = self._held.pop(key, None)
        if buf is not None:
            self._free.append(buf)

    def forget_held(self) -> None:
        """Drop every held buffer unreused: their acks will not come (the link was lost), and the old
        connection's socket may still hold references to them until it is torn down."""
        self._held.clear()


# What this process can compute, best first.
CHECKSUMS: tuple[ChecksumKind, ...] = (
    (ChecksumKind.XXH3_64, ChecksumKind.CRC32) if xxhash is not None else (ChecksumKind.CRC32,))


def pick_checksum(offered: Sequence[str], verify: bool = True) -> ChecksumKind:
    """The receiver's choice from the sender's `offered` kinds: NONE if the sender offers it and the receiver
    does not `verify`; else the first kind this process computes too (crc32 at worst). So the bytes are
    checksummed unless neither end asks for it (a sender that wants a checksum does not offer NONE)."""
    if not verify and ChecksumKind.NONE.value in offered:
        return ChecksumKind.NONE
    for name in offered:
        if name in {k.value for k in CHECKSUMS}:
            return ChecksumKind(name)
    return ChecksumKind.CRC32


def checksum(kind: ChecksumKind, k_frame: object, v_frame: object) -> int:
    """Checksum of the K frame's bytes continued over the V frame's (buffer-protocol objects)."""
    if kind is ChecksumKind.CRC32:
        return crc32(v_frame, crc32(k_frame))
    if kind is ChecksumKind.XXH3_64 and xxhash is not None:
        h = xxhash.xxh3_64(k_frame)
        h.update(v_frame)
        return int(h.intdigest())
    if kind is ChecksumKind.NONE:
        raise ValueError("the message carries no checksum, and this receiver verifies every message")
    raise ValueError(f"checksum {kind.value} is not available in this process")


def _load_libdeflate_crc32() -> Callable[[int, int, int], int] | None:
    try:
        fn = ctypes.CDLL("libdeflate.so.0").libdeflate_crc32
    except (OSError, AttributeError):  # not installed (Debian: libdeflate0), or too old
        return None
    fn.restype = ctypes.c_uint32
    fn.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
    return fn


_libdeflate_crc32 = _load_libdeflate_crc32()
CRC32_BY = "zlib" if _libdeflate_crc32 is None else "libdeflate"  # for reports
_CRC_CALL_MIN_BYTES = 4096  # below this the ctypes call costs more than zlib's slower loop


def crc32(data: object, value: int = 0) -> int:
    """`zlib.crc32(data, value)` (same values, same continuation), faster through libdeflate.

    How much faster: the KV transfer benchmark in docs/performance.md.
    """
    buf = np.frombuffer(data, dtype=np.uint8)  # type: ignore[call-overload]  # no copy; any C-contiguous buffer
    if _libdeflate_crc32 is None or buf.nbytes < _CRC_CALL_MIN_BYTES:
        return zlib.crc32(buf, value)
    # `buf` holds the memory for the duration of the call; ctypes releases the GIL around it.
    return int(_libdeflate_crc32(value, buf.ctypes.data, buf.nbytes))


def header_problem(header: KVTransferHeader, geometry: CacheGeometry, k_len: int, v_len: int) -> str | None:
    """Why this data message cannot go into a cache of `geometry`, or None if it can."""
    if header.dtype != geometry.dtype_name:
        return f"dtype {header.dtype!r} != receiver cache dtype {geometry.dtype_name!r}"
    if tuple(header.block_shape) != geometry.block_shape:
        return f"block shape {header.block_shape} != receiver cache block shape {geometry.block_shape}"
    if header.layer >= geometry.num_layers:
        return f"layer {header.layer} >= receiver's {geometry.num_layers} layers"
    expected = header.num_blocks * geometry.block_bytes
    if k_len != expected or v_len != expected:
        return f"frames of {k_len}/{v_len} bytes, expected {expected} each for {header.num_blocks} blocks"
    return None


def scatter(kv_caches: KVCaches, geometry: CacheGeometry, layer: int, dst_block_ids: Sequence[int],
            k_frame: object, v_frame: object) -> None:
    """Write verified K/V frame bytes into `dst_block_ids` of `layer` (sizes checked by `header_problem`).

    Frames are buffers in host memory, or flat uint8 tensors on any device (a transport's staging).
    Device copies are queued on this thread's current stream and not waited for: the caller orders what
    reads the blocks (or reuses the frames) after them (the ledger, with `streams`).
    """
    ids = list(dst_block_ids)
    if isinstance(kv_caches, ShardedKV):
        bs, h, d = geometry.block_shape
        k_src, v_src = (_frame_bytes(f).reshape(len(ids), bs, h, d * geometry.dtype.itemsize)
                        for f in (k_frame, v_frame))
        kv_caches.scatter_from(layer, ids, k_src, v_src)
        return
    k, v = kv_caches[layer]
    for cache, frame in ((k, k_frame), (v, v_frame)):
        if isinstance(frame, torch.Tensor) and frame.device.type == "cpu":
            frame = frame.numpy()
        if isinstance(frame, torch.Tensor):
            _place(cache, ids, frame.view(geometry.dtype).view(len(ids), *geometry.block_shape).to(cache.device))
        elif cache.device.type == "cpu":
            rows = cache.view(cache.shape[0], -1).view(torch.uint8).numpy()
            src = np.frombuffer(frame, dtype=np.uint8).reshape(len(ids), -1)  # type: ignore[call-overload]
            if _is_run(ids):  # one memcpy
                rows[ids[0] : ids[0] + len(ids)] = src
            else:  # numpy's fancy assignment copies faster than torch's index_copy_ on CPU
                rows[ids] = src
        else:
            src = torch.frombuffer(frame, dtype=torch.uint8).view(geometry.dtype)
            _place(cache, ids, src.view(len(ids), *geometry.block_shape).to(cache.device))


def _frame_bytes(frame: object) -> np.ndarray:
    """A frame's bytes as a flat uint8 array (no copy of a host buffer; a device tensor is copied)."""
    if isinstance(frame, torch.Tensor):
        return frame.cpu().reshape(-1).view(torch.uint8).numpy()
    out: np.ndarray = np.frombuffer(frame, dtype=np.uint8)  # type: ignore[call-overload]
    return out


def select_into(cache: torch.Tensor, block_ids: Sequence[int], dst: torch.Tensor) -> None:
    """Blocks `block_ids` of `cache` into `dst` ([n, *block], contiguous), with one copy."""
    first = block_ids[0]
    if _is_run(block_ids):  # the common case: blocks allocated in a row; one memcpy (or one device-to-host copy)
        dst.copy_(cache[first : first + len(block_ids)])
        return
    idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    if dst.device == cache.device:
        torch.index_select(cache, 0, idx, out=dst)
    else:  # a device cache into host staging: gather on the device, then one device-to-host copy
        dst.copy_(cache.index_select(0, idx))


def _place(cache: torch.Tensor, block_ids: Sequence[int], src: torch.Tensor) -> None:
    first = block_ids[0]
    if _is_run(block_ids):
        cache[first : first + len(block_ids)].copy_(src)
    else:
        cache.index_copy_(0, torch.tensor(block_ids, dtype=torch.long, device=cache.device), src)


def _is_run(block_ids: Sequence[int]) -> bool:
    return len(block_ids) > 0 and block_ids[-1] - block_ids[0] == len(block_ids) - 1 and all(
        b == block_ids[0] + i for i, b in enumerate(block_ids))
