"""pdserve and vLLM, each loaded by each bench client (vLLM's and pdserve's), one sitting.

vLLM's client (`vllm bench serve`) leaves the temperature to the server (1.0: random
sampling) and sends text; `pdserve bench` asks for greedy decoding. Loading both servers
with both clients separates what is the server's from what is the workload's. Both
servers start once; the four (server, client) pairs run in turn, `--repeats` times,
after one warm-up per server. Prints output tokens/s and the client's own CPU seconds.

    python bench/vs_vllm_clients.py --model <dir> --concurrency 8 --num-prompts 48 \\
        [--pdserve-arg=--mode --pdserve-arg=colocated]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

from served import PDSERVE, start, stop, wait_healthy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="an HF-format model directory both servers can load")
    p.add_argument("--vllm-venv", default="/work/vllm-venv")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--pdserve-arg", action="append", default=[])
    return p.parse_args()


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def main() -> int:
    a = parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vs-clients-"))
    vllm = str(Path(a.vllm_venv) / "bin" / "vllm")
    common = ["--max-concurrency", str(a.concurrency), "--ignore-eos", "--seed"]

    def vllm_client(port: int, seed: int) -> float:
        out = tmp / f"v{port}-{seed}.json"
        subprocess.run([vllm, "bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
                        "--model", a.model, "--dataset-name", "random", "--random-input-len", "256",
                        "--random-output-len", "64", "--num-prompts", str(a.num_prompts), *common, str(seed),
                        "--save-result", "--result-dir", str(tmp), "--result-filename", out.name],
                       check=True, capture_output=True, timeout=1800)
        return float(json.loads(out.read_text())["output_throughput"])

    def pdserve_client(port: int, seed: int) -> float:
        out = tmp / f"p{port}-{seed}.json"
        subprocess.run([PDSERVE, "bench", "--base-url", f"http://127.0.0.1:{port}/v1", "--input-len", "256",
                        "--output-len", "64", "--range-ratio", "0", "--num-requests", str(a.num_prompts), *common,
                        str(seed), "--result-json", str(out), "--no-progress"],
                       check=True, capture_output=True, timeout=1800)
        return float(json.loads(out.read_text())["runs"][0]["summary"]["output_token_throughput"])

    servers = []
    try:
        servers.append(start([vllm, "serve", a.model, "--port", "8001"], tmp / "vllm.log",
                             env={"VLLM_CPU_KVCACHE_SPACE": "4"}))
        wait_healthy("http://127.0.0.1:8001", servers[-1], tmp / "vllm.log")
        servers.append(start([PDSERVE, "serve", "--model", a.model, "--port", "8000", *a.pdserve_arg],
                             tmp / "pdserve.log"))
        wait_healthy("http://127.0.0.1:8000", servers[-1], tmp / "pdserve.log")
        for port in (8000, 8001):
            pdserve_client(port, 99)  # warm-up
        clients: list[tuple[str, Callable[[int, int], float]]] = [("vllm bench serve", vllm_client),
                                                                   ("pdserve bench", pdserve_client)]
        print(f"# {a.model}, random 256 in / 64 out, EOS ignored, concurrency {a.concurrency}, "
              f"{a.num_prompts} prompts; pdserve args: {' '.join(a.pdserve_arg) or '(defaults)'}")
        print("| server | client | output tok/s | client CPU s |\n|---|---|---:|---:|")
        for rep in range(a.repeats):
            for name, port in (("vLLM", 8001), ("pdserve", 8000)):
                for client, run in clients:
                    before = children_cpu_s()
                    tps = run(port, rep + 1)
                    print(f"| {name} | {client} | {tps:.1f} | {children_cpu_s() - before:.1f} |", flush=True)
    finally:
        for s in servers:
            stop(s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
