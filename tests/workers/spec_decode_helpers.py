"""What the speculative decoding tests share: the target model, prompts, reading a request's KV, and
the joint law of the first sampled tokens (exact, and as an engine samples it)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.engine import LLMEngine
from pdserve.workers.request import Request
from pdserve.workers.spec.proposer import Drafts
from pdserve.workers.tiny.builder import TinyModelSpec

TARGET = tiny_spec(hidden_size=64, num_heads=4, num_kv_heads=2, init_std=0.05)


def target_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    """The target every speculative decoding test drafts for (built once per session)."""
    return make_model(TARGET)


def prompts(n: int = 6) -> list[list[int]]:
    """Repetitive prompts (n-gram drafts find matches) and random ones (they find few)."""
    rng = random.Random(1)
    out = []
    for i in range(n):
        if i % 2:
            out.append([rng.randrange(5, 4000) for _ in range(40 + 7 * i)])
        else:
            motif = [rng.randrange(5, 4000) for _ in range(5 + i)]
            out.append((motif * 12)[: 50 + 9 * i])
    return out


def kv_of(engine: LLMEngine, request_id: str, num_tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The K and V of the first `num_tokens` positions of the request, per layer (copies)."""
    blocks = engine.kv.blocks_of(request_id)
    bs = engine.config.block_size
    out = []
    for k_cache, v_cache in engine.kv_caches:
        k = k_cache[blocks].flatten(0, 1)[:num_tokens]
        v = v_cache[blocks].flatten(0, 1)[:num_tokens]
        out.append((k.clone(), v.clone()))
    assert len(blocks) * bs >= num_tokens
    return out


class FixedDrafts:
    """Drafts the same tokens every time: some the target likes, some it does not,
    so verification both accepts and resamples."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def draft(self, requests: list[Request], ks: list[int]) -> Drafts:
        return [self.tokens[:k] for k in ks], [None] * len(ks)

    def retain(self, request_ids: set[str]) -> None:
        pass


def exact_joint(model_dir: Path, prompt: list[int], temperature: float, top_k: int,
                 depth: int) -> dict[tuple[int, ...], float]:
    """P(first `depth` tokens) under temperature + top-k sampling, in float64 with transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float64).eval()

    def law(prefix: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + prefix])).logits[0, -1] / temperature
        top = logits.topk(top_k)
        probs = top.values.softmax(-1)
        return dict(zip(top.indices.tolist(), probs.tolist()))

    joint: dict[tuple[int, ...], float] = {(): 1.0}
    for _ in range(depth):
        joint = {seq + (t,): p * q for seq, p in joint.items() for t, q in law(list(seq)).items()}
    return joint


def sample_joint(model_dir: Path, prompt: list[int], params: SamplingParams, n: int,
                  drafts: list[int] | None,
                  draft_model: Path | None = None) -> tuple[dict[tuple[int, ...], float], LLMEngine]:
    # The cost is pinned: this test is about the law, drafts must be made at any batch size.
    extra: dict[str, object] = {"speculative": "ngram", "num_speculative_tokens": len(drafts),
                                "spec_max_batch_size": 256,
                                "spec_token_cost": 0.001} if drafts else {}
    if draft_model is not None:
        extra = {"speculative": "draft", "draft_model": str(draft_model), "num_speculative_tokens": 2,
                 "spec_max_batch_size": 256, "spec_token_cost": 0.001}
    llm = LLM(str(model_dir), max_model_len=256, max_num_seqs=256, progress=False, **extra)
    if drafts:
        llm.engine.spec.proposer = FixedDrafts(drafts)  # type: ignore[assignment]
    counts: dict[tuple[int, ...], int] = {}
    for out in llm.generate([prompt] * n, params):
        key = tuple(out.outputs[0].token_ids)
        counts[key] = counts.get(key, 0) + 1
    return {k: c / n for k, c in counts.items()}, llm.engine


def tv(a: dict[tuple[int, ...], float], b: dict[tuple[int, ...], float]) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in a.keys() | b.keys())


def check_law_kept(model_dir: Path, prompt: list[int], params: SamplingParams, exact: dict[tuple[int, ...], float],
                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Drafts of the most likely path's second token, then its first (one the target likes, one it
    does not) verified by the engine: the sampled law of the first 3 tokens stays within the bound
    on the total variation from `exact` (64 outcomes: E[TV] <= 0.5 * sqrt(64 / n), plus
    sqrt(ln(1e6) / 2n) for a 1e-6 chance of a false alarm), and a verifier that accepts every draft
    (the negative control) breaks the same bound."""
    likely = max(exact, key=lambda k: exact[k])
    drafts = [likely[1], likely[0]]  # after t1, draft t2 := the likely one, t3 := an unlikely one
    n = 20_000

    def bound(m: int) -> float:
        return float(0.5 * (64 / m) ** 0.5 + (np.log(1e6) / (2 * m)) ** 0.5)

    got, engine = sample_joint(model_dir, prompt, params, n, drafts)
    assert engine.stats.spec_drafts > n // 2 and 0 < engine.stats.spec_accepted_tokens < engine.stats.spec_draft_tokens
    assert tv(got, exact) < bound(n), tv(got, exact)

    import pdserve.workers.model_runner as runner
    from pdserve.workers.spec.rejection import Verified

    def accept_all(logits, draft_tokens, num_drafts, batch, draft_probs=None):  # noqa: ANN001, ANN202
        tokens = [draft_tokens[b, :k].tolist() + [int(logits[b, k].argmax())] for b, k in enumerate(num_drafts)]
        return Verified(tokens, list(num_drafts))

    monkeypatch.setattr(runner, "verify", accept_all)
    m = 5_000
    biased, _ = sample_joint(model_dir, prompt, params, m, drafts)
    assert tv(biased, exact) > bound(m), tv(biased, exact)
