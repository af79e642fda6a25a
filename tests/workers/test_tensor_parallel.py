"""Tensor parallelism (workers/model/tensor_parallel.py): a model split over ranks gives the
tokens and logits of the whole model, on gloo across processes, and every rank the same."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from factories import tiny_spec
from spawned_ranks import spawn_ranks

from pdserve import LLM, SamplingParams
from pdserve.workers.model.config import ModelConfig
from pdserve.workers.model.tensor_parallel import TensorParallel, check_shardable, shard_config, shard_tensor
from pdserve.workers.tiny.builder import Arch, TinyModelSpec
from pdserve.workers.tp_group import TPGroupError

CASES = {
    "llama-gqa": tiny_spec(Arch.LLAMA, hidden_size=128, num_heads=4, num_kv_heads=2),
    # Qwen2: q/k/v biases, tied embeddings (the one vocab-parallel matrix is both).
    "qwen2-bias-tied": tiny_spec(Arch.QWEN2, hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.1),
    # Qwen3: per-head q/k norms (whole on every rank), tied embeddings.
    "qwen3-qk-norm": tiny_spec(Arch.QWEN3, hidden_size=128, num_heads=4, num_kv_heads=2, init_std=0.1),
    # One KV head for two ranks: replicated. A vocabulary two ranks do not divide: padded.
    "llama-one-kv-head-odd-vocab": tiny_spec(Arch.LLAMA, hidden_size=128, num_heads=4, num_kv_heads=1,
                                             vocab_size=1001),
}
_TIMEOUT_S = 240


def _params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
    # Unseeded sampling: the ranks draw alike only because their logits and RNG states are the same.
    drawn = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=24, ignore_eos=True)
    return [greedy, greedy, drawn]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (7, 61, 33)]


def _generate(llm: LLM) -> list[tuple[list[int], list[dict[int, float]] | None]]:
    vocab = llm.engine.model_config.vocab_size
    outs = llm.generate(_prompts(vocab), _params())
    return [(list(o.outputs[0].token_ids),
             [{t: float(lp) for t, lp in d.items()} for d in o.outputs[0].logprobs] if o.outputs[0].logprobs else None)
            for o in outs]


def _rank(rank: int, port: int, results: Any, size: int, model_dir: str, eager: bool) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size)
    try:
        llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False,
                  tensor_parallel_size=size, enforce_eager=eager)
        compiled = llm.engine.runner.forward is not llm.engine.model
        results.put((rank, (llm.engine.model_config.num_heads, llm.engine.model_config.num_kv_heads, compiled),
                     _generate(llm)))
    finally:
        dist.destroy_process_group()


def run_ranks(model_dir: Path, size: int, eager: bool = True) -> dict[int, tuple[Any, ...]]:
    """Each rank's ((query heads, KV heads, compiled), outputs), the ranks in processes of their own."""
    return spawn_ranks(_rank, size, _TIMEOUT_S, size, str(model_dir), eager)


def _check_parity(got: list[Any], whole: list[Any]) -> None:
    """Greedy requests: the whole model's tokens, top-5 logprobs within 1e-4."""
    for (tokens, lps), (want_tokens, want_lps) in list(zip(got, whole))[:2]:
        assert tokens == want_tokens
        assert lps is not None and want_lps is not None
        for got_step, want_step in zip(lps, want_lps):
            assert got_step.keys() == want_step.keys()
            assert max(abs(got_step[t] - want_step[t]) for t in want_step) < 1e-4


_wholes: dict[str, list[Any]] = {}


def _whole(model_dir: Path) -> list[Any]:
    """The single-rank engine's outputs (the oracle), once per model: the same engine, prompts and
    sampling parameters give the same outputs (the drawn request is never compared)."""
    if str(model_dir) not in _wholes:
        _wholes[str(model_dir)] = _generate(LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256,
                                                progress=False))
    return _wholes[str(model_dir)]


def _check_two_ranks(llm: LLM, model_dir: Path, eager: bool) -> None:
    """`llm` (two ranks) holds its shard of the heads, runs compiled unless `eager`, gives the whole
    model's outputs with one broadcast a step, and close() leaves no second rank."""
    try:
        cfg = ModelConfig.from_pretrained(model_dir)
        local = llm.engine.model_config
        assert (local.num_heads, local.num_kv_heads) == (cfg.num_heads // 2, max(cfg.num_kv_heads // 2, 1))
        assert (llm.engine.runner.forward is not llm.engine.model) is not eager
        _check_parity(_generate(llm), _whole(model_dir))
        group = llm.engine.tp_group
        assert group is not None and group.messages == group.steps > 0  # one broadcast a step beyond the model's
    finally:
        llm.close()
    assert all(p.poll() is not None for p in group.procs)  # the second rank is gone


# llama-gqa eager: test_an_engine_that_fails_to_start_stops_its_ranks's second engine, checked alike
# (one engine start less for the suite).
@pytest.mark.parametrize("case, eager", [(c, True) for c in CASES if c != "llama-gqa"] + [("llama-gqa", False)])
def test_an_engine_with_two_ranks_gives_the_whole_models_tokens_and_logprobs(
        case: str, eager: bool, make_model: Callable[[TinyModelSpec], Path]) -> None:
    """One process asks for two ranks; the engine starts the second and runs every step's forward
    on both, eager and compiled (the all-reduces inside the graph, the warm-up mirrored)."""
    model_dir = make_model(CASES[case])
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False,
              tensor_parallel_size=2, enforce_eager=eager)
    _check_two_ranks(llm, model_dir, eager)


def test_torchrun_ranks_each_run_the_engine_and_agree(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """Under torchrun (torch.distributed initialised by the caller) every rank runs the whole
    engine on the same requests: the same outputs on each, the drawn request's too."""
    model_dir = make_model(CASES["llama-gqa"])
    ranks = run_ranks(model_dir, 2)
    assert ranks[0][1] == ranks[1][1]
    _check_parity(ranks[0][1], _whole(model_dir))


def test_prompt_logprobs_and_ngram_speculation_across_ranks(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """Prompt logprobs over more rows than one logits call takes, and n-gram drafts verified
    (k+1 rows a request): the same calls on both ranks, the whole model's answers."""
    model_dir = make_model(CASES["qwen2-bias-tied"])
    prompt = [5, 9, 33, 70, 2, 41] * 50  # 300 tokens, repetitive: n-gram drafts are accepted
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logprobs=2)]
    prompts = [prompt, prompt[:40]]
    spec = dict(speculative="ngram", num_speculative_tokens=3)
    want = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=512, progress=False,
               **spec).generate(prompts, params)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=512, progress=False,
              tensor_parallel_size=2, **spec)
    try:
        got = llm.generate(prompts, params)
        assert llm.engine.stats.spec_accepted_tokens > 0
    finally:
        llm.close()
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert got[0].prompt_logprobs is not None and want[0].prompt_logprobs is not None
    assert len(got[0].prompt_logprobs) == len(prompt)
    for g_pos, w_pos in zip(got[0].prompt_logprobs[1:], want[0].prompt_logprobs[1:]):
        assert g_pos.keys() == w_pos.keys()
        assert max(abs(_lp(g_pos[t]) - _lp(w_pos[t])) for t in w_pos) < 1e-4


def _lp(x: Any) -> float:
    return float(getattr(x, "logprob", x))


def test_a_rank_that_dies_fails_the_engines_step_not_hangs_it(make_model: Callable[[TinyModelSpec], Path],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Also: the port the ranks meet on is held by rank 0 before any follower is told it (a
    port probed free and bound later was once taken in between: EADDRINUSE, a refused start)."""
    import json
    import subprocess

    from pdserve.workers import tp_group

    taken: list[bool] = []
    real_popen = subprocess.Popen  # the module is shared: patching it patches it everywhere

    def popen(args: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", int(json.loads(args[-1])["store_port"])))
                taken.append(False)
            except OSError:
                taken.append(True)
        return real_popen(args, **kwargs)

    monkeypatch.setattr(tp_group.subprocess, "Popen", popen)
    model_dir = make_model(CASES["llama-gqa"])
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False,
              tensor_parallel_size=2)
    try:
        group = llm.engine.tp_group
        assert group is not None and taken == [True]
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        group.procs[0].kill()
        group.procs[0].wait(10)
        with pytest.raises(TPGroupError, match="Connection closed by peer"):
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
        with pytest.raises(TPGroupError, match="broken"):  # and every step after
            llm.generate([[5, 6]], SamplingParams(max_tokens=1))
    finally:
        llm.close()


@pytest.mark.parametrize("when", ["between-steps", "as-inputs-go"])
def test_a_rank_that_is_stopped_fails_the_step_within_its_grace(make_model: Callable[[TinyModelSpec], Path],
                                                                 monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    """A follower stopped (SIGSTOP), not dead: rank 0 waited in the shared-memory all-reduce for
    the collectives' 10-minute deadline, and every request on the worker with it; or, stopped as
    a step's inputs went out, in gloo's broadcast for the group's 120 s (CI caught that one)."""
    import os
    import signal
    import time

    from pdserve.workers import tp_group

    monkeypatch.setattr(tp_group, "STOPPED_GRACE_S", 1.0)
    llm = LLM(str(make_model(CASES["llama-gqa"])), dtype="float32", num_kv_blocks=64, max_model_len=256,
              progress=False, tensor_parallel_size=2)
    group = llm.engine.tp_group
    assert group is not None
    follower = group.procs[0]
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        if group.tp.shm is None:
            pytest.skip("no shared-memory collectives here (gloo's own timeout applies)")
        if when == "between-steps":
            os.kill(follower.pid, signal.SIGSTOP)
        else:
            send = group.send_step

            def stop_then_send(inputs: object) -> None:
                os.kill(follower.pid, signal.SIGSTOP)
                send(inputs)  # type: ignore[arg-type]

            monkeypatch.setattr(group, "send_step", stop_then_send)
        t0 = time.monotonic()
        with pytest.raises(TPGroupError, match="are gone"):
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
        assert time.monotonic() - t0 < 30
    finally:
        follower.kill()  # ours: stopped, it would not take a stop message (killed already: nothing)
        follower.wait(10)
        llm.close()


def test_shards_put_back_together_are_the_checkpoint() -> None:
    """Column-parallel rows, row-parallel columns and vocab rows of every rank, concatenated,
    are the whole tensor (KV heads: replicated, each rank the head its query heads read)."""
    cfg = ModelConfig("llama", vocab_size=1001, hidden_size=16, intermediate_size=12, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6, max_position_embeddings=64,
                      tie_word_embeddings=False, attention_bias=True)
    full = {
        "model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16),
        "model.layers.0.self_attn.q_proj.bias": torch.randn(16),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(8, 16),
        "model.layers.0.self_attn.o_proj.weight": torch.randn(16, 16),
        "model.layers.0.self_attn.o_proj.bias": torch.randn(16),
        "model.layers.0.self_attn.q_norm.weight": torch.randn(4),
        "model.layers.0.mlp.up_proj.weight": torch.randn(12, 16),
        "model.layers.0.mlp.down_proj.weight": torch.randn(16, 12),
        "model.layers.0.mlp.gate_proj.bias": torch.randn(12),
        "model.layers.0.mlp.down_proj.bias": torch.randn(16),
        "model.embed_tokens.weight": torch.randn(1001, 16),
        "model.norm.weight": torch.randn(16),
    }
    for size in (2, 4):
        tps = [TensorParallel(size, r) for r in range(size)]
        for name, t in full.items():
            parts = [shard_tensor(name, t, cfg, tp) for tp in tps]
            if name.endswith("norm.weight"):  # replicated: each rank the whole
                assert all(torch.equal(p, t) for p in parts)
                continue
            if name.endswith(("o_proj.bias", "down_proj.bias")):  # added after the all-reduce's sum: once, by rank 0
                assert torch.equal(parts[0], t) and not any(p.any() for p in parts[1:])
                continue
            if name.endswith("k_proj.weight") and size == 4:  # 2 KV heads, 4 ranks: head r * 2 // 4
                assert all(torch.equal(p, t[(r * 2 // 4) * 4 : (r * 2 // 4 + 1) * 4]) for r, p in enumerate(parts))
                continue
            dim = 1 if name.endswith(("o_proj.weight", "down_proj.weight")) else 0
            joined = torch.cat(parts, dim=dim)
            if name == "model.embed_tokens.weight":
                assert joined.shape[0] == -(-1001 // size) * size and not joined[1001:].any()
                joined = joined[:1001]
            assert torch.equal(joined, t), name
        local = shard_config(cfg, tps[0])
        assert (local.num_heads, local.num_kv_heads, local.intermediate_size) == (4 // size, max(2 // size, 1),
                                                                                  12 // size)


@pytest.mark.parametrize("change, match", [({"num_heads": 6, "num_kv_heads": 2}, "attention heads"),
                                           ({"num_heads": 8, "num_kv_heads": 8}, None),
                                           ({"intermediate_size": 10}, "intermediate size"),
                                           ({"quantization": "fp8"}, "fp8 checkpoint")])
def test_a_model_that_does_not_split_is_refused_by_name(change: dict[str, Any], match: str | None) -> None:
    fields: dict[str, Any] = dict(arch="llama", vocab_size=512, hidden_size=16, intermediate_size=12, num_layers=1,
                                  num_heads=4, num_kv_heads=2, head_dim=4, rms_norm_eps=1e-6,
                                  max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False)
    cfg = ModelConfig(**{**fields, **change})
    if match is None:
        check_shardable(cfg, 4)
    else:
        with pytest.raises(ValueError, match=match):
            check_shardable(cfg, 4)


def test_more_than_one_rank_without_a_process_group_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="init_process_group"):
        TensorParallel.from_world(2)


def test_a_served_cluster_takes_a_tensor_parallel_size_per_pool() -> None:
    """--prefill-tp / --decode-tp by pool, --tensor-parallel-size for both; what cannot be served
    yet (ranks that lend cores or take turns, per-pool sizes in a colocated cluster) is refused by
    name before any worker starts."""
    from pdserve.cluster.serve_config import serve_config

    cfg = serve_config({"model": "tiny", "prefill_tp": 2})
    assert (cfg.pool_tp("prefill"), cfg.pool_tp("decode")) == (2, 1)
    cfg = serve_config({"model": "tiny", "tensor_parallel_size": 2, "decode_tp": 1})
    assert (cfg.pool_tp("prefill"), cfg.pool_tp("decode")) == (2, 1)
    assert serve_config({"model": "tiny", "mode": "colocated", "tensor_parallel_size": 2}).pool_tp("worker") == 2
    # GPU ranks (NCCL; untested on GPUs), colocated and per pool.
    assert serve_config({"model": "tiny", "mode": "colocated", "tensor_parallel_size": 2,
                         "device": "cuda"}).pool_tp("worker") == 2
    assert serve_config({"model": "tiny", "prefill_tp": 2, "device": "cuda"}).pool_tp("prefill") == 2
    for bad, match in (({"mode": "colocated", "decode_tp": 2}, "decode_tp: disaggregated mode only"),
                       ({"decode_tp": 2, "cpu_sharing": "turns"}, "cpu_sharing"),
                       ({"decode_tp": 0}, "decode_tp")):
        with pytest.raises(ValueError, match=match):
            serve_config({"model": "tiny", **bad})


def test_shared_memory_collectives_sum_and_gather_alike_on_every_rank() -> None:
    """Three ranks (threads here, one mapping each): the float64 sum, the same bits on every
    rank, round after round (each reuses the slots); the shards side by side; a rank that never
    comes fails the round at its deadline, naming it."""
    import threading

    from pdserve.workers.model import shm_collectives
    from pdserve.workers.model.shm_collectives import ShmCollectiveError, ShmCollectives

    size, slot = 3, 4096
    path = shm_collectives.create(size, slot)
    try:
        ranks = [ShmCollectives(path, size, r, slot) for r in range(size)]
        inputs = [[torch.randn(5, 7, generator=torch.Generator().manual_seed(10 * k + r)) for r in range(size)]
                  for k in range(20)]
        sums: dict[int, list[torch.Tensor]] = {r: [] for r in range(size)}
        gathers: dict[int, torch.Tensor] = {}

        def run(r: int) -> None:
            for k in range(20):
                sums[r].append(ranks[r].all_reduce(inputs[k][r].clone()))
            gathers[r] = ranks[r].all_gather(torch.full((2, 3), float(r)))

        threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        for k in range(20):
            want = sum(x.double() for x in inputs[k])
            assert torch.allclose(sums[0][k].double(), want, atol=1e-5)
            assert all(torch.equal(sums[r][k], sums[0][k]) for r in range(size))
        assert all(torch.equal(gathers[r], torch.arange(3.0).repeat_interleave(3).expand(2, 9)) for r in range(size))
        assert not ranks[0].fits(torch.zeros(slot // 4 + 1))

        lonely = ShmCollectives(path, size, 0, slot, round_timeout_s=0.2)
        lonely.round = ranks[0].round
        with pytest.raises(ShmCollectiveError, match=r"rank\(s\) \[1, 2\]"):
            lonely.all_reduce(torch.ones(4))
    finally:
        os.unlink(path)


def test_pdserve_generate_with_two_ranks_prints_what_one_rank_prints(make_model: Callable[[TinyModelSpec], Path],
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from pdserve.cluster.cli import main

    model_dir = make_model(CASES["llama-gqa"])
    texts = []
    for tp in ("1", "2"):
        assert main(["generate", "Once upon a time", "--model", str(model_dir), "--dtype", "float32",
                     "--max-tokens", "16", "-tp", tp]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and "16 tokens" in texts[0]


def test_a_step_that_fails_part_way_breaks_the_group_and_close_kills_the_ranks(
        make_model: Callable[[TinyModelSpec], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 raises after the forward, before the logits' gather: rank 1 is left waiting in it.
    The step fails as the group's, and close() kills rank 1 at once rather than telling it to stop."""
    import time

    model_dir = make_model(CASES["llama-gqa"])
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False,
              tensor_parallel_size=2)
    group = llm.engine.tp_group
    assert group is not None

    def boom(*args: object) -> object:
        raise RuntimeError("injected")

    monkeypatch.setattr(llm.engine.runner, "_fill_masks", boom)
    try:
        with pytest.raises(TPGroupError, match="injected"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        start = time.monotonic()
        llm.close()
    assert time.monotonic() - start < 15 and all(p.poll() is not None for p in group.procs)


def test_an_engine_that_fails_to_start_stops_its_ranks(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """The KV plan refuses (too few blocks for one sequence) after rank 1 started: it is stopped
    and the group left, so the next engine starts its own, on shared-memory collectives, and
    gives the whole model's outputs (the llama-gqa eager case of the parity test above)."""
    model_dir = make_model(CASES["llama-gqa"])
    with pytest.raises(ValueError, match="num_kv_blocks"):
        LLM(str(model_dir), dtype="float32", num_kv_blocks=1, max_model_len=256, progress=False,
            tensor_parallel_size=2)
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False,
              tensor_parallel_size=2, enforce_eager=True)
    try:
        assert llm.engine.tp_group is not None and llm.engine.tp_group.tp.shm is not None
    except BaseException:
        llm.close()
        raise
    _check_two_ranks(llm, model_dir, eager=True)


def test_no_room_in_dev_shm_means_gloo_not_a_crash(monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    from pdserve.workers.model import shm_collectives

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    before = set(os.listdir("/dev/shm"))
    monkeypatch.setattr(os, "posix_fallocate", full)
    assert shm_collectives.create(2, 1 << 20) is None
    assert set(os.listdir("/dev/shm")) == before  # nothing left behind


@pytest.mark.parametrize("tokens", [8, 2000])
def test_step_inputs_survive_their_messages_inline_or_in_two(tokens: int) -> None:
    """A decode-sized step fits the first message; a 2,000-token prefill takes a second. What a
    follower unpacks is what rank 0 packed, whatever an earlier, larger step left in the buffer."""
    from pdserve.workers.tp_group import HEADER, INLINE, StepInputs, needs_second, pack_step, unpack_step

    g = torch.Generator().manual_seed(tokens)
    seqs = 4
    step = StepInputs(torch.randint(0, 4096, (tokens,), generator=g), torch.arange(tokens),
                      torch.randint(0, 9999, (tokens,), generator=g),
                      torch.randint(0, 500, (seqs, 7), generator=g, dtype=torch.int32),
                      torch.tensor([9, 40, 3, 101], dtype=torch.int32),
                      torch.tensor([0, 1, 2, 3, tokens], dtype=torch.int32),
                      2, torch.tensor([0, 1, tokens - 1]), 2, [1])
    first = torch.full((HEADER + INLINE,), 77, dtype=torch.int64)  # left over from another step
    rest = pack_step(step, first)
    assert (rest is None) == (tokens == 8) and needs_second(first) == (0 if rest is None else rest.numel())
    got = unpack_step(first, rest)
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                 "logits_indices"):
        want, have = getattr(step, name), getattr(got, name)
        assert have.dtype == (torch.int32 if want.dtype == torch.int32 else torch.int64), name
        assert torch.equal(have, want), name
    assert (got.num_decode, got.logit_rows, got.prompt_counts) == (2, 2, [1])


def test_closing_hung_followers_waits_once_for_all_of_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each follower that did not exit got its own wait, in turn: three hung ones took three
    waits (30 s, past a whole stop's budget)."""
    import os
    import signal
    import subprocess
    import time

    from pdserve.workers import tp_group

    monkeypatch.setattr(tp_group, "STOP_WAIT_S", 1.0)
    procs = [subprocess.Popen(["sleep", "300"]) for _ in range(3)]  # ours: stopped and killed by pid
    try:
        for p in procs:
            os.kill(p.pid, signal.SIGSTOP)
        start = time.monotonic()
        tp_group._stop(procs)  # type: ignore[arg-type]
        assert time.monotonic() - start < 2.0 and all(p.poll() is not None for p in procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_shared_memory_files_of_a_rank_0_killed_outright_are_removed(tmp_path: Path) -> None:
    """A rank 0 SIGKILLed (OOM, a worker's restart) unlinks nothing: its collectives' and KV
    files (every rank's cache, GBs of RAM) stayed in /dev/shm until reboot. The next group's
    start removes those whose maker is gone, and no other."""
    import os
    import subprocess

    from pdserve.workers.model import shm_collectives

    gone = subprocess.Popen(["true"])
    gone.wait()
    dead, alive = gone.pid, os.getpid()
    names = [f"pdserve-tp-{dead}-abc", f"pdserve-tpkv-{dead}-0f0f", f"pdserve-tp-{alive}-xyz",
             "pdserve-tp-oldname", "other-file"]
    for name in names:
        (tmp_path / name).write_bytes(b"x")
    removed = shm_collectives.sweep_orphans(str(tmp_path))
    assert sorted(os.path.basename(p) for p in removed) == sorted(names[:2])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])


def test_a_follower_that_dies_starting_fails_the_group_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower OOM-killed importing torch (or crashing) before it joined: rank 0 waited in the
    group's rendezvous for the whole JOIN_TIMEOUT_S (120 s) before the worker's start failed."""
    import subprocess
    import time

    from pdserve.workers import tp_group

    real_popen = subprocess.Popen

    class KilledAtStart(real_popen):  # type: ignore[misc, valid-type]  # the follower, ours, killed at once
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self.kill()

    monkeypatch.setattr(tp_group.subprocess, "Popen", KilledAtStart)
    spec = tp_group.FollowerSpec(model_dir="/nonexistent", dtype="float32", device="cpu", backend="torch",
                                 max_positions=64, quantization=None, kv_cache_dtype="auto", block_size=16,
                                 max_num_batched_tokens=64, seed=0, shm_slot_bytes=0)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 exited"):
        tp_group.TPGroup(2, spec)
    assert time.monotonic() - start < 10
