"""Content hashes of full KV blocks, chained so a block's hash names its whole prefix.

sha256 rather than Python's `hash`: the same prefix must hash the same in every
worker process (the router compares hashes across workers), and a crafted
prompt must not be able to collide with another user's cached prefix.

A request's `cache_salt` is hashed into the parent of its first block
(`root_hash`): every block of a salted request then hashes apart from the same
tokens under another salt, or none, so requests share cached blocks only
within one salt. The router hashes prompts the same way (cluster/router/).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

ROOT_HASH = 0


def hash_block(parent: int, tokens: Sequence[int]) -> int:
    """64-bit hash of a full block given its parent block's hash (ROOT_HASH for the first)."""
    h = hashlib.sha256(parent.to_bytes(8, "little"))
    h.update(array("q", tokens).tobytes())
    return int.from_bytes(h.digest()[:8], "little")


def root_hash(salt: str | None = None) -> int:
    """The parent of a request's first block: ROOT_HASH unsalted, else a hash of the salt."""
    if salt is None:
        return ROOT_HASH
    h = hashlib.sha256(b"pdserve-cache-salt\0" + salt.encode("utf-8", "surrogatepass"))  # JSON allows lone surrogates
    return int.from_bytes(h.digest()[:8], "little")


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int,
                        salt: str | None = None) -> None:
    """Append the hashes of every full block of `token_ids` not yet in `hashes`
    (`salt`: the request's cache salt, the same on every call for one list)."""
    parent = hashes[-1] if hashes else root_hash(salt)
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        hashes.append(parent)
