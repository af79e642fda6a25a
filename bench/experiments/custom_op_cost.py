"""What a compiled graph pays per call of a Python-implemented op: the same oneDNN linear called
directly, through an op registered with `torch.library.custom_op` (how pdserve's ops were
registered), and through the low-level `torch.library.Library` registration they use now
(workers/model/torch_ops.py). A tiny bfloat16 matmul, so that the fixed costs
show; one thread, inference mode, best of 5 repeats.

    python bench/experiments/custom_op_cost.py [--rows 2] [--features 16]
"""
import argparse
import platform
import timeit

import torch

from pdserve.workers.model import packed_linear

p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument("--rows", type=int, default=2)
p.add_argument("--features", type=int, default=16, help="in and out features of the linear")
a = p.parse_args()
if not packed_linear.supported(torch.bfloat16, torch.device("cpu")):
    raise SystemExit("needs oneDNN with bfloat16 on this CPU")
torch.set_num_threads(1)
layer = packed_linear.PackedLinear(torch.nn.Linear(a.features, a.features, bias=False).to(torch.bfloat16))
x = torch.randn(a.rows, a.features, dtype=torch.bfloat16)


def body(x: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_linear._weights[handle], bias, "none", [], "")


wrapped = torch.library.custom_op("pdserve_bench::wrapped", body, mutates_args=())
lib = torch.library.Library("pdserve_bench", "FRAGMENT")
lib.define("plain(Tensor x, int handle, int out_features, Tensor? bias) -> Tensor")
lib.impl("plain", body, "CPU")
calls = {
    "direct (no op)": lambda: body(x, layer.handle, a.features, None),
    "torch.library.custom_op": lambda: torch.ops.pdserve_bench.wrapped.default(x, layer.handle, a.features, None),
    "torch.library.Library impl": lambda: torch.ops.pdserve_bench.plain.default(x, layer.handle, a.features, None),
    "pdserve::packed_linear": lambda: torch.ops.pdserve.packed_linear.default(x, layer.handle, a.features, None),
}
with open("/proc/cpuinfo") as f:  # Linux; elsewhere platform's word for it
    cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), platform.processor())
print(f"# one {a.rows} x {a.features} x {a.features} bfloat16 oneDNN linear per call, one thread; {cpu}")
print("| called as | us a call | over direct us |\n|---|---:|---:|")
with torch.inference_mode():
    times = {name: min(timeit.repeat(f, number=5000, repeat=5)) / 5000 * 1e6 for name, f in calls.items()}
base = times["direct (no op)"]
for name, t in times.items():
    print(f"| {name} | {t:.1f} | {t - base:+.1f} |")
