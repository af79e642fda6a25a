"""Offline speed on a real model: pdserve's `LLM.generate` vs transformers' `generate`.

The default model (SmolLM2-135M-Instruct, fetched and converted once) or any
HF-format directory / GGUF file (`--model`). Both sides run the same float32
weights greedily on the CPU in one process, alternating A B A B (A =
transformers, B = pdserve, its model compiled as by default) over `--repeats`
repeats after a warm-up call each (`--with-eager`: also pdserve with
`enforce_eager`, a third side C in the same rotation):

- batch 1: one chat prompt, `--tokens` output tokens;
- batch 8: eight chat prompts at once (transformers: one left-padded batch).

`--prompt-len N` uses random token ids of N tokens instead (seeded, fresh for
each batch size; all prompts of one length, so transformers pads nothing): the
workload the issue's figures came from is 256 in, 64 out.

EOS is masked on both sides (`min_tokens` = transformers' `min_new_tokens` =
`max_tokens`), so both produce exactly `--tokens` tokens per prompt; the table
gives output tokens/s (medians), the speed-up (pdserve tokens/s over
transformers'), and how many prompts' tokens were identical.

    python bench/real_model.py [--model PATH] [--repeats 5] [--tokens 64] [--threads 2] [--with-eager]
                               [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from machine import cpu_name
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colors.",
    "What is 12 times 7?",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "Name a planet in the solar system and one fact about it.",
]
BATCHES = (1, 8)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF-format directory or GGUF file (default: the default model)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=64, help="output tokens per prompt")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (default 2)")
    p.add_argument("--max-model-len", type=int, default=None, help="pdserve's (default: the model's, as it fits)")
    p.add_argument("--prompt-len", type=int, default=None, help="random prompts of this many tokens (default: chat)")
    p.add_argument("--with-eager", action="store_true", help="also time pdserve with enforce_eager")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    return p.parse_args()


def model_dir(arg: str | None) -> Path:
    if arg is None:
        from pdserve.workers.model.default_model import default_model

        got = default_model(progress=True)
        if got is None:
            raise SystemExit("the default model could not be fetched: name one with --model")
        return got
    if (Path(arg) / "config.json").is_file():  # an HF directory: also what an older pdserve (A/B) can load
        return Path(arg)
    from pdserve.workers.model.resolve import resolve_model

    return resolve_model(arg, progress=True)


def chat_prompts(tok: transformers.PreTrainedTokenizerBase, n: int) -> list[list[int]]:
    out = []
    for q in QUESTIONS[:n]:
        ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids))
    return out


def random_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    """Ids above the first 100 (SmolLM2's specials are 0-16), the same on both sides."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(100, vocab, (length,), generator=g).tolist() for _ in range(n)]


def run_transformers(model: transformers.PreTrainedModel, prompts: list[list[int]], n: int,
                     pad_id: int) -> list[list[int]]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n, min_new_tokens=n,
                             pad_token_id=pad_id)
    return [row[width:].tolist() for row in out]


def run_pdserve(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def timed(fn: object) -> tuple[float, list[list[int]]]:
    start = time.perf_counter()
    out = fn()  # type: ignore[operator]
    return time.perf_counter() - start, out


def main() -> int:
    a = parse_args()
    torch.set_num_threads(a.threads)
    path = model_dir(a.model)
    print(f"[bench] model {path}; loading both sides ...", file=sys.stderr, flush=True)
    tok = AutoTokenizer.from_pretrained(str(path))
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    extra = {} if a.max_model_len is None else {"max_model_len": a.max_model_len}
    llm = LLM(str(path), dtype="float32", progress=True, enforce_eager=False, **extra)
    eager = LLM(str(path), dtype="float32", progress=False, enforce_eager=True, **extra) if a.with_eager else None
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
    rows = []
    for batch in BATCHES:
        prompts = (chat_prompts(tok, batch) if a.prompt_len is None
                   else random_prompts(len(tok), batch, a.prompt_len, seed=batch))
        run_transformers(hf, prompts, 4, pad_id)  # warm-up
        run_pdserve(llm, prompts, 4)
        if eager is not None:
            run_pdserve(eager, prompts, 4)
        hf_s: list[float] = []
        pd_s: list[float] = []
        eager_s: list[float] = []
        same = 0
        for rep in range(a.repeats):
            print(f"[bench] batch {batch}: repeat {rep + 1}/{a.repeats}", file=sys.stderr, flush=True)
            t_hf, out_hf = timed(lambda: run_transformers(hf, prompts, a.tokens, pad_id))
            t_pd, out_pd = timed(lambda: run_pdserve(llm, prompts, a.tokens))
            hf_s.append(t_hf)
            pd_s.append(t_pd)
            same = sum(x == y for x, y in zip(out_hf, out_pd))
            if eager is not None:
                t_eager, _ = timed(lambda: run_pdserve(eager, prompts, a.tokens))
                eager_s.append(t_eager)
        tokens = batch * a.tokens
        hf_rate, pd_rate = tokens / statistics.median(hf_s), tokens / statistics.median(pd_s)
        row: dict[str, Any] = {"batch": batch, "transformers_tok_s": hf_rate, "pdserve_tok_s": pd_rate,
               "speedup": pd_rate / hf_rate, "paired_speedups": [h / p for h, p in zip(hf_s, pd_s)],
               "identical_prompts": same, "prompts": batch}
        if eager_s:
            row["eager_tok_s"] = tokens / statistics.median(eager_s)
            row["eager_speedup"] = row["eager_tok_s"] / hf_rate
        rows.append(row)
    cpu = cpu_name()
    print(f"# offline speed: pdserve vs transformers on {path.name}\n"
          f"command: python {' '.join(sys.argv)}\nmachine: {cpu}, {os.cpu_count()} cores, {a.threads} torch threads; "
          f"torch {torch.__version__}, transformers {transformers.__version__}\n"
          f"greedy, {'chat prompts' if a.prompt_len is None else f'random {a.prompt_len}-token prompts'}, "
          f"{a.tokens} output tokens per prompt (EOS masked), medians of {a.repeats} A/B repeats\n")
    extra_head, extra_rule = (" pdserve eager tok/s | eager speed-up |", "---:|---:|") if eager else ("", "")
    print(f"| batch | transformers tok/s | pdserve tok/s | speed-up | per-repeat speed-ups |{extra_head} "
          "identical outputs |")
    print(f"|---:|---:|---:|---:|---|{extra_rule}---:|")
    for r in rows:
        spread = ", ".join(f"{x:.2f}" for x in r["paired_speedups"])
        cells = f" {r['eager_tok_s']:.1f} | {r['eager_speedup']:.2f}x |" if eager else ""
        print(f"| {r['batch']} | {r['transformers_tok_s']:.1f} | {r['pdserve_tok_s']:.1f} | {r['speedup']:.2f}x | "
              f"{spread} |{cells} {r['identical_prompts']}/{r['prompts']} |")
    if a.out:
        a.out.write_text(json.dumps({"command": " ".join(sys.argv), "model": str(path), "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
