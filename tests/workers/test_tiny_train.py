"""Tests for the trained tiny pair (`pdserve.workers.tiny.train`).

A pair a few hundred times smaller than the default (hidden 64, 64-token
windows, a 256 KB corpus, a few dozen steps) trains in seconds; the
multi-minute default is never trained here. transformers is the oracle for
what the engine must load and generate.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from factories import tiny_spec
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve import LLM, SamplingParams
from pdserve.workers.tiny import train
from pdserve.workers.tiny.train import PairSpec, TrainConfig, make_tiny_pair, pair_dir, pair_spec

TARGET = tiny_spec(num_layers=2)
SPEC = PairSpec(
    target=TARGET,
    draft=replace(TARGET, num_layers=1),
    target_train=TrainConfig(steps=40, batch_size=4, lr=3e-3),
    draft_train=TrainConfig(steps=20, batch_size=4, lr=3e-3, distill_weight=0.75),
    seq_len=64,
    corpus_bytes=256 * 1024,
    heldout_every=3,
    eval_windows=8,
)
PROMPT = "def fibonacci(n):\n    "
# One thread: ops this small spend more time in thread hand-offs than in
# arithmetic, and far more when other processes load the machine.
THREADS = 1


@pytest.fixture(scope="module")
def pair(session_cache: Path) -> Path:
    return pair_dir(SPEC, progress=False, threads=THREADS)


def _quality(pair: Path) -> dict:
    return json.loads((pair / "quality.json").read_text())


def test_training_lowers_the_loss(pair: Path) -> None:
    q = _quality(pair)
    uniform = torch.log(torch.tensor(float(TARGET.vocab_size))).item()
    assert q["target"]["loss_end"] < q["target"]["loss_start"] - 0.5
    assert q["draft"]["loss_end"] < q["draft"]["loss_start"]
    for name in ("target", "draft"):
        assert q[name]["heldout_loss"] < uniform - 1.0, (name, q[name])
    # Distillation from the target, not a fresh start: the draft begins where the target ended.
    assert q["draft"]["loss_start"] < q["target"]["loss_start"]
    assert q["draft"]["tensors_from_target"] > 0
    agreement = q["pair"]["greedy_next_token_agreement"]
    assert 0.0 <= agreement <= 1.0
    assert 0.0 <= q["pair"]["accepted_per_step_k4"] <= 4.0


@pytest.mark.parametrize("role", ["target", "draft"])
def test_engine_generates_what_transformers_does(pair: Path, role: str) -> None:
    model_dir = pair / role
    hf, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    prompt = AutoTokenizer.from_pretrained(model_dir)(PROMPT)["input_ids"]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(12):
            ids = torch.cat([ids, hf(input_ids=ids).logits[:, -1:].argmax(-1)], dim=1)
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, num_kv_blocks=32, progress=False)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ids[0, len(prompt):].tolist()


def test_draft_and_target_share_the_tokenizer(pair: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (pair / "draft" / name).read_bytes() == (pair / "target" / name).read_bytes(), name
    target, draft = (json.loads((pair / r / "config.json").read_text()) for r in ("target", "draft"))
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "hidden_size"):
        assert draft[key] == target[key], key
    assert (target["num_hidden_layers"], draft["num_hidden_layers"]) == (2, 1)


def test_same_spec_gives_identical_weights_and_progress(tmp_path: Path, pair: Path,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    again = make_tiny_pair(tmp_path / "again", SPEC, progress=True, threads=THREADS)
    for role in ("target", "draft"):
        assert (again / role / "model.safetensors").read_bytes() == (pair / role / "model.safetensors").read_bytes()
    err = capsys.readouterr().err
    assert f"target: step {SPEC.target_train.steps}/{SPEC.target_train.steps}" in err
    assert "tok/s" in err and "ETA" in err and "greedy_next_token_agreement" in err


def test_pair_dir_trains_once(pair: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_: object, **__: object) -> None:
        raise AssertionError("trained again")

    monkeypatch.setattr(train, "make_tiny_pair", fail)
    assert pair_dir(SPEC, progress=False, threads=THREADS) == pair
    assert pair.name == f"tiny-pair-{SPEC.key()}"
    assert not list(pair.parent.glob(f".{pair.name}.tmp-*"))


def test_pair_dir_removes_what_a_killed_build_left(pair: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    models = tmp_path / "models"
    (models / f".tiny-pair-{SPEC.key()}.tmp-killed" / "target").mkdir(parents=True)
    monkeypatch.setattr(train, "make_tiny_pair", lambda out, *_, **__: shutil.copytree(pair, out))
    assert pair_dir(SPEC, progress=False) == models / pair.name
    assert sorted(p.name for p in models.iterdir()) == [f".{pair.name}.lock", pair.name]


def test_a_trainer_that_holds_the_lock_for_ever_ends_the_wait(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another process training the same pair, hung (stopped) with its lock held: the waiter ends
    # at its deadline with a ValueError naming the lock, not never.
    import fcntl

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(train, "TRAIN_LOCK_WAIT_S", 0.3)
    (tmp_path / "models").mkdir()
    lock_path = tmp_path / "models" / f".tiny-pair-{SPEC.key()}.lock"
    with open(lock_path, "w") as held:  # another open file description: flock sees another holder
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(ValueError, match=f"remove {lock_path}"):
            pair_dir(SPEC, progress=False)


def test_cache_key_follows_the_spec() -> None:
    assert SPEC.key() == replace(SPEC).key()
    assert SPEC.key() != replace(SPEC, seed=1).key()
    assert SPEC.key() != replace(SPEC, draft_train=replace(SPEC.draft_train, steps=21)).key()


def test_pair_spec_turns_minutes_into_steps() -> None:
    short, long = pair_spec(minutes=1.0), pair_spec(minutes=4.0)
    assert long.target_train.steps == pytest.approx(4 * short.target_train.steps, abs=2)
    assert long.target_train.steps > long.draft_train.steps > 0
    seeded = pair_spec(seed=7)
    assert seeded.seed == seeded.target.seed == seeded.draft.seed == 7
    assert seeded.draft.num_layers < seeded.target.num_layers


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(draft=replace(TARGET, vocab_size=2048)), "draft"),
        (dict(seq_len=4096), "seq_len"),
        (dict(heldout_every=1), "heldout_every"),
        (dict(target_train=TrainConfig(steps=5, distill_weight=0.5)), "target_train"),
    ],
)
def test_invalid_pair_spec_names_field(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=f"^{field}:"):
        replace(SPEC, **kwargs)


def test_lr_schedule_warms_up_then_decays() -> None:
    cfg = TrainConfig(steps=100, lr=1.0, warmup_frac=0.1, min_lr_ratio=0.1)
    factors = [cfg.lr_factor(s) for s in range(100)]
    assert factors[0] == pytest.approx(0.1) and factors[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(factors[9:], factors[10:]))
    assert factors[-1] == pytest.approx(0.1, abs=0.01)


def test_acceptance_counts_leading_matches() -> None:
    class Fixed(torch.nn.Module):
        """Predicts `table[token]` after each token, whatever came before."""

        def __init__(self, table: list[int]) -> None:
            super().__init__()
            self.table = torch.tensor(table)

        def forward(self, input_ids: torch.Tensor, **_: object) -> object:
            logits = torch.nn.functional.one_hot(self.table[input_ids], len(self.table)).float()
            return SimpleNamespace(logits=logits, cache=None)

    # Target counts 0,1,2,...,7,0,...; the draft agrees except after token 3.
    target = Fixed([(t + 1) % 8 for t in range(8)])
    draft = Fixed([(t + 1) % 8 if t != 3 else 0 for t in range(8)])
    prompts = torch.tensor([[0]])
    # Generated 1..8 (then 0): draft misses only the token after 3 (4).
    # Rounds from 1: accept 1,2,3 then miss at 4 -> 3; resume at 5: accept 5,6,7,0 -> 4; ...
    accepted = train.acceptance(draft, target, prompts, new_tokens=9, k=4)
    assert accepted == pytest.approx((3 + 4) / 2)
    assert train.acceptance(target, target, prompts, new_tokens=10, k=4) == pytest.approx((4 + 4) / 2)
