"""`pdserve profile` on the tiny model: the profile it writes loads back with the grid asked for,
its times grow with the work where that holds by a wide margin, and its KV sizes match the model's
shape (an oracle from config.json, not the engine's own arithmetic). No wall-clock bars."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch.distributed as dist
from factories import tiny_spec

from pdserve.cluster.cli import main
from pdserve.cluster.planner.profile import Profile
from pdserve.cluster.planner.profiler import Grid, build_engine, profile_engine
from pdserve.workers.config import EngineConfig
from pdserve.workers.tiny.builder import TinyModelSpec
from pdserve.workers.transfer.base import Transport

# Wide gaps in the work (64x the prompt, 16x the rows at 16x the context): a time that grows by 1.5x
# at least holds on a busy machine too.
GRID = Grid(prefill_tokens=(16, 64, 1024), cached=((128, 32), (256, 64)), batches=(1, 4, 16), contexts=(64, 1024),
            transfer_tokens=(16, 128, 512), repeats=5, decode_steps=3)
BUDGET = 1024
KV_BLOCKS = 2048


@pytest.fixture(scope="module")
def model_dir(make_model: Callable[[TinyModelSpec], Path]) -> Path:
    return make_model(tiny_spec())


@pytest.fixture(scope="module")
def profile(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Profile:
    """One profile of the tiny model, written and read back as `pdserve profile` leaves it."""
    config = EngineConfig(model=str(model_dir), num_kv_blocks=KV_BLOCKS, max_num_batched_tokens=BUDGET, max_num_seqs=16)
    engine = build_engine(config, torch_threads=1)
    path = tmp_path_factory.mktemp("profile") / "profile.json"
    profile_engine(engine, GRID, Transport.ZMQ, 1, progress=lambda msg: None).save(path)
    return Profile.load(path)


def kv_bytes_per_token_oracle(model_dir: Path) -> int:
    """layers x (K and V) x KV heads x head dim x 4 bytes (float32 on the CPU), from config.json."""
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"] * 2 * c["num_key_value_heads"] * head_dim * 4


def test_the_profile_has_the_grid_asked_for(profile: Profile) -> None:
    assert [(p.new_tokens, p.cached_tokens) for p in profile.prefill] == [
        (16, 0), (64, 0), (1024, 0), (32, 128), (64, 256)]  # the prefixes really came from the cache
    assert [(d.batch, d.context) for d in profile.decode] == [(1, 64), (4, 64), (16, 64), (1, 1024), (4, 1024),
                                                             (16, 1024)]
    assert len(profile.transfer) == 3 and profile.transfer == tuple(sorted(profile.transfer, key=lambda t: t.bytes))
    assert profile.speculative is None  # speculation off: nothing to measure


def test_kv_sizes_follow_the_model_shape(profile: Profile, model_dir: Path) -> None:
    per_token = kv_bytes_per_token_oracle(model_dir)
    assert profile.kv_bytes_per_token == per_token
    assert [t.bytes for t in profile.transfer] == [n * per_token for n in GRID.transfer_tokens]


def test_machine_model_and_engine_are_recorded(profile: Profile, model_dir: Path) -> None:
    c = json.loads((model_dir / "config.json").read_text())
    assert profile.model["path"] == str(model_dir) and profile.model["architecture"] == "llama"
    assert (profile.model["layers"], profile.model["hidden_size"]) == (c["num_hidden_layers"], c["hidden_size"])
    assert profile.model["dtype"] == profile.engine.dtype == "float32"
    e = profile.engine
    assert (e.num_kv_blocks, e.max_num_batched_tokens, e.max_num_seqs, e.torch_threads, e.device) == (
        KV_BLOCKS, BUDGET, 16, 1, "cpu")
    assert profile.transport == "zmq" and profile.machine["cores"] >= 1 and profile.created.endswith("+00:00")


def test_times_grow_with_the_work(profile: Profile) -> None:
    prefill = {(p.new_tokens, p.cached_tokens): p.seconds for p in profile.prefill}
    decode = {(d.batch, d.context): d.seconds for d in profile.decode}
    assert prefill[(1024, 0)] > 1.5 * prefill[(16, 0)]
    assert decode[(16, 1024)] > 1.5 * decode[(1, 64)]
    # (Not the transfers: at the tiny model's few hundred KB, a handoff's fixed cost swamps its bytes.)
    costs = profile.costs()
    assert all(c >= 0 for c in (*costs.prefill_coef, *costs.decode_coef, *costs.transfer_coef))
    assert costs.prefill_s(1024) > costs.prefill_s(16) and costs.decode_s(16, 1024) > costs.decode_s(1, 64)


def test_the_grid_is_fitted_to_the_engine() -> None:
    """Prompts within one step's budget (the budget itself a point) and the model's length, batches
    within max_num_seqs, prefixes and transfers in whole blocks, decode contexts with room for the timed steps."""
    engine = SimpleNamespace(config=SimpleNamespace(max_num_batched_tokens=128, block_size=16, max_num_seqs=8,
                                                    speculative=None, num_speculative_tokens=4,
                                                    enable_prefix_caching=True),
                             max_model_len=512, num_kv_blocks=20)
    grid = Grid(prefill_tokens=(16, 64, 1000), cached=((100, 32), (500, 64), (64, 200)), batches=(1, 4, 32),
                contexts=(64, 4096), transfer_tokens=(20, 256, 4096)).fit(engine)  # type: ignore[arg-type]
    assert grid.prefill_tokens == (16, 64, 128)
    assert grid.cached == ((96, 32), (432, 64))  # whole blocks; a prefix too long for the model cut to fit
    assert grid.batches == (1, 4, 8)
    assert grid.contexts[0] == 64 and 448 <= grid.contexts[1] < 512 and grid.contexts[1] % 16 == 0
    assert grid.transfer_tokens == (16, 256, 320)  # 4096 tokens: cut to the pool's 320


def test_decode_batches_stop_where_the_kv_pool_runs_out(model_dir: Path) -> None:
    """A batch whose rows the pool cannot hold is not measured (it would preempt), and the profile says so."""
    engine = build_engine(EngineConfig(model=str(model_dir), num_kv_blocks=128, max_num_batched_tokens=256), 1)
    grid = Grid(prefill_tokens=(16, 32, 64), cached=(), batches=(1, 4, 16), contexts=(64, 256), transfer_tokens=(16,),
                repeats=1, decode_steps=1)
    p = profile_engine(engine, grid, Transport.ZMQ, 1, progress=lambda msg: None)
    assert [(d.batch, d.context) for d in p.decode] == [(1, 64), (4, 64), (16, 64), (1, 256), (4, 256)]
    assert any("decode batch 16 at context 256" in why for why in p.notes["skipped"])


def test_a_grid_that_cannot_make_a_profile_is_refused_before_anything_is_measured(model_dir: Path) -> None:
    """A profile needs >= 3 prefill and >= 3 decode points. A grid fitted to fewer (one prompt
    length; lengths the step budget folds into one; 1 batch x 2 contexts) was measured whole,
    minutes on a real model, and only then refused: every measurement lost."""
    engine = build_engine(EngineConfig(model=str(model_dir), num_kv_blocks=128, max_num_batched_tokens=256), 1)
    small = Grid(prefill_tokens=(16, 32, 64), cached=(), batches=(1, 4, 16), contexts=(64,), transfer_tokens=(16,),
                 repeats=1, decode_steps=1)
    for grid, flags in ((dataclasses.replace(small, prefill_tokens=(16,)), "--prefill-tokens"),
                        (dataclasses.replace(small, prefill_tokens=(300, 400, 500)), "--prefill-tokens"),
                        (dataclasses.replace(small, batches=(1,), contexts=(64, 128)), "--batches")):
        said: list[str] = []
        with pytest.raises(ValueError, match=f"needs >= 3 .*{flags}"):
            profile_engine(engine, grid, Transport.ZMQ, 1, progress=said.append)
        assert said == [], f"measured before refusing: {said}"


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="torch.distributed with gloo")
def test_cli_quick_with_speculation_and_the_nccl_transport(model_dir: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "p.json"
    assert main(["profile", "--model", str(model_dir), "--quick", "--out", str(out), "--num-kv-blocks", "512",
                 "--torch-threads", "1", "--speculative", "ngram", "--transport", "nccl"]) == 0
    p = Profile.load(out)
    assert p.transport == "nccl" and p.engine.torch_threads == 1 and p.model["name"] == model_dir.name
    assert len(p.prefill) == 4 and len(p.decode) == 6 and len(p.transfer) == 3
    assert p.speculative is not None and p.speculative.method == "ngram" and p.speculative.num_speculative_tokens == 4
    assert 0.0 <= p.speculative.acceptance_rate <= 1.0 and p.speculative.tokens_per_step >= 1.0
    assert p.notes["spec_max_batch_size"] == 2  # the batches whose decode steps verify drafts
    printed = capsys.readouterr()
    assert "fitted: prefill_s" in printed.out and "[profile" in printed.err
