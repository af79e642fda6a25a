"""A served tensor-parallel decode worker that loses a rank, on real Ray: `pdserve serve
--decode-tp 2`; mid-stream the test kills the decode worker's second rank (a process the
server it started runs, by pid). The worker's next step fails, its process exits, Ray
restarts it with both ranks, and every stream finishes with the text the one-rank offline
engine writes (the requests wait for the worker and move back onto it from the tokens their
clients hold)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from factories import tiny_spec
from served import Server, proc_table, tree

from pdserve import LLM, SamplingParams
from pdserve.workers.tiny.builder import TinyModelSpec

PROMPTS = ["def add(a, b):\n    return a + b\n", "import os\nimport sys\n" * 3, "class Foo:\n    pass\n" * 2,
           "for i in range(10):\n"]
MAX_TOKENS = 200  # a few seconds of decoding: in flight when the rank dies


class Stream(threading.Thread):
    """One streamed greedy completion: its text, once it ends; `started` at its first chunk."""

    def __init__(self, url: str, model: str, prompt: str) -> None:
        super().__init__(daemon=True)
        self.url, self.model, self.prompt = url, model, prompt
        self.started = threading.Event()
        self.text, self.finish_reason = "", None
        self.error: BaseException | None = None

    def run(self) -> None:
        body = {"model": self.model, "prompt": self.prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/completions", json=body, timeout=180) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        event = json.loads(line[6:])
                        assert "choices" in event, event  # an error event says why
                        choice = event["choices"][0]
                        self.text += choice["text"]
                        self.finish_reason = choice["finish_reason"] or self.finish_reason
                        self.started.set()
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e
        finally:
            self.started.set()


def _ranks(root: int) -> dict[int, int]:
    """pid -> parent pid of every tensor-parallel follower below `root` (workers/tp_follower.py)."""
    found = {}
    table = proc_table()
    for pid in tree(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"pdserve.workers.tp_follower" in cmd and pid in table:
            found[pid] = table[pid][0]
    return found


def _wait_for(check: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
def test_a_served_decode_worker_that_loses_a_rank_is_restarted_whole(
        tmp_path: Path, make_model: Callable[[TinyModelSpec], Path]) -> None:
    model = make_model(tiny_spec(hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.05))
    want = [o.outputs[0].text for o in LLM(str(model), max_model_len=256, num_kv_blocks=256, progress=False).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))]
    server = Server(["--model", str(model), "--decode-tp", "2", "--enforce-eager", "--max-model-len", "256",
                     "--num-kv-blocks", "256", "--worker-wait", "120"], tmp_path / "stderr.txt").start()
    try:
        server.wait_ready()
        assert server.proc is not None
        (victim, worker), = _ranks(server.proc.pid).items()  # the decode worker's second rank, and the worker
        streams = [Stream(server.url, model.name, p) for p in PROMPTS]
        for s in streams:
            s.start()
        assert all(s.started.wait(120) for s in streams)
        assert not all(s.finish_reason for s in streams), "every stream ended before the rank was killed"
        os.kill(victim, signal.SIGKILL)
        for s in streams:
            s.join(300)
        assert all(s.error is None for s in streams), [s.error for s in streams]
        assert [s.text for s in streams] == want
        assert all(s.finish_reason == "length" for s in streams)
        # Restarted whole: a new worker process (Ray's), with a second rank of its own.
        assert _wait_for(lambda: len(_ranks(server.proc.pid)) == 1 and worker not in _ranks(server.proc.pid).values(),
                         60), _ranks(server.proc.pid)
        again = Stream(server.url, model.name, PROMPTS[0])
        again.run()
        assert again.error is None and again.text == want[0]
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.send_signal(signal.SIGINT)  # pdserve serve stops its workers and Serve on Ctrl-C
            try:
                server.proc.wait(60)
            except Exception:  # noqa: BLE001 - killed below
                pass
        server.kill()
