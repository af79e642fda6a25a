"""Speculative decoding with a draft model: the same tokens as without it, the target's law when drafts
are sampled, and the draft's own KV rolled back with the target's."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from factories import tiny_spec
from spec_decode_helpers import exact_joint, kv_of, prompts, sample_joint, target_dir, tv

from pdserve import LLM, SamplingParams
from pdserve.workers.config import EngineConfig
from pdserve.workers.engine import LLMEngine
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return target_dir(make_model)


@pytest.fixture(scope="module")
def draft_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    """A 1-layer model with the same tokenizer and vocabulary (other random weights)."""
    return make_model(tiny_spec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, init_std=0.05, seed=7))


@pytest.mark.parametrize("draft", ["other", "self"])
def test_greedy_output_with_a_draft_model_equals_without(model_dir: Path, draft_dir: Path, draft: str) -> None:
    """A different draft (mostly rejected) and the target itself as draft (mostly
    accepted): tokens as without speculation, mixed with requests that turn it
    off; the draft's KV is freed when requests end."""
    ps = prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True, speculative=i % 3 != 1)
              for i in range(len(ps))]
    want = [o.outputs[0].token_ids for o in LLM(str(model_dir), max_model_len=512, progress=False).generate(ps, params)]
    path = draft_dir if draft == "other" else model_dir
    spec = LLM(str(model_dir), max_model_len=512, progress=False, speculative="draft", draft_model=str(path),
               num_speculative_tokens=3, spec_max_batch_size=64)
    assert [o.outputs[0].token_ids for o in spec.generate(ps, params)] == want
    st = spec.engine.stats
    assert st.spec_drafts > 0
    if draft == "self":
        assert st.spec_accepted_tokens >= 0.9 * st.spec_draft_tokens
    proposer = spec.engine.spec.proposer
    assert proposer.num_tracked == 0 and proposer.kv.pool.num_used == 0  # type: ignore[union-attr]
    assert spec.engine.kv.pool.num_used == 0


@pytest.fixture(scope="module")
def near_draft_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with noise on its weights: a law close to the target's but not
    equal (two unrelated random models share no top-4 token: nothing would be accepted)."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("near-draft")
    for f in model_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(0)
    for f in out.glob("*.safetensors"):
        weights = load_file(f)
        save_file({k: v + 0.5 * v.std() * torch.randn(v.shape, generator=g).to(v.dtype) if v.is_floating_point()
                   and v.dim() == 2 else v for k, v in weights.items()}, f, metadata={"format": "pt"})
    return out


def test_sampled_drafts_of_a_draft_model_keep_the_targets_distribution(model_dir: Path, near_draft_dir: Path) -> None:
    """For a random request the draft model samples from its own law q (under the
    request's temperature and top-k) and hands q to verification: the joint law of
    the first 3 tokens is still the target's (the bound of the n-gram test in test_spec_decode.py)."""
    prompt = prompts()[1][:24]
    params = SamplingParams(temperature=0.8, top_k=4, max_tokens=3, ignore_eos=True, detokenize=False)
    exact = exact_joint(model_dir, prompt, 0.8, 4, depth=3)
    n = 20_000
    got, engine = sample_joint(model_dir, prompt, params, n, None, draft_model=near_draft_dir)
    st = engine.stats
    assert st.spec_drafts > n // 2 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    assert tv(got, exact) < 0.5 * (64 / n) ** 0.5 + (np.log(1e6) / (2 * n)) ** 0.5, tv(got, exact)


def test_the_target_as_its_own_sampling_draft_is_always_accepted(model_dir: Path) -> None:
    """q = p when the draft is the target: every sampled draft is accepted (an
    argmax draft would be accepted only with probability p(argmax))."""
    ps = prompts(4)
    spec = LLM(str(model_dir), max_model_len=512, progress=False, speculative="draft", draft_model=str(model_dir),
               num_speculative_tokens=3, spec_max_batch_size=64, spec_token_cost=0.01)
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=40, ignore_eos=True)
    spec.generate([ps[0]], params)
    st = spec.engine.stats
    assert st.spec_draft_tokens > 20 and st.spec_accepted_tokens >= 0.98 * st.spec_draft_tokens


@pytest.mark.parametrize("max_batch", [64, 2])
def test_a_seeded_request_gives_the_same_tokens_alone_batched_and_without_speculation(
        model_dir: Path, max_batch: int) -> None:
    """A seed promises the same samples whatever else runs. How many drafts a request gets
    depends on the batch (past `spec_max_batch_size` 2 here, none), and verification spends
    a seeded row's draws otherwise than plain steps: so seeded sampled requests do not
    speculate, and get the tokens of a run without speculation, alone or batched."""
    ps = prompts(4)
    spec = LLM(str(model_dir), max_model_len=512, progress=False, speculative="draft", draft_model=str(model_dir),
               num_speculative_tokens=3, spec_max_batch_size=max_batch, spec_token_cost=0.01)
    plain = LLM(str(model_dir), max_model_len=512, progress=False)
    params = SamplingParams(temperature=0.7, max_tokens=32, ignore_eos=True, seed=1234)
    alone = spec.generate([ps[0]], params)[0].outputs[0].token_ids
    others = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    batched = spec.generate([ps[1], ps[0], ps[2]], [others, params, others])[1].outputs[0].token_ids
    want = plain.generate([ps[0]], params)[0].outputs[0].token_ids
    assert alone == want and batched == want


def test_a_draft_with_another_vocabulary_is_refused(model_dir: Path,
                                                    make_model: Callable[[TinyModelSpec], Path]) -> None:
    other = make_model(tiny_spec(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=1, vocab_size=512))
    with pytest.raises(ValueError, match="draft_model: its (vocabulary|tokenizer)"):
        LLM(str(model_dir), max_model_len=512, progress=False, speculative="draft", draft_model=str(other))
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(model=str(model_dir), speculative="draft")


def test_draft_kv_after_rejections_equals_a_fresh_draft_prefill(model_dir: Path, draft_dir: Path) -> None:
    """The draft's own cache is rewound too: mid-generation, after many rejected
    drafts, its KV for the tokens it counts as computed equals the draft model's
    KV for those tokens computed from scratch."""
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=512, speculative="draft",
                                    draft_model=str(draft_dir), num_speculative_tokens=3,
                                    spec_token_cost=0.001))  # keep drafting although it fails
    engine.add_request("r", prompts()[0], SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    for _ in range(25):
        engine.step()
    st = engine.stats
    assert st.spec_draft_tokens - st.spec_accepted_tokens >= 10, "the test needs rejected drafts"
    proposer = engine.spec.proposer
    shadow = proposer._shadows["r"].request  # type: ignore[union-attr]
    n = shadow.num_computed_tokens
    fresh = LLMEngine(EngineConfig(model=str(draft_dir), max_model_len=512, enable_prefix_caching=False))
    fresh.add_request("f", shadow.all_token_ids[:n], SamplingParams(temperature=0.0, max_tokens=1), hold_kv=True)
    while fresh.has_unfinished_requests():
        fresh.step()
    got = kv_of(_Caches(proposer.kv, proposer.kv_caches, engine.config.block_size), "r", n)  # type: ignore[union-attr]
    for (k0, v0), (k1, v1) in zip(kv_of(fresh, "f", n), got):
        torch.testing.assert_close(k1, k0, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-5)


class _Caches:
    """What `kv_of` reads from an engine: its block tables and its caches."""

    def __init__(self, kv: object, kv_caches: list[tuple[torch.Tensor, torch.Tensor]], block_size: int) -> None:
        self.kv, self.kv_caches = kv, kv_caches
        self.config = type("C", (), {"block_size": block_size})()


def test_a_request_id_reused_after_an_abort_drafts_from_its_own_tokens(model_dir: Path, draft_dir: Path) -> None:
    """A worker aborts a request without an output (its client was told already), and a later
    try of the same request, resuming from fewer tokens than the first had, takes its id at
    once. The draft model must not keep the first one's sequence: it would take that one's
    tokens as the new one's, claim more computed than there is, and spin on the engine
    thread. The new request's output equals the engine's without speculation."""
    import threading

    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = prompts()[0]
    want = LLM(str(model_dir), max_model_len=512, progress=False).generate([prompt[:10]], params)[0].outputs[0]
    engine = LLMEngine(EngineConfig(model=str(model_dir), max_model_len=512, speculative="draft",
                                    draft_model=str(draft_dir), num_speculative_tokens=3,
                                    spec_token_cost=0.001))  # keep drafting although it fails
    engine.add_request("r", prompt, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    for _ in range(8):
        engine.step()
    assert engine.stats.spec_drafts > 0, "the test needs the first request to have drafted"
    engine.abort("r", output=False)
    engine.add_request("r", prompt[:10], params)  # the same id, fewer tokens than the first had
    got: list[int] = []

    def run() -> None:
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got.extend(out.outputs[0].token_ids)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), "the engine thread spun: the draft model kept the aborted request's sequence"
    assert got == want.token_ids


def _copy_model(src: Path, out: Path) -> Path:
    import shutil

    for f in src.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    return out


def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused(model_dir: Path, draft_dir: Path,
                                                                    tmp_path: Path) -> None:
    """Same vocabulary size, other ids (two tokens swapped): taken, it would accept next to
    nothing. The tokenizers are compared, as the sizes were."""
    import json

    other = _copy_model(draft_dir, tmp_path)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if len(t) > 2][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="draft_model: its tokenizer"):
        LLM(str(model_dir), max_model_len=512, progress=False, speculative="draft", draft_model=str(other))


@pytest.fixture(scope="module")
def padded_target_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target with 64 more vocabulary rows that no token uses (embedding and LM head
    padded, as Qwen2.5's larger models are padded further than its smaller ones): the
    unpadded target then is a draft of a smaller vocabulary with the same tokenizer."""
    import json

    from safetensors.torch import load_file, save_file

    out = _copy_model(model_dir, tmp_path_factory.mktemp("padded-target"))
    cfg = json.loads((out / "config.json").read_text())
    size = cfg["vocab_size"]
    cfg["vocab_size"] = size + 64
    (out / "config.json").write_text(json.dumps(cfg))
    for f in out.glob("*.safetensors"):
        weights = load_file(f)
        for k, v in weights.items():
            if v.dim() == 2 and v.shape[0] == size:  # embed_tokens, lm_head: rows past the tokenizer's
                weights[k] = torch.cat([v, torch.full((64, v.shape[1]), -0.5 * v.abs().max().item(), dtype=v.dtype)])
        save_file(weights, f, metadata={"format": "pt"})
    return out


def test_a_draft_padded_less_than_its_target_is_taken_and_exact(model_dir: Path, padded_target_dir: Path) -> None:
    """A draft whose vocabulary is the target's minus padding rows (the same tokenizer) was
    refused; vLLM and llama.cpp take such pairs. Taken now: greedy output equals the target's
    without speculation, drafts are accepted, and sampled drafts (their q padded with zeros
    to the target's width) and a logit bias on a padding id run without a fault."""
    ps = prompts(4)
    plain = LLM(str(padded_target_dir), max_model_len=512, progress=False)
    spec = LLM(str(padded_target_dir), max_model_len=512, progress=False, speculative="draft",
               draft_model=str(model_dir), num_speculative_tokens=3, spec_max_batch_size=64, spec_token_cost=0.01)
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in spec.generate(ps, greedy)] == \
        [o.outputs[0].token_ids for o in plain.generate(ps, greedy)]
    st = spec.engine.stats
    assert st.spec_draft_tokens > 20 and st.spec_accepted_tokens >= 0.5 * st.spec_draft_tokens
    drafted = st.spec_draft_tokens
    size = spec.engine.model_config.vocab_size - 64
    sampled = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, logit_bias={size + 3: -5.0})
    out = spec.generate(ps[:2], sampled)
    assert all(len(o.outputs[0].token_ids) == 24 for o in out)
    assert spec.engine.stats.spec_draft_tokens > drafted  # sampled rows drafted too
