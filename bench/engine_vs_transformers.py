"""pdserve's engine vs transformers `generate`, side by side, on the embedded tiny model.

Both sides run the same float32 weights greedily on the CPU, in one process,
alternating A B A B (A = transformers, B = pdserve) over `--repeats` repeats
after one warm-up call each; tables report medians and the ratio pdserve /
transformers against the bars in shared/design/PERFORMANCE.md's spirit:

1. decode: time per decode step at batch 1 and 16, context ~300 tokens,
   measured as (time for prompt + 1 + K tokens - time for prompt + 1 token) / K,
   so prefill (and the first token) cancel out. Bar: pdserve <= 0.5x.
2. throughput: one call of 16 prompts x 256 tokens in, 64 out (one static batch
   in transformers, same lengths so no padding); output tokens / wall time.
   Bar: pdserve >= 1.5x.
3. mixed: 64 requests, prompt lengths uniform in [32, 512], output lengths
   uniform in [16, 256] (seeded). pdserve gets all 64 at once, each with its own
   max_tokens (continuous batching); transformers runs static batches of 16 in
   arrival order, left-padded, each batch generating up to its longest output,
   and only each request's own tokens count. Useful output tokens / wall time.
   Bar: pdserve >= 2.5x. A few requests are also rerun unbatched in
   transformers and their tokens compared with pdserve's (a sanity check).

Prompts are random token ids (specials excluded), fresh for every call, so
pdserve's prefix cache never hits and both sides do the same work. The
machine is shared and noisy: trust ratios from one run, not absolute times.

    python bench/engine_vs_transformers.py [--quick] [--repeats N] [--only decode|throughput|mixed]
        [--threads N] [--detokenize] [--out results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from machine import cpu_name
from transformers import AutoModelForCausalLM, PreTrainedModel

from pdserve import LLM, SamplingParams
from pdserve.workers.tiny.builder import default_model_dir

FIRST_ORDINARY_ID = 5  # ids below this are the tiny tokenizer's specials
PAD_ID = 0
BLOCK_SIZE = 16  # pdserve's default KV block size, used to size the KV pool

Prompts = list[list[int]]
Outputs = list[list[int]]


@dataclass(frozen=True)
class Sizes:
    """Workload shapes; QUICK shrinks them for a smoke run."""

    repeats: int = 5
    decode_context: int = 300
    decode_batches: tuple[int, ...] = (1, 16)
    decode_steps: int = 64  # K
    tput_prompts: int = 16
    tput_prompt_len: int = 256
    tput_output_len: int = 64
    mixed_requests: int = 64
    mixed_prompt_range: tuple[int, int] = (32, 512)
    mixed_output_range: tuple[int, int] = (16, 256)
    static_batch: int = 16  # transformers' batch size in the mixed workload
    mixed_checks: int = 4  # requests rerun unbatched in transformers to compare tokens


FULL = Sizes()
QUICK = Sizes(repeats=2, decode_steps=32, tput_prompt_len=128, tput_output_len=16, mixed_requests=16,
              mixed_prompt_range=(32, 256), mixed_output_range=(8, 64), mixed_checks=2)


@dataclass(frozen=True)
class Bar:
    """A target for the ratio pdserve / transformers."""

    target: float
    at_most: bool  # True: ratio <= target (times); False: ratio >= target (rates)

    def met(self, ratio: float) -> bool:
        return ratio <= self.target if self.at_most else ratio >= self.target

    def __str__(self) -> str:
        return f"{'<=' if self.at_most else '>='} {self.target:g}x"


@dataclass
class Row:
    """One metric: per-repeat samples of both sides, and an optional bar."""

    metric: str
    transformers: list[float]
    pdserve: list[float]
    bar: Bar | None = None

    @property
    def ratio(self) -> float:
        return statistics.median(self.pdserve) / statistics.median(self.transformers)

    @property
    def paired_ratios(self) -> list[float]:
        """pdserve / transformers within each repeat: their spread shows how noisy the run was."""
        return [p / t if t else float("nan") for p, t in zip(self.pdserve, self.transformers)]

    @property
    def met(self) -> bool | None:
        """None without a bar, or when a median is <= 0 (noise swamped a difference of times)."""
        if self.bar is None or min(statistics.median(self.pdserve), statistics.median(self.transformers)) <= 0:
            return None
        return self.bar.met(self.ratio)

    def to_json(self) -> dict[str, object]:
        return {
            "metric": self.metric, "transformers": self.transformers, "pdserve": self.pdserve,
            "transformers_median": statistics.median(self.transformers),
            "pdserve_median": statistics.median(self.pdserve), "ratio": self.ratio,
            "bar": str(self.bar) if self.bar else None, "met": self.met, "paired_ratios": self.paired_ratios,
        }


@dataclass
class Table:
    title: str
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# -- the two sides ---------------------------------------------------------------------


class PdserveSide:
    """pdserve's offline API: every prompt submitted at once, each with its own max_tokens."""

    name = "pdserve"

    def __init__(self, sizes: Sizes, detokenize: bool) -> None:
        longest = sizes.mixed_prompt_range[1] + sizes.mixed_output_range[1]
        per_seq = -(-max(longest, sizes.decode_context + sizes.decode_steps + 1) // BLOCK_SIZE)
        self.llm = LLM(model=None, dtype="float32", progress=False, block_size=BLOCK_SIZE,
                       max_num_seqs=max(sizes.mixed_requests, *sizes.decode_batches, sizes.tput_prompts),
                       max_num_batched_tokens=2048,
                       num_kv_blocks=max(sizes.mixed_requests, 16) * per_seq + 256)
        self.detokenize = detokenize

    def generate(self, prompts: Prompts, max_tokens: Sequence[int]) -> Outputs:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=self.detokenize)
                  for n in max_tokens]
        return [out.outputs[0].token_ids for out in self.llm.generate(prompts, params)]


class TransformersSide:
    """transformers `generate` in static batches, left-padded; each batch runs to its longest max_tokens."""

    name = "transformers"

    def __init__(self, model_dir: Path, batch_size: int) -> None:
        self.model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.model.generation_config.eos_token_id = None  # always make max_new_tokens
        self.batch_size = batch_size

    def generate(self, prompts: Prompts, max_tokens: Sequence[int]) -> Outputs:
        outs: Outputs = []
        for i in range(0, len(prompts), self.batch_size):
            outs += self._batch(prompts[i : i + self.batch_size], max_tokens[i : i + self.batch_size])
        return outs

    @torch.inference_mode()
    def _batch(self, prompts: Prompts, max_tokens: Sequence[int]) -> Outputs:
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])  # [B, width], left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        seqs = self.model.generate(ids, attention_mask=mask, max_new_tokens=max(max_tokens),
                                   do_sample=False, pad_token_id=PAD_ID)
        return [seqs[row, width : width + n].tolist() for row, n in enumerate(max_tokens)]


Side = PdserveSide | TransformersSide


# -- workloads ----------------------------------------------------------------------------


def random_prompts(seed: str, lengths: Sequence[int], vocab: int) -> Prompts:
    rng = random.Random(seed)
    return [[rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)] for n in lengths]


def mixed_shape(sizes: Sizes) -> tuple[list[int], list[int]]:
    """Prompt and output lengths of the mixed workload, in arrival order (seeded)."""
    rng = random.Random(1234)
    n = sizes.mixed_requests
    return ([rng.randint(*sizes.mixed_prompt_range) for _ in range(n)],
            [rng.randint(*sizes.mixed_output_range) for _ in range(n)])


def timed(fn: Callable[[], Outputs]) -> tuple[float, Outputs]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def alternate(label: str, repeats: int, sides: Sequence[Side], measure: Callable[[Side, int], float],
              unit: str) -> dict[str, list[float]]:
    """Run measure(side, repeat) for each side in turn, A B A B ...; one progress line per repeat."""
    samples: dict[str, list[float]] = {s.name: [] for s in sides}
    for rep in range(repeats):
        for side in sides:
            samples[side.name].append(measure(side, rep))
        shown = ", ".join(f"{s.name} {samples[s.name][-1]:.4g} {unit}" for s in sides)
        print(f"[{label}] repeat {rep + 1}/{repeats}: {shown} (load {os.getloadavg()[0]:.2f})",
              file=sys.stderr, flush=True)
    return samples


def warm_up(sides: Sequence[Side], vocab: int) -> None:
    """One untimed call per side covering batch 1 and 16 and prompt lengths up to 512."""
    lengths = [300] + [32 + 30 * i for i in range(16)]
    for side in sides:
        side.generate(random_prompts("warm-1", lengths[:1], vocab), [4])
        side.generate(random_prompts("warm-16", lengths[1:], vocab), [4] * 16)
    print("[warm-up] done", file=sys.stderr, flush=True)


# -- measurements ---------------------------------------------------------------------------


def bench_decode(sides: Sequence[Side], sizes: Sizes, vocab: int) -> Table:
    k = sizes.decode_steps
    table = Table("Decode time per step (prefill excluded)")
    table.notes.append(f"context {sizes.decode_context} tokens; (t[prompt+1+{k} tokens] - t[prompt+1 token]) / {k}")
    for batch in sizes.decode_batches:
        def measure(side: Side, rep: int, batch: int = batch) -> float:
            lengths = [sizes.decode_context] * batch
            first, rest = (random_prompts(f"dec-{batch}-{rep}-{part}", lengths, vocab) for part in "ab")
            short, _ = timed(lambda: side.generate(first, [1] * batch))
            long, _ = timed(lambda: side.generate(rest, [1 + k] * batch))
            return (long - short) / k * 1e3

        s = alternate(f"decode b={batch}", sizes.repeats, sides, measure, "ms/step")
        table.rows.append(Row(f"ms/step, batch {batch}", s["transformers"], s["pdserve"], Bar(0.5, at_most=True)))
    return table


def bench_throughput(sides: Sequence[Side], sizes: Sizes, vocab: int) -> Table:
    n, out_len = sizes.tput_prompts, sizes.tput_output_len
    walls: dict[str, list[float]] = {s.name: [] for s in sides}

    def measure(side: Side, rep: int) -> float:
        prompts = random_prompts(f"tput-{rep}", [sizes.tput_prompt_len] * n, vocab)
        wall, outs = timed(lambda: side.generate(prompts, [out_len] * n))
        walls[side.name].append(wall)
        return sum(map(len, outs)) / wall

    s = alternate("throughput", sizes.repeats, sides, measure, "tok/s")
    table = Table("Offline throughput (one call)")
    table.notes.append(f"{n} prompts x {sizes.tput_prompt_len} tokens in, {out_len} out; output tokens / wall time")
    table.rows.append(Row("output tokens/s", s["transformers"], s["pdserve"], Bar(1.5, at_most=False)))
    table.rows.append(Row("wall time, s", walls["transformers"], walls["pdserve"]))
    return table


def bench_mixed(sides: Sequence[Side], sizes: Sizes, vocab: int) -> Table:
    lengths, max_tokens = mixed_shape(sizes)
    useful = sum(max_tokens)
    walls: dict[str, list[float]] = {s.name: [] for s in sides}
    last: dict[str, tuple[Prompts, Outputs]] = {}

    def measure(side: Side, rep: int) -> float:
        prompts = random_prompts(f"mixed-{rep}", lengths, vocab)
        wall, outs = timed(lambda: side.generate(prompts, max_tokens))
        if [len(o) for o in outs] != max_tokens:
            raise RuntimeError(f"{side.name}: output lengths differ from the requested max_tokens")
        walls[side.name].append(wall)
        last[side.name] = (prompts, outs)
        return useful / wall

    s = alternate("mixed", sizes.repeats, sides, measure, "tok/s")
    table = Table("Mixed workload: continuous batching vs static batches")
    table.notes.append(f"{sizes.mixed_requests} requests, prompts {min(lengths)}-{max(lengths)} tokens, "
                       f"outputs {min(max_tokens)}-{max(max_tokens)} ({useful} useful tokens); "
                       f"transformers in static batches of {sizes.static_batch}")
    table.rows.append(Row("useful output tokens/s", s["transformers"], s["pdserve"], Bar(2.5, at_most=False)))
    table.rows.append(Row("wall time, s", walls["transformers"], walls["pdserve"]))
    hf = next(side for side in sides if isinstance(side, TransformersSide))
    table.notes.append(check_tokens(hf, *last["pdserve"], max_tokens, sizes.mixed_checks))
    return table


def check_tokens(hf: TransformersSide, prompts: Prompts, pd_outs: Outputs, max_tokens: Sequence[int],
                 count: int) -> str:
    """Compare pdserve's tokens with transformers' run unbatched (no padding) for `count` requests."""
    picks = sorted({round(i * (len(prompts) - 1) / max(count - 1, 1)) for i in range(count)})
    results = []
    for i in picks:
        ref = hf.generate([prompts[i]], [max_tokens[i]])[0]  # a batch of one: no padding
        diverge = next((j for j, (a, b) in enumerate(zip(ref, pd_outs[i])) if a != b), None)
        results.append(f"#{i} ({len(prompts[i])}+{max_tokens[i]}): "
                       + ("match" if diverge is None else f"DIFFER from token {diverge}"))
    matched = sum(r.endswith("match") for r in results)
    return f"token check vs unbatched transformers: {matched}/{len(picks)} matched; " + "; ".join(results)


BENCHES: dict[str, Callable[[Sequence[Side], Sizes, int], Table]] = {
    "decode": bench_decode, "throughput": bench_throughput, "mixed": bench_mixed,
}


# -- report -----------------------------------------------------------------------------------


def machine_info(threads: int) -> dict[str, object]:
    cpu = cpu_name()
    return {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]), "cpu": cpu, "cores": os.cpu_count(),
        "torch": torch.__version__, "transformers": transformers.__version__, "threads": threads,
        "python": platform.python_version(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()],
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def format_table(table: Table) -> str:
    header = ("metric", "transformers", "pdserve", "ratio", "bar", "met?")
    lines = [header] + [
        (r.metric, f"{statistics.median(r.transformers):.4g}", f"{statistics.median(r.pdserve):.4g}",
         f"{r.ratio:.3f}x", str(r.bar) if r.bar else "-", _met_cell(r))
        for r in table.rows
    ]
    widths = [max(len(line[c]) for line in lines) for c in range(len(header))]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [fmt(lines[0]), rule] + [fmt(line) for line in lines[1:]]
    spread = [f"per-repeat ratios, {r.metric}: " + ", ".join(f"{x:.3g}" for x in r.paired_ratios)
              for r in table.rows if r.bar]
    return "\n".join([f"## {table.title}", *(f"- {n}" for n in table.notes), "", *body, "", *spread, ""])


def _met_cell(row: Row) -> str:
    if row.bar is None:
        return "-"
    return {True: "yes", False: "NO", None: "n/a (noise)"}[row.met]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=None, help="A/B repeats (default 5, or 2 with --quick)")
    p.add_argument("--quick", action="store_true", help="fewer repeats and smaller workloads (smoke run)")
    p.add_argument("--only", choices=sorted(BENCHES), help="run one measurement")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--detokenize", action="store_true",
                   help="let pdserve detokenize as it goes (transformers returns ids only, so off by default)")
    p.add_argument("--out", type=Path, help="write results as JSON here")
    args = p.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    sizes = QUICK if args.quick else FULL
    if args.repeats is not None:
        sizes = dataclasses.replace(sizes, repeats=args.repeats)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    info = machine_info(args.threads)
    print(f"# pdserve engine vs transformers generate (tiny model, float32, greedy, CPU)\n"
          f"command: {info['command']}\n"
          f"machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}, transformers "
          f"{info['transformers']}, {info['threads']} threads; load avg at start {info['loadavg_at_start']}\n"
          f"repeats: {sizes.repeats} (A B A B, A = transformers; medians shown; ratio = pdserve / transformers)\n",
          flush=True)
    started = time.perf_counter()
    model_dir = default_model_dir(progress=False)
    hf = TransformersSide(model_dir, sizes.static_batch)
    sides: list[Side] = [hf, PdserveSide(sizes, args.detokenize)]
    vocab = hf.model.config.vocab_size
    warm_up(sides, vocab)
    tables = []
    for name in [args.only] if args.only else list(BENCHES):
        tables.append(BENCHES[name](sides, sizes, vocab))
        print(format_table(tables[-1]), flush=True)
    elapsed = time.perf_counter() - started
    load = [round(x, 2) for x in os.getloadavg()]
    print(f"total time: {elapsed:.0f} s; load avg at end {load}", flush=True)
    if load[1] > max(os.cpu_count() or 1, args.threads) + 1:  # this run alone accounts for ~threads
        print("warning: the 5-minute load average is well above this run's own threads: other work shared "
              "these cores, so the numbers above are noisy (see the per-repeat ratios)", flush=True)
    if args.out:
        result = {"machine": info, "loadavg_at_end": load, "sizes": dataclasses.asdict(sizes),
                  "detokenize": args.detokenize,
                  "elapsed_s": elapsed,
                  "tables": [{"title": t.title, "notes": t.notes, "rows": [r.to_json() for r in t.rows]}
                             for t in tables]}
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
