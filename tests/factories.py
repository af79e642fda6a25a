"""Plain factory functions for tests (fixtures live in conftest.py)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pdserve.cluster.in_process import LocalActor, serve_gateway  # noqa: F401  (tests import them from here)
from pdserve.workers.tiny.builder import Arch, TinyModelSpec


def tiny_spec(arch: Arch | str = Arch.LLAMA, **kw: object) -> TinyModelSpec:
    """A small model spec: 2 layers, hidden 64, 4 heads, 2 KV heads unless overridden."""
    fields: dict[str, object] = dict(arch=arch, num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2)
    fields.update(kw)
    return TinyModelSpec(**fields)  # type: ignore[arg-type]


def llama2_tokenizer(words: tuple[str, ...] = ("▁ok", "▁Hello", "▁the")) -> Any:
    """A Llama 2-style tokenizer: BPE with byte_fallback (<0x00>..<0xFF>), "▁" for spaces, and
    Llama 2's decoder (Replace, ByteFallback, Fuse, Strip). "\\n" is <0x0A>, as in Llama 2."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    from pdserve.workers.tiny.tokenizer import SPECIAL_TOKENS

    vocab = {t: i for i, t in enumerate([*SPECIAL_TOKENS, "<unk>"])}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    merges = []
    for w in words:
        for c in w:
            vocab.setdefault(c, len(vocab))
        for i in range(2, len(w) + 1):
            vocab.setdefault(w[:i], len(vocab))
            merges.append((w[: i - 1], w[i - 1]))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    return tok


def with_bos_added(model_dir: Path, out: Path) -> Path:
    """A copy of `model_dir` whose tokenizer adds BOS to what it encodes and whose chat template
    writes BOS too: Llama 3's (its tokenizer.json's TemplateProcessing, its template's bos_token)."""
    shutil.copytree(model_dir, out)
    tok = json.loads((out / "tokenizer.json").read_text())
    bos = "<|begin_of_text|>"
    tok["post_processor"] = {"type": "Sequence", "processors": [tok["post_processor"], {
        "type": "TemplateProcessing", "single": [{"SpecialToken": {"id": bos, "type_id": 0}},
                                                 {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [0], "tokens": [bos]}}}]}
    (out / "tokenizer.json").write_text(json.dumps(tok))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{- bos_token }}" + config["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def slow_steps(engine: Any, seconds: float) -> Any:
    """Each `engine.step()` (an LLMEngine) takes `seconds` more, so that its requests stay under way
    for a known time whatever the machine's speed. Returns the undo."""
    step = engine.step

    def slow() -> Any:
        time.sleep(seconds)
        return step()

    engine.step = slow
    return lambda: vars(engine).pop("step", None)


@contextlib.contextmanager
def local_cluster(cfg: Any) -> Iterator[str]:
    """Serve `cfg` (a serve_app.ServeConfig) on local Ray with 2 CPUs, yield its base
    URL, and always tear it down. The ingress environment is set only while Ray's
    processes start (they read it then), so later tests do not see it."""
    from pdserve.cluster import serve_app

    saved = dict(os.environ)
    try:
        for key, value in serve_app.HAPROXY_ENV.items():
            os.environ[key] = value if cfg.ingress == "haproxy" else "0"
        serve_app.init_ray(cfg, num_cpus=2, log_to_driver=False)
    finally:  # everything init_ray set too (LOCAL_ENV, the ingress's ports and paths)
        os.environ.clear()
        os.environ.update(saved)
    try:
        serve_app.run(cfg, block=False)
        yield f"http://127.0.0.1:{cfg.port}"
    finally:
        serve_app.shutdown(cfg)
        serve_app.stop_ray(cfg)


class LocalPrefillPeer:
    """An in-process prefill worker as a decode worker's `PrefillPeer` (what
    cluster/actors.py's `RayPrefillPeer` is for an actor handle)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    async def prefill(self, order: Any) -> Any:
        return await self.worker.prefill(order)

    def abort(self, request_id: str, attempt: int = 0) -> None:
        self.worker.abort(request_id, attempt)


async def handoff_deltas(p: Any, d: Any, rid: str, prompt: list[int], params: Any,
                         timeout_s: float = 10.0) -> list[Any]:
    """One request handed off from prefill worker `p` to decode worker `d` (both
    in this process), as the gateway sees it: the deltas on its token stream."""
    from pdserve.cluster.token_collector import TokenStreamCollector
    from pdserve.workers.handoff import ServeRequest

    collector = TokenStreamCollector()
    try:
        collector.open(rid, prompt, timeout_s)
        req = ServeRequest(rid, tuple(prompt), params, timeout_s, collector.address)
        return [o async for o in collector.consume(rid, collector.watch(rid, d.handoff(req, LocalPrefillPeer(p))))]
    finally:
        await collector.close()


def sse_events(text: str) -> list[Any]:
    """The JSON bodies of a streamed response's `data:` events, `[DONE]` left out."""
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def sse_error_code(text: str) -> int | None:
    """The code of the in-band error event a stream ended with, if any."""
    errors = [e["error"]["code"] for e in sse_events(text) if "error" in e]
    return errors[-1] if errors else None


class FakeBackend:
    """The parts of a `GenerationBackend` a test's fake does not care about
    (subclasses write `generate`)."""

    healthy = True
    num_in_flight = 0
    stopped = False  # `stop_all` was called (a subclass's `generate` ends with ServerStoppingError then)

    def stop_all(self) -> None:
        self.stopped = True

    def health(self) -> Any:
        from pdserve.cluster.backend_api import Health, PoolState

        return Health({"fake": PoolState(int(self.healthy), 1)}, serving=self.healthy)

    def worker_handles(self) -> dict[str, tuple[str, Any]]:
        return {}

    def router_stats(self) -> Any:
        return None

    def reliability(self) -> Any:
        from pdserve.cluster.backend_api import Reliability

        return Reliability(self.health())

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def capture_logits(llm: Any) -> list[Any]:
    """Make `llm`'s model record a float32 copy of every logits tensor it computes (one per
    step, in order) into the returned list, which the caller may clear between runs."""
    captured: list[Any] = []
    compute_logits = llm.engine.model.compute_logits

    def capture(hidden: Any) -> Any:
        logits = compute_logits(hidden)
        captured.append(logits.float().clone())
        return logits

    llm.engine.model.compute_logits = capture
    return captured


# A child that starts a second thread and, given a second argument, a grandchild showing it in
# its command line; argv[1:] are what /proc/<pid>/cmdline shows (so a marker can be put there).
_CHILD = """
import subprocess, sys, threading, time
threading.Thread(target=time.sleep, args=(30,), daemon=True).start()
if len(sys.argv) > 2:  # a grandchild showing argv[2] (a marker kept out of this source: it is in every child's)
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", sys.argv[2]])
print("ready", flush=True)
time.sleep(30)
"""


def start_child(*argv: str) -> Any:
    """A child process with two threads (and, given two arguments, a grandchild), once it is up."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _CHILD, *argv], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def kill_tree(proc: Any) -> None:
    """Kill a child from `start_child` and whatever it started, by pid."""
    import os

    from pdserve.cluster.background_priority import descendants

    for pid in descendants(proc.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    proc.kill()
    proc.wait(timeout=10)



def serve_in_process(monkeypatch: Any) -> None:
    """`pdserve serve` through `cli.main` without its fork (cluster/shutdown.py): what the
    driver would run (`serve_app.run`, which such tests replace) runs in this process, and
    its errors and output reach the test."""
    from pdserve.cluster import serve_app, shutdown

    monkeypatch.setattr(shutdown, "serve_in_own_group", lambda serve: serve())
    monkeypatch.setattr(shutdown, "run_until_stopped", lambda cfg: (serve_app.run(cfg), 0)[1])


@contextlib.contextmanager
def tiny_engine_url(model_dir: Any, max_model_len: int = 1024, engine: dict[str, Any] | None = None,
                    **gateway: Any) -> Iterator[str]:
    """The OpenAI app over an in-process engine of `model_dir` (no Ray), served on a free local
    port: its base URL, the engine closed after. `engine`: more LLM settings; `gateway`: more
    GatewayConfig settings."""
    from pdserve import LLM
    from pdserve.cluster.backend import LocalBackend
    from pdserve.cluster.gateway import Gateway, GatewayConfig
    from pdserve.workers.async_engine import AsyncEngine

    llm = LLM(str(model_dir), max_model_len=max_model_len, progress=False, **(engine or {}))
    async_engine = AsyncEngine(llm.engine).start()
    config = GatewayConfig(model_name="tiny", max_model_len=max_model_len, **gateway)
    gw = Gateway(LocalBackend(async_engine), llm.tokenizer, config)
    try:
        with serve_gateway(gw) as base:
            yield base
    finally:
        async_engine.close()
