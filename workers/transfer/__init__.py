"""KV cache transport from prefill to decode workers (see `base` for the contract).

Backends: `inprocess` (unit tests), `zmq_backend` (TCP, any two hosts; imported
on its own so that pyzmq is needed only where it is used).
"""

from pdserve.workers.transfer.base import (
    FailReason, KVReceiver, KVSender, TransferError, TransferState, TransferStatus,
)

__all__ = ["FailReason", "KVReceiver", "KVSender", "TransferError", "TransferState", "TransferStatus"]
