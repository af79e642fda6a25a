"""Load a checkpoint in a process of its own and print, as JSON, how far the bytes the process
had allocated rose while loading (tests/workers/test_loader_memory.py).

    python load_peak_proc.py MODEL_DIR DTYPE

What is measured: glibc's count of the bytes malloc has handed out and not taken back
(mallinfo2: mmapped chunks + in-use arena bytes), sampled every ~0.2 ms by a thread while
`load_model` runs, less the count just before. torch's CPU tensors come from malloc
(posix_memalign), so every tensor's bytes count from the moment it is allocated, touched or
not, as they would on a GPU (an allocation is committed there). Two things that other
measures get wrong here: resident-set figures count safetensors' mmapped file pages (VmHWM),
and RssAnon misses memory that is allocated but not yet written (`to_empty` on the host
allocates the whole fp32 model without touching it) yet counts freed memory glibc keeps, so
it cannot tell loading in place from loading twice; malloc's own count can. A sampled peak
can only miss a short-lived maximum, never invent one: it may be low, not high.

One-time lazy set-up (torch's first ops, building a model on `meta` the first time: ~26 MB
that stay) is done before the baseline, so that only the load is in the difference.
"""

from __future__ import annotations

import ctypes
import json
import sys
import threading
import time

import torch

from pdserve.kernels.backend_choice import AttentionBackend
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.llama import LlamaForCausalLM
from pdserve.workers.model.loader import load_model, resolve_dtype
from pdserve.workers.model.packed_linear import packed_weights

_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _FIELDS]


def main() -> None:
    model_dir, dtype = sys.argv[1], resolve_dtype(sys.argv[2])
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2

    def allocated() -> int:
        info = libc.mallinfo2()
        return int(info.hblkhd + info.uordblks)

    cfg = ModelConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        LlamaForCausalLM(cfg, AttentionBackend.TORCH, 256)
    warm = torch.ones(256, 256)
    torch.empty(256, 256, dtype=dtype).copy_(warm).t().contiguous()
    del warm

    base = allocated()
    peak = base
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, allocated())
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    model = load_model(model_dir, cfg, dtype, torch.device("cpu"), AttentionBackend.TORCH, 256)
    done.set()
    sampler.join()
    peak = max(peak, allocated())
    print(json.dumps({"peak_growth": peak - base, "weights": sum(p.nbytes for p in model.parameters())
                      + sum(w.nbytes for _, w in packed_weights(model)),
                      "dtype": str(next(model.parameters()).dtype)}))


if __name__ == "__main__":
    main()
