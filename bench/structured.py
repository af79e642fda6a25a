"""What structured outputs cost (issue 48's bars): compiling a 50-property JSON schema (first
time and cached), and decode throughput at batch 16 with a JSON schema against the same
requests unconstrained, alternating (ABBA), medians and their ratio.

The constrained requests' schema is an object with one long string (its length fixed well
past max_tokens), so both kinds run exactly max_tokens tokens (EOS ignored) and the only
difference is the grammar: its bitmask filled per step and applied to the logits.

    python bench/structured.py [--model tiny] [--batch 16] [--tokens 128] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from machine import cpu_name  # bench/ is on sys.path when run as a script

from pdserve import LLM, SamplingParams
from pdserve.workers.grammar import GrammarCompiler
from pdserve.workers.structured_outputs import StructuredOutputs


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny", help="tiny, or an HF-format model directory")
    p.add_argument("--batch", type=int, default=16, help="requests decoding at once (max_num_seqs)")
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--waves", type=int, default=2, help="batches of requests per run")
    p.add_argument("--rounds", type=int, default=3, help="constrained and unconstrained runs, alternating")
    return p.parse_args()


def fifty_properties() -> dict[str, object]:
    kinds: list[dict[str, object]] = [{"type": "string", "maxLength": 20}, {"type": "integer", "minimum": 0},
                                      {"type": "boolean"}, {"type": "number"}, {"enum": ["a", "b", "c"]},
                                      {"type": "array", "items": {"type": "string"}, "maxItems": 4}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(50)}
    return {"type": "object", "properties": props, "required": list(props)[:25], "additionalProperties": False}


def compile_times(llm: LLM) -> tuple[float, float]:
    """Seconds to compile the 50-property schema on a fresh compiler, then again (cached)."""
    eng = llm.engine
    compiler = GrammarCompiler(eng.tokenizer, eng.runner.vocab_size, eng.model_config.eos_token_ids)
    spec = StructuredOutputs(json=fifty_properties())
    t = time.perf_counter()
    compiler.compile(spec)
    first = time.perf_counter() - t
    t = time.perf_counter()
    compiler.compile(spec)
    return first, time.perf_counter() - t


def run(llm: LLM, a: argparse.Namespace, constrained: bool) -> tuple[float, float]:
    """(output tok/s, share of the run's time filling and applying bitmasks)."""
    schema = {"type": "object", "properties": {"text": {"type": "string", "minLength": 20 * a.tokens,
                                                        "maxLength": 20 * a.tokens}},
              "required": ["text"], "additionalProperties": False}
    so = {"json": schema} if constrained else None
    params = SamplingParams(temperature=0.0, max_tokens=a.tokens, ignore_eos=True, structured_outputs=so)
    prompts = [f"record {i}: " for i in range(a.batch * a.waves)]
    mask0 = llm.engine.snapshot().grammar_mask_s
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == a.tokens for o in outs)
    if constrained:
        assert all(o.outputs[0].text.startswith('{"text": "') for o in outs)
    return len(prompts) * a.tokens / dt, (llm.engine.snapshot().grammar_mask_s - mask0) / dt


def main() -> int:
    a = parse_args()
    print(f"[structured] loading {a.model} ...", file=sys.stderr, flush=True)
    llm = LLM(a.model, max_num_seqs=a.batch, progress=False)
    first, cached = compile_times(llm)
    run(llm, a, True)  # warm-up: the schema compiled, the engine's first steps
    run(llm, a, False)
    plain: list[float] = []
    masked: list[float] = []
    shares: list[float] = []
    for i in range(a.rounds):
        print(f"[structured] round {i + 1}/{a.rounds} ...", file=sys.stderr, flush=True)
        # ABBA: which kind runs first alternates, so a drift in the machine's speed within a
        # round does not favour one kind.
        for constrained in ((False, True) if i % 2 == 0 else (True, False)):
            tps, share = run(llm, a, constrained)
            if constrained:
                masked.append(tps)
                shares.append(share)
            else:
                plain.append(tps)
    print(f"# python bench/structured.py {' '.join(sys.argv[1:])}; {cpu_name()}")
    print(f"model {a.model}, batch {a.batch}, {a.tokens} tokens a request, {a.waves} waves, {a.rounds} rounds\n")
    print("| what | measured |")
    print("|---|---|")
    print(f"| compile, 50-property schema, first | {first * 1000:.1f} ms |")
    print(f"| compile, the same again (cached) | {cached * 1000:.3f} ms |")
    for name, runs in (("unconstrained", plain), ("JSON schema", masked)):
        listed = ', '.join(f'{x:.0f}' for x in runs)
        print(f"| {name} tok/s (rounds) | {listed}; median {statistics.median(runs):.0f} |")
    ratios = [m / p for m, p in zip(masked, plain)]
    print(f"| constrained / unconstrained (per round) | {', '.join(f'{r:.2f}' for r in ratios)}; "
          f"median **{statistics.median(ratios):.2f}x** |")
    share = statistics.median(shares) * 100
    print(f"| share of the constrained run in grammar work (masks, checked picks) | {share:.1f}% |")
    print(json.dumps({"compile_first_ms": first * 1000, "compile_cached_ms": cached * 1000,
                      "ratio": statistics.median(ratios)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
