"""Speculative decoding (n-gram drafts) vs none: decode tokens/s, side by side.

Workloads, each at batch 1, 4 and 16, greedy, `--new` tokens per request:
  - repetitive: code-like prompts that repeat themselves (similar lines, a
    class with similar methods), where prompt lookup finds what comes next;
  - code: plain chunks of Python source from the local corpus;
  - free text: English prose (the Python license text on this machine);
  - random: random token ids, sampled at temperature 1.5 (random text in and
    out), where drafts are (almost) never accepted. The others are greedy.

Decode tokens/s = batch * (N - 1) / (t(N tokens) - t(1 token)), so prefill and
the first token cancel out. Plain and speculative engines alternate A B C,
C B A over `--repeats` repeats after a full warm-up run each; medians; ratio =
spec / plain. Mean acceptance length = tokens emitted per verification pass
(accepted drafts + 1).

    python bench/spec_decode.py [--model DIR] [--repeats 3] [--new 96] [--k 4] [--out results.json]

Default model: the trained tiny target (workers/tiny/train.py) when it is
available, else the random-weight tiny model (whose text is not text-like).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch
from machine import cpu_name

from pdserve import LLM, SamplingParams


def default_pair() -> tuple[str, str | None]:
    """(target, draft) directories: the trained tiny pair, built once and cached."""
    try:
        from pdserve.workers.tiny.train import default_pair_dir
    except ImportError:
        from pdserve.workers.tiny.builder import default_model_dir

        print("[bench] no trained pair available: the random-weight tiny model, n-gram only", file=sys.stderr)
        return str(default_model_dir(progress=True)), None
    root = Path(default_pair_dir(progress=True))
    return str(root / "target"), str(root / "draft")


# Random prompts alone still get text-like (copyable) output from a trained
# model; sampled at temperature 1.5 the output is random too, and drafts are
# accepted only with the small probability p(draft).
TEMPERATURE = {"random": 1.5}


def workloads(tokenizer: object, n: int, prompt_tokens: int, seed: int,
              only: set[str] | None = None) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)
    encode = tokenizer.encode  # type: ignore[attr-defined]

    def clip(text: str) -> list[int]:
        return list(encode(text))[-prompt_tokens:]

    repetitive = []
    for i in range(n):
        name = rng.choice(["value", "item", "node", "entry"])
        lines = [f"    {name}_{j} = self.get_{name}({j}, default=None)\n" for j in range(40)]
        methods = "".join(f"    def get_{name}_{j}(self):\n        return self._{name}s[{j}]\n\n" for j in range(12))
        repetitive.append(clip(f"class Table{i}:\n" + (methods if i % 2 else "".join(lines))))
    lib = Path(sysconfig.get_paths()["stdlib"])
    sources = sorted(p for p in lib.glob("*.py") if p.stat().st_size > 20_000)
    code = []
    for _ in range(n):
        text = rng.choice(sources).read_text(errors="replace")
        start = rng.randrange(0, len(text) - 4000)
        code.append(clip(text[start:start + 4000]))
    prose_file = next((p for p in (lib / "LICENSE.txt", lib.parent / "LICENSE.txt") if p.exists()), None)
    prose = (prose_file.read_text(errors="replace") if prose_file
             else ("The quick brown fox jumps over the lazy dog. " * 200))
    paragraphs = [p for p in prose.split("\n\n") if len(p) > 400] or [prose]
    free = [clip(" ".join(rng.choice(paragraphs).split())) for _ in range(n)]
    # Random token ids: nothing to copy, nothing a draft can guess (the
    # worst case: speculation must cost almost nothing here).
    vocab = len(tokenizer)  # type: ignore[arg-type]
    rand = [[rng.randrange(16, vocab) for _ in range(prompt_tokens)] for _ in range(n)]
    loads = {"repetitive": repetitive, "code": code, "free text": free, "random": rand}
    return {k: v for k, v in loads.items() if not only or k in only}


def timed(llm: LLM, prompts: list[list[int]], new: int, temperature: float = 0.0) -> float:
    params = SamplingParams(temperature=temperature, max_tokens=new, ignore_eos=True)
    gc.collect()
    gc.disable()  # a collection inside one timed run and not the other is noise
    try:
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start
    finally:
        gc.enable()


def decode_rate(llm: LLM, prompts: list[list[int]], new: int, temperature: float = 0.0) -> float:
    return len(prompts) * (new - 1) / max(timed(llm, prompts, new, temperature) - timed(llm, prompts, 1, temperature),
                                          1e-9)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="target (default: the trained tiny pair's)")
    ap.add_argument("--draft-model", default=None, help="draft (default: the trained tiny pair's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=192)
    ap.add_argument("--batches", default="1,4,16")
    ap.add_argument("--workloads", default="repetitive,code,free text,random",
                    help="comma-separated, of: repetitive, code, free text, random")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of every workload but random (1.5 there); 0 = greedy")
    ap.add_argument("--pin-cost", type=float, default=None,
                    help="pin the price of a draft (spec_token_cost) instead of measuring it: draft every step, "
                         "to measure acceptance rather than speed")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=None)
    return ap.parse_args()


def measure(name: str, prompts: list[list[int]], b: int, plain: LLM, engines: dict[str, LLM],
            a: argparse.Namespace) -> dict[str, object]:
    """One row: workload `name` at batch `b`, plain and every speculative engine, medians over the repeats."""
    batch = prompts[:b]
    # Warm-up: one full run each, so that what the engines adapt (the
    # measured price of drafting, the acceptance rate new requests start
    # from) reflects this workload, as it would in a server that has run a while.
    for llm in (plain, *engines.values()):
        decode_rate(llm, batch, a.new, TEMPERATURE.get(name, a.temperature))
    rates: dict[str, list[float]] = {"plain": [], **{k: [] for k in engines}}
    before = {k: (e.engine.stats.spec_drafts, e.engine.stats.spec_accepted_tokens) for k, e in engines.items()}
    for r in range(a.repeats):
        print(f"[bench] {name}, batch {b}, repeat {r + 1}/{a.repeats}", file=sys.stderr, flush=True)
        # A B C, then C B A: a drift of the machine's speed over the
        # repeats favours neither side.
        order = [("plain", plain), *engines.items()]
        for k, e in order if r % 2 == 0 else order[::-1]:
            rates[k].append(decode_rate(e, batch, a.new, TEMPERATURE.get(name, a.temperature)))
    row: dict[str, object] = {"workload": name, "batch": b, "plain_tok_s": statistics.median(rates["plain"])}
    for k, e in engines.items():
        drafts = e.engine.stats.spec_drafts - before[k][0]
        accepted = e.engine.stats.spec_accepted_tokens - before[k][1]
        row[f"{k}_tok_s"] = statistics.median(rates[k])
        row[f"{k}_ratio"] = row[f"{k}_tok_s"] / row["plain_tok_s"]  # type: ignore[operator]
        row[f"{k}_acceptance_length"] = (accepted + drafts) / drafts if drafts else 0.0
        price = e.engine.spec.cost.price(b)  # what drafting cost, measured (workers/spec/cost.py)
        row[f"{k}_price"] = [price.fixed, price.per_token]
    return row


def print_tables(rows: list[dict[str, object]], engines: dict[str, LLM]) -> None:
    """The rates table (markdown), then the measured price of drafting per row."""
    head = "| workload | batch | none, tok/s |" + "".join(f" {k}, tok/s | {k} ratio | {k} mean acceptance length |"
                                                      for k in engines)
    print(head + "\n" + "|---|---:|---:|" + "---:|---:|---:|" * len(engines))
    for r in rows:
        print(f"| {r['workload']} | {r['batch']} | {r['plain_tok_s']:.0f} |" + "".join(
            f" {r[f'{k}_tok_s']:.0f} | {r[f'{k}_ratio']:.2f}x | {r[f'{k}_acceptance_length']:.2f} |" for k in engines))
    print("\nmeasured price of drafting, in tokens' worth (fixed per verification / per draft):")
    for r in rows:
        print(f"  {r['workload']}, batch {r['batch']}: " + ", ".join(
            f"{k} {r[f'{k}_price'][0]:.2f} / {r[f'{k}_price'][1]:.2f}" for k in engines))


def main() -> int:
    a = parse_args()
    torch.set_num_threads(a.threads)
    model, draft = (a.model, a.draft_model) if a.model else default_pair()
    cpu = cpu_name()
    print(f"# speculative decoding vs none\ncommand: python {' '.join(sys.argv)}\nmodel: {model}\ndraft: {draft}\n"
          f"machine: {cpu}, {os.cpu_count()} cores, {a.threads} torch threads; torch {torch.__version__}\n", flush=True)
    common = dict(max_model_len=1024, progress=False)
    plain = LLM(model, **common)
    spec = dict(num_speculative_tokens=a.k, spec_token_cost=a.pin_cost)
    engines = {"n-gram": LLM(model, **common, speculative="ngram", **spec)}
    if draft:
        engines["draft"] = LLM(model, **common, speculative="draft", draft_model=draft, **spec)
    batches = [int(b) for b in a.batches.split(",")]
    loads = workloads(plain.tokenizer, max(batches), a.prompt_tokens, seed=0, only=set(a.workloads.split(",")))
    rows = [measure(name, prompts, b, plain, engines, a) for name, prompts in loads.items() for b in batches]
    print_tables(rows, engines)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
