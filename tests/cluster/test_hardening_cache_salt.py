"""Prefix-cache isolation (issue 16): a request's `cache_salt` keeps its KV
blocks apart from every other salt's, so `usage.prompt_tokens_details.
cached_tokens` (and TTFT) tell one tenant nothing of another's prompts; the
router hashes prompts as the workers do, so routing follows the salted
blocks the workers report."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from factories import tiny_spec

from pdserve import LLM
from pdserve.cluster.backend import LocalBackend
from pdserve.cluster.gateway import Gateway, GatewayConfig
from pdserve.cluster.openai_app import build_app
from pdserve.cluster.router import Router
from pdserve.cluster.router.policy import RouterConfig, RouteReason, WorkerLoad, WorkerRole
from pdserve.workers.async_engine import AsyncEngine
from pdserve.workers.kv.cache_manager import KVCacheManager
from pdserve.workers.kv.hashing import ROOT_HASH, extend_block_hashes, root_hash
from pdserve.workers.request import Request
from pdserve.workers.sampling_params import SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

BS = 16
MODEL = "tiny"


def hashes(tokens: list[int], salt: str | None = None) -> list[int]:
    out: list[int] = []
    extend_block_hashes(out, tokens, BS, salt)
    return out


def test_a_salt_changes_every_block_hash_and_no_salt_changes_nothing() -> None:
    tokens = list(range(5 * BS))
    plain, a, b = hashes(tokens), hashes(tokens, "tenant-a"), hashes(tokens, "tenant-b")
    assert root_hash(None) == ROOT_HASH and hashes(tokens, None) == plain
    assert a == hashes(tokens, "tenant-a")  # deterministic: the same in every process
    assert not set(a) & set(plain) and not set(a) & set(b) and not set(b) & set(plain)
    assert hashes(tokens, "\ud800") != plain  # whatever a JSON string holds


def test_the_router_matches_only_blocks_of_the_requests_salt() -> None:
    """A worker's pool reports a salted request's blocks; the router finds them for
    the same salt only, so a request of another tenant is not sent after them."""
    kv = KVCacheManager(num_blocks=64, block_size=BS, record_events=True)
    tokens = list(range(10 * BS))
    request = Request("r", tokens, SamplingParams(max_tokens=1, cache_salt="tenant-a"), max_tokens=1)
    assert kv.allocate_slots(request, len(tokens))
    request.num_computed_tokens = len(tokens)
    kv.cache_computed_blocks(request)
    router = Router(RouterConfig(local_prefill_threshold_tokens=0), BS)
    for wid, role in (("p0", WorkerRole.PREFILL), ("p1", WorkerRole.PREFILL), ("d0", WorkerRole.DECODE)):
        router.update_load(WorkerLoad(wid, role, free_blocks=1000, total_blocks=1000))
    router.on_kv_events("p1", kv.pool.take_events())
    prompt = tokens + [1] * 8
    same = router.route("a", prompt, cache_salt="tenant-a")
    assert same.prefill_worker == "p1" and same.reason is RouteReason.CACHE_HIT and same.prefill_cached_blocks == 10
    for salt in ("tenant-b", None):
        other = router.route(f"b-{salt}", prompt, cache_salt=salt)
        assert other.prefill_cached_blocks == 0 and other.reason is not RouteReason.CACHE_HIT


@pytest.fixture(scope="module")
def served(make_model: Callable[[TinyModelSpec], Path]) -> Iterator[Any]:
    llm = LLM(str(make_model(tiny_spec())), max_model_len=256, num_kv_blocks=128, progress=False)
    engine = AsyncEngine(llm.engine).start()
    gw = Gateway(LocalBackend(engine), llm.tokenizer, GatewayConfig(model_name=MODEL, max_model_len=256))
    yield build_app(gw)
    engine.close()


def test_same_prompt_other_salt_gets_no_cached_tokens_same_salt_does(served: Any) -> None:
    prompt = list(range(10, 10 + 6 * BS))  # six full blocks

    async def cached(c: httpx.AsyncClient, salt: str | None) -> int:
        body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        if salt is not None:
            body["cache_salt"] = salt
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        n: int = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return n

    async def main() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=served), base_url="http://gw",
                                     timeout=30) as c:
            return [await cached(c, salt) for salt in ("tenant-a", "tenant-b", None, "tenant-a", "tenant-b", None)]

    first_a, first_b, first_plain, again_a, again_b, again_plain = asyncio.run(main())
    assert first_a == first_b == first_plain == 0  # each salt, and no salt, is a cache of its own
    assert again_a == again_b == again_plain == 5 * BS  # all but the last block, which must be computed
