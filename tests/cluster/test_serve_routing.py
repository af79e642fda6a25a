"""Cache-aware routing on the served cluster: local Ray, 2 prefill workers + 1
decode worker, requests over HTTP. The same shared-prefix workload under each
policy; the prefill tokens the workers computed are read from the workers.

One cluster serves both runs (a cluster start is most of the test's time): the
second policy's gateway is deployed in place of the first's, on the same workers,
and its workload has prefixes of its own (seed), so that nothing the first run
cached can hit; the blocks it left are only evicted, oldest first, as free ones."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from factories import local_cluster, tiny_spec

from pdserve.workers.tiny.builder import TinyModelSpec

openai = pytest.importorskip("openai")
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05))


# Requests in flight at once. At 4 the router's load term (the cached worker's queue) and conditional
# disaggregation sent ~10% of the requests off their cached worker on a fast machine (cache-aware
# 15488 tokens against round robin's 30304: 1.96x); the cache's saving is what is tested here.
CONCURRENCY = 2


def shared_prefix_prompts(seed: int, groups: int = 8, per_group: int = 16, prefix: int = 512,
                          suffix: int = 32) -> list[list[int]]:
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 4000) for _ in range(prefix)] for _ in range(groups)]
    prompts = [pre + [rng.randrange(5, 4000) for _ in range(suffix)] for pre in prefixes for _ in range(per_group)]
    rng.shuffle(prompts)
    return prompts


# The gateway's series that say why a run routed as it did (printed when the comparison fails).
_WHY = ("pdserve:router_decisions", "pdserve:router_cached_prompt_tokens", "pdserve:workers_lost",
        "pdserve:workers_readmitted", "pdserve:request_migrations")
seen: dict[str, list[str]] = {}  # policy -> its run's non-zero _WHY samples, and each worker's computed tokens


def routing_config(model_dir: Path, policy: str) -> Any:
    from pdserve.cluster.serve_config import serve_config

    # Every prompt to a prefill worker (`max_prefill_backlog_tokens` 0): past the CPU default's backlog
    # (1024 tokens, two of these prompts) the decode worker prefills, without the prefix cached, and how
    # often it did depended on the machine's speed (cache-aware 23,328 tokens in one CI run, 12.3k here).
    return serve_config({"model": str(model_dir), "prefill": 2, "decode": 1, "router_policy": policy,
                         "port": 19000 + os.getpid() % 1000, "max_model_len": 1024, "num_kv_blocks": 192,
                         "max_num_batched_tokens": 1024, "max_prefill_backlog_tokens": 0})


def computed_tokens(cfg: Any) -> int:
    """Prompt tokens all workers have computed so far (none holds a block: every request is over)."""
    from pdserve.cluster import serve_app

    loads = ray.get([ray.get_actor(n, namespace=serve_app.NAMESPACE).load.remote() for n in cfg.worker_names()])
    assert all(ld.snapshot.used_blocks == 0 for ld in loads), loads
    return sum(ld.snapshot.prompt_tokens_computed for ld in loads)


def serve_and_count(url: str, cfg: Any, prompts: list[list[int]]) -> int:
    """Prompt tokens computed by all workers while the gateway at `url` serves `prompts` (CONCURRENCY at once)."""
    import httpx

    from pdserve.cluster import serve_app

    before = computed_tokens(cfg)
    model = Path(cfg.model).name
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    sem = asyncio.Semaphore(CONCURRENCY)

    async def one(p: list[int]) -> str:
        async with sem:
            r = await client.completions.create(model=model, prompt=p, max_tokens=2, temperature=0,
                                                extra_body={"ignore_eos": True})
            return r.choices[0].finish_reason

    async def run() -> list[str]:
        try:
            return list(await asyncio.gather(*(one(p) for p in prompts)))
        finally:
            await client.close()

    assert asyncio.run(run()) == ["length"] * len(prompts)
    # The gateway's own series: a fresh gateway per run, so they are this run's alone.
    metrics = httpx.get(f"{url}/metrics", timeout=30).text.splitlines()
    loads = ray.get([ray.get_actor(n, namespace=serve_app.NAMESPACE).load.remote() for n in cfg.worker_names()])
    seen[cfg.router_policy.value] = [m for m in metrics if m.startswith(_WHY) and not m.endswith(" 0.0")] + [
        f"{n}: {ld.snapshot.prompt_tokens_computed} in all" for n, ld in zip(cfg.worker_names(), loads)]
    return computed_tokens(cfg) - before


def test_cache_aware_router_computes_2x_fewer_prefill_tokens_than_round_robin_over_http(model_dir: Path) -> None:
    """8 groups x 16 requests sharing a 512-token prefix; each prefill worker's
    pool (192 blocks of 16) holds about half of the prefixes."""
    from ray import serve

    from pdserve.cluster import serve_app
    from pdserve.cluster.router import RoutingPolicy

    first = routing_config(model_dir, "cache_aware")
    # The same cluster secret (a new config makes one of its own): the workers sign their streams with it.
    cfgs = {"cache_aware": first, "round_robin": dataclasses.replace(first, router_policy=RoutingPolicy.ROUND_ROBIN)}
    computed = {}
    with local_cluster(cfgs["cache_aware"]) as url:
        computed["cache_aware"] = serve_and_count(url, cfgs["cache_aware"], shared_prefix_prompts(seed=0))
        serve.delete(serve_app.APP_NAME)  # (blocking) no request can reach the first policy's gateway
        serve_app.deploy_gateway(cfgs["round_robin"])
        computed["round_robin"] = serve_and_count(url, cfgs["round_robin"], shared_prefix_prompts(seed=1))
    why = "\n".join(f"{policy}: {line}" for policy, lines in seen.items() for line in lines)
    # Every request of each run was routed by its run's policy (the gateway was replaced).
    assert "round_robin" not in "".join(seen["cache_aware"]) and \
        'pdserve:router_decisions_total{reason="round_robin",role="prefill"} 128.0' in seen["round_robin"], why
    assert computed["round_robin"] >= 2 * computed["cache_aware"], f"{computed}\n{why}"
