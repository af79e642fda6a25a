"""The served cluster on local Ray over real HTTP, with the official openai client."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from factories import local_cluster, tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))


@pytest.fixture(scope="module",
                params=["colocated-zmq-proxy", "disaggregated-zmq-haproxy", "disaggregated-nccl-haproxy"])
def cluster(model_dir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """`nccl`: the NCCL transport, which runs its gloo path on CPU. `proxy`/`haproxy`:
    Ray Serve's Python proxy actor, or its HAProxy ingress (the default)."""
    from pdserve.cluster.serve_config import serve_config

    port = 18000 + os.getpid() % 1000
    mode, transport, ingress = request.param.split("-")
    cfg = serve_config({"model": str(model_dir), "mode": mode, "transport": transport, "ingress": ingress,
                        "port": port, "max_model_len": 256, "num_kv_blocks": 256, "max_num_seqs": 64})
    with local_cluster(cfg) as url:
        yield url, mode


def test_cluster_serves_completions_like_the_offline_engine(cluster: tuple[str, str], model_dir: Path) -> None:
    url, mode = cluster
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    # Long enough that the router sends them to the prefill worker (not local prefill).
    prompts = ["def add(a, b):\n    return a + b\n" * 3, "import sys\nimport os\n" * 5, "class Foo:\n    pass\n" * 4]
    offline = LLM(str(model_dir), max_model_len=256, num_kv_blocks=256, progress=False)
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    for prompt, exp in zip(prompts, expected):
        r = c.completions.create(model=os.path.basename(str(model_dir)), prompt=prompt, max_tokens=16, temperature=0,
                                 extra_body={"ignore_eos": True})
        assert r.choices[0].text == exp.outputs[0].text
    stream = c.chat.completions.create(model=os.path.basename(str(model_dir)),
                                       messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=8, temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert len("".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)) > 0
    # One x-request-id a response (Serve's ingress writes it: the gateway added a second, with
    # another id), the client's when it sent one; the log's id (the body's) begins with it.
    for sent in ({}, {"x-request-id": "client-7"}):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=sent, timeout=60)
        ids = r.headers.get_list("x-request-id")
        assert len(ids) == 1 and r.json()["id"].startswith(f"cmpl-{ids[0]}-"), (ids, r.json()["id"])
        assert ids == [sent["x-request-id"]] if sent else True
    if mode == "disaggregated":
        from pdserve.cluster.worker_start import NAMESPACE

        p = ray.get(ray.get_actor("pdserve-prefill-0", namespace=NAMESPACE).load.remote()).snapshot
        d = ray.get(ray.get_actor("pdserve-decode-0", namespace=NAMESPACE).load.remote()).snapshot
        # Prompts were prefilled on the prefill worker and their KV shipped; the
        # decode worker computed no prompt token itself (the chat prompt aside,
        # which is short enough to be prefilled locally).
        assert p.prompt_tokens_computed > 60
        assert d.prompt_tokens_computed < 20
        assert p.used_blocks == 0 and d.used_blocks == 0


def test_cluster_scores_prompts_and_applies_penalties(cluster: tuple[str, str], model_dir: Path) -> None:
    """echo + logprobs (the prompt's logprobs are computed where the prompt is: the
    prefill worker when disaggregated) and the penalties, as the offline engine."""
    url, _ = cluster
    c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
    model = os.path.basename(str(model_dir))
    prompt = "def mul(a, b):\n    return a * b\n" * 3
    offline = LLM(str(model_dir), max_model_len=256, num_kv_blocks=256, progress=False)
    want = offline.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1,
                                                     prompt_logprobs=1, repetition_penalty=1.3,
                                                     frequency_penalty=0.4))[0]
    ids = want.prompt_token_ids
    expect = [e[t] for t, e in zip(ids[1:], want.prompt_logprobs[1:])]
    for stream in (False, True):
        kw = dict(model=model, prompt=prompt, max_tokens=6, temperature=0, echo=True, logprobs=1, frequency_penalty=0.4,
                  extra_body={"ignore_eos": True, "repetition_penalty": 1.3})
        if stream:
            chunks = [ch.choices[0] for ch in c.completions.create(stream=True, **kw) if ch.choices]
            text = "".join(ch.text for ch in chunks)
            token_lps = [x for ch in chunks for x in ch.logprobs.token_logprobs]
        else:
            choice = c.completions.create(**kw).choices[0]
            text, token_lps = choice.text, choice.logprobs.token_logprobs
        assert text == prompt + want.outputs[0].text
        assert token_lps[0] is None and len(token_lps) == len(ids) + 6
        assert max(abs(a - b) for a, b in zip(token_lps[1:len(ids)], expect)) < 1e-4


def _worker_loads() -> list[dict]:
    from pdserve.cluster.worker_start import NAMESPACE

    names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
             if a["namespace"] == NAMESPACE
             and a["name"].startswith(("pdserve-worker", "pdserve-prefill", "pdserve-decode"))]
    return [r.snapshot for r in ray.get([ray.get_actor(n, namespace=NAMESPACE).load.remote() for n in names])]


def test_burst_and_disconnects_leave_no_blocks_behind(cluster: tuple[str, str], model_dir: Path) -> None:
    import asyncio
    import time

    import httpx

    url, _ = cluster
    model = os.path.basename(str(model_dir))

    async def burst() -> list[str]:
        c = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        rs = await asyncio.gather(*(c.completions.create(model=model, prompt=f"x{i} = " + "y " * (i % 40), max_tokens=6,
                                                         temperature=0, extra_body={"ignore_eos": True})
                                    for i in range(200)))
        return [r.choices[0].finish_reason for r in rs]

    assert asyncio.run(burst()) == ["length"] * 200

    async def disconnects() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            async def one(i: int) -> None:
                # each streaming endpoint in turn: every one must abort what its stream started
                path, body = [
                    ("completions", {"prompt": f"z{i} " * 20, "max_tokens": 200}),
                    ("chat/completions", {"messages": [{"role": "user", "content": f"z{i} " * 20}],
                                          "max_tokens": 200}),
                    ("responses", {"input": f"z{i} " * 20, "max_output_tokens": 200}),
                ][i % 3]
                body |= {"model": model, "stream": True, "ignore_eos": True}
                async with client.stream("POST", f"{url}/v1/{path}", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            return  # hang up after the first chunk

            await asyncio.gather(*(one(i) for i in range(50)))

    generated_before = sum(ld.generation_tokens for ld in _worker_loads())
    asyncio.run(disconnects())
    deadline = time.monotonic() + 30
    loads = _worker_loads()
    while time.monotonic() < deadline and any(ld.used_blocks or ld.running or ld.waiting for ld in loads):
        time.sleep(0.2)
        loads = _worker_loads()
    # Only prefix-cache entries may remain (they count as free): nothing is held.
    assert all(ld.used_blocks == 0 and ld.running == 0 and ld.waiting == 0 for ld in loads), loads
    # The hung-up streams were aborted, not run to their 200 tokens.
    assert sum(ld.generation_tokens for ld in loads) - generated_before < 50 * 200 // 2


def test_the_decoding_worker_gets_a_core_of_its_own_and_still_serves(cluster: tuple[str, str],
                                                                     model_dir: Path) -> None:
    """cluster/cpu_pinning.py on live workers: `pdserve serve` pins its own tree; here the
    tree below this cluster's raylet (its workers, the gateway), restored afterwards. The
    decode worker of 1P+1D; the one colocated worker, whose share left the gateway a core."""
    url, mode = cluster
    from pdserve.cluster import placement, serve_app

    if len(os.sched_getaffinity(0)) < 2 or serve_app.cluster_gpus():
        pytest.skip("two cores, and CPU workers")
    from pdserve.cluster.background_priority import descendants
    from pdserve.cluster.cpu_pinning import Pins, apply
    from pdserve.cluster.serve_config import ServeConfig, ServingMode
    from pdserve.workers.config import EngineConfig

    def cmdline(pid: int) -> str:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")

    (raylet,) = [pid for pid in descendants(os.getpid()) if "/raylet " in cmdline(pid)]
    cores = frozenset(os.sched_getaffinity(0))
    cfg = ServeConfig(EngineConfig(model=str(model_dir)), mode=ServingMode(mode))
    cfg = cfg.fit_to_cluster(serve_app.cluster_gpus)
    infos = {name: ray.get(ray.get_actor(name, namespace=serve_app.NAMESPACE).info.remote(), timeout=60)
             for name in cfg.worker_names()}
    decode = infos["pdserve-decode-0" if mode == "disaggregated" else "pdserve-worker-0"]
    # The tiny model splits; a colocated worker's share leaves a core to the rest.
    share = placement.worker_share("cpu", cfg.num_workers, ray.cluster_resources(), cfg.cpu_sharing,
                                   plane_cores=placement.COLOCATED_PLANE_CORES if mode == "colocated" else 0)
    assert decode.fixed_cpu_threads == (share.split_threads or share.threads) and decode.pid in descendants(raylet)
    others = [info.pid for info in infos.values() if info.pid != decode.pid]
    try:
        pins = serve_app.pin_decode_cores(cfg, cores, root=raylet)
        assert pins is not None and set(pins.decode) == {decode.pid}
        own, rest = pins.decode[decode.pid], pins.rest
        assert len(own) == decode.fixed_cpu_threads and own.isdisjoint(rest) and own | rest == cores
        tids = os.listdir(f"/proc/{decode.pid}/task")
        assert {frozenset(os.sched_getaffinity(int(t))) for t in tids} == {own}  # every thread of it
        gateway = [pid for pid in descendants(raylet) if "ServeReplica" in cmdline(pid)]
        assert gateway and all(os.sched_getaffinity(pid) == rest for pid in [*gateway, *others, raylet])
        c = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        r = c.completions.create(model=os.path.basename(str(model_dir)), prompt="def add(a, b):\n" * 8,
                                 max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length"
        # Off: nothing is pinned.
        assert serve_app.pin_decode_cores(ServeConfig(EngineConfig(model="m"), cpu_pinning="off"),  # type: ignore[arg-type]
                                          cores, root=raylet) is None
    finally:
        apply(Pins({}, cores), raylet)
    assert all(os.sched_getaffinity(pid) == cores for pid in [decode.pid, *others])


def test_local_rays_processes_start_with_the_serving_nodes_settings(cluster: tuple[str, str]) -> None:
    """cluster/local_env.py's LOCAL_ENV is read by Ray's processes when they start (the raylet, the
    GCS, each worker's core worker, the log monitor): it works only if it is in their environment,
    the gateway's too. (The dashboard agent, the raylet's child, inherits the raylet's: its title
    overwrites what /proc shows of its environment.)"""
    from pdserve.cluster.background_priority import descendants
    from pdserve.cluster.local_env import LOCAL_ENV

    def environ(pid: int) -> tuple[str, dict[str, str]]:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/environ", "rb") as f:
            pairs = [item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item]
        return cmd, {k.decode(errors="replace"): v.decode(errors="replace") for k, v in pairs}

    markers = ("/raylet ", "/gcs_server ", "ray::ServeReplica", "/log_monitor.py ")
    found = {}
    for pid in descendants(os.getpid()):
        try:
            cmd, env = environ(pid)
        except OSError:
            continue  # it ended
        for marker in markers:
            if marker in cmd:
                found[marker] = env
    assert set(found) == set(markers), sorted(found)
    for marker, env in found.items():
        assert {k: env.get(k) for k in LOCAL_ENV} == {k: os.environ.get(k, v) for k, v in LOCAL_ENV.items()}, marker


def test_local_haproxy_runs_as_many_threads_as_the_node_can_spare(cluster: tuple[str, str],
                                                                  request: pytest.FixtureRequest) -> None:
    """Ray's 4 HAProxy threads on a 2-core node preempt the gateway replica that feeds them
    (cluster/ingress.py `haproxy_threads`): the HAProxy this run started reads the count
    from its node's cores."""
    from pdserve.cluster.background_priority import descendants
    from pdserve.cluster.cpu_pinning import node_cores
    from pdserve.cluster.ingress import haproxy_threads

    configs = []
    for pid in descendants(os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0")]
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == "haproxy" and "-f" in argv:
            configs.append(Path(argv[argv.index("-f") + 1]).read_text())
    if "-haproxy" not in request.node.callspec.id:
        assert configs == []  # the Python proxy ingress
        return
    assert configs, "no HAProxy below this process"
    for text in configs:
        threads = re.search(r"^\s*nbthread (\d+)$", text, re.M)
        assert threads is not None and int(threads.group(1)) == haproxy_threads(len(node_cores()))
