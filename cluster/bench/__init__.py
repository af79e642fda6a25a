"""`pdserve bench`: an async load generator for any OpenAI-compatible server.

The flow, one file per step:

    workloads.py  what to send: exact-length token-id prompts (random, shared-prefix, trace)
    prompts.py    optional: text that re-tokenizes to exactly those ids' lengths and sharing
    arrivals.py   when to send it: Poisson / gamma inter-arrival times, seeded
    client.py     one streamed request -> one RequestRecord (timestamps, tokens, error)
    runner.py     one run: arrivals, concurrency limit, deadlines, progress bar
    metrics.py    records -> TTFT / TPOT / ITL / E2E distributions, throughput, goodput
    sweep.py      runs at several rates -> attainment curve, DistServe goodput
    report.py     the printed table and the result JSON
    plots.py      PNG CDFs and the attainment curve
    cli.py        the flags (`pdserve bench`), wired from cluster/cli.py

Metric definitions follow shared/design/PERFORMANCE.md; docs/bench-tool.md
says how each is measured.
"""
