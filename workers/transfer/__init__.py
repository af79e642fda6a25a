"""KV cache transport from prefill to decode workers (see `base` for the contract).

Backends: `inprocess` (unit tests), `zmq_backend` (TCP, any two hosts) and
`nccl_backend` (torch.distributed send/recv: NCCL between GPUs, gloo on CPU),
each imported on its own so that pyzmq and torch.distributed are needed only
where they are used.

Shared by all: `ledger` (the receiver's decisions, the sender's book) and
`frames` (blocks to bytes, checksums). Shared by the two network backends:
`control` (the ZeroMQ control plane: sockets, credits, acks, aborts). The NCCL
backend's own parts: `nccl_channel` (the pair's process group) and
`nccl_store` (its rendezvous store).
"""

from pdserve.workers.transfer.base import (
    FailReason,
    KVReceiver,
    KVSender,
    TransferError,
    TransferState,
    TransferStatus,
)

__all__ = ["FailReason", "KVReceiver", "KVSender", "TransferError", "TransferState", "TransferStatus"]
