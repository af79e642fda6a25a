"""The chaos harness (issue 13): test tooling, not part of the installed `pdserve`.

It drives a real `pdserve serve` from outside, as a user would: it starts the
server, streams load through its HTTP API, reads its processes from /proc, and
strikes them (signals, cut links, or `inject_fault` through the test seam,
workers/fault_seam.py). Its modules:

- `harness`: the server, the Ray view and one scenario's skeleton (`Harness`, `run_fault`);
- `procs`: what it reads of processes from /proc, and the links it cuts;
- `load`: the probes (prompts with known greedy answers) and the streaming load;
- `leaks`: what the workers still hold after the drain;
- `scenarios`: the scenarios (a)-(m) and the matrix they make.

The CI subset is test_chaos.py beside it; bench/chaos.py runs the whole matrix
(it puts tests/ on sys.path, as pytest's conftest does, and imports `chaos`).
"""
