"""Tensor parallelism's edges (workers/tp_group.py, workers/model/tensor_parallel.py): what the
host does with the gathered logits (chunked prefill, prefix caching, preemption, n > 1,
penalties, logit_bias, grammars, draft speculation) gives under two ranks what one rank gives;
bad sizes are refused by name; a follower that fails mid-step fails the engine, not hangs it;
no follower outlives its engine."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from factories import tiny_spec

from pdserve import LLM, SamplingParams
from pdserve.workers.tiny.builder import Arch, TinyModelSpec
from pdserve.workers.tp_group import TPGroupError

GQA = tiny_spec(Arch.LLAMA, hidden_size=128, num_heads=4, num_kv_heads=2, vocab_size=1001)
QWEN_ONE_KV = tiny_spec(Arch.QWEN2, hidden_size=128, num_heads=4, num_kv_heads=1, init_std=0.1, vocab_size=999)


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of process `pid` from /proc; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rfind(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1])


def _children() -> set[int]:
    """This process's descendants."""
    parents = {int(d): s[1] for d in os.listdir("/proc") if d.isdigit() and (s := _stat(int(d))) is not None}
    out: set[int] = set()
    frontier = {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - out
        out |= frontier
    return out


def _gone(pids: list[int], within_s: float) -> bool:
    """Whether every process of `pids` exited (a zombie counts as exited) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if all((s := _stat(p)) is None or s[0] == "Z" for p in pids):
            return True
        time.sleep(0.1)
    return False


def _tokens(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params)]


def test_host_features_under_two_ranks_give_one_ranks_tokens(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """Chunked prefill (prompts past max_num_batched_tokens), prefix caching (a shared prefix),
    preemption (a small KV pool), n > 1, penalties, logit_bias and top-k on tokens of the last
    vocabulary shard, a grammar: the tokens one rank gives."""
    model_dir = str(make_model(GQA))
    prefix = list(range(10, 90))
    prompts = [prefix + [5, 6, 7], prefix + [8, 9], list(range(100, 300)), [3, 4, 5]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, presence_penalty=0.5,
                       frequency_penalty=0.3, repetition_penalty=1.2),
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logit_bias={990: 8.0, 700: 5.0}),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9, n=2, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=10, structured_outputs={"choice": ["alpha", "beta gamma"]}),
    ]
    kw: dict[str, Any] = dict(dtype="float32", num_kv_blocks=20, block_size=16, max_model_len=320,
                              max_num_batched_tokens=64, enable_prefix_caching=True, progress=False)
    want = _tokens(LLM(model_dir, **kw), prompts, params)
    llm = LLM(model_dir, tensor_parallel_size=2, **kw)
    try:
        got = _tokens(llm, prompts, params)
        stats = llm.engine.stats  # what the step covered: recomputes, a cached prefix
        assert stats.preemptions > 0 and stats.prompt_tokens_computed < stats.prompt_tokens
    finally:
        llm.close()
    assert got == want


def test_draft_model_speculation_under_two_ranks(make_model: Callable[[TinyModelSpec], Path]) -> None:
    model_dir = str(make_model(GQA))
    draft_dir = str(make_model(tiny_spec(Arch.LLAMA, hidden_size=64, num_heads=2, num_kv_heads=1, vocab_size=1001,
                                         num_layers=1)))
    prompts = [[5, 9, 33, 70, 2, 41] * 10, [7, 8, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    kw: dict[str, Any] = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False,
                              speculative="draft", draft_model=draft_dir, num_speculative_tokens=3)
    want = _tokens(LLM(model_dir, **kw), prompts, [params] * 2)
    llm = LLM(model_dir, tensor_parallel_size=2, **kw)
    try:
        got = _tokens(llm, prompts, [params] * 2)
        assert llm.engine.stats.spec_drafts > 0  # verification steps ran on both ranks
    finally:
        llm.close()
    assert got == want


def test_four_ranks_with_one_replicated_kv_head_and_biases(make_model: Callable[[TinyModelSpec], Path]) -> None:
    model_dir = str(make_model(QWEN_ONE_KV))
    prompts = [list(range(5, 60)), [11, 12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=3)
    kw: dict[str, Any] = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False)
    want = LLM(model_dir, **kw).generate(prompts, params)
    llm = LLM(model_dir, tensor_parallel_size=4, **kw)
    try:
        got = llm.generate(prompts, params)
    finally:
        llm.close()
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for gs, ws in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or []):
            assert gs.keys() == ws.keys()
            assert max(abs(float(gs[t]) - float(ws[t])) for t in ws) < 1e-4


@pytest.mark.parametrize("size, match", [(0, "tensor_parallel_size"), (-1, "tensor_parallel_size"),
                                         (3, "attention heads"), (8, "attention heads")])
def test_a_bad_tensor_parallel_size_is_refused_by_name_and_starts_nothing(
        size: int, match: str, make_model: Callable[[TinyModelSpec], Path]) -> None:
    model_dir = str(make_model(GQA))
    before = _children()
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False,
            tensor_parallel_size=size)
    assert _children() <= before


def test_a_follower_that_raises_mid_step_fails_the_engine_in_time(
        make_model: Callable[[TinyModelSpec], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower whose forward raises (its own fault: an OOM, a bad kernel) exits; rank 0's step
    fails as the group's within seconds, later steps too, and close() leaves no follower."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import os
        if os.environ.get("PDSERVE_TEST_FAIL_AT"):
            import pdserve.workers.model.llama as llama
            calls = {"n": 0}
            real = llama.LlamaForCausalLM.compute_logits
            def compute_logits(self, hidden):
                calls["n"] += 1
                if calls["n"] >= int(os.environ["PDSERVE_TEST_FAIL_AT"]) and self.tp.rank == 1:
                    raise RuntimeError("injected follower fault")
                return real(self, hidden)
            llama.LlamaForCausalLM.compute_logits = compute_logits
    """))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("PDSERVE_TEST_FAIL_AT", "4")
    model_dir = str(make_model(GQA))
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False,
              tensor_parallel_size=2)
    group = llm.engine.tp_group
    assert group is not None
    pids = [p.pid for p in group.procs]
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, ignore_eos=True))
        start = time.monotonic()
        with pytest.raises(TPGroupError):
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=8, ignore_eos=True))
        assert time.monotonic() - start < 30
        with pytest.raises(TPGroupError, match="broken"):
            llm.generate([[5, 6]], SamplingParams(max_tokens=1))
    finally:
        llm.close()
    assert _gone(pids, 5)


def test_an_engine_dropped_without_close_leaves_no_follower(make_model: Callable[[TinyModelSpec], Path]) -> None:
    import gc

    llm = LLM(str(make_model(GQA)), dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False,
              tensor_parallel_size=2)
    group = llm.engine.tp_group
    assert group is not None
    pids = [p.pid for p in group.procs]
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    del llm, group
    gc.collect()
    assert _gone(pids, 15)
    llm2 = LLM(str(make_model(GQA)), dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False,
               tensor_parallel_size=2)  # the group was left: another may start
    llm2.close()


def test_followers_of_a_rank_0_killed_outright_exit(make_model: Callable[[TinyModelSpec], Path],
                                                    tmp_path: Path) -> None:
    model_dir = str(make_model(GQA))
    script = tmp_path / "rank0.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        from pdserve import LLM, SamplingParams
        llm = LLM({model_dir!r}, dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False,
                  tensor_parallel_size=2)
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
        print(" ".join(str(p.pid) for p in llm.engine.tp_group.procs), flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            cwd=str(Path(__file__).resolve().parents[2]))
    pids: list[int] = []
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        pids = [int(x) for x in line.split()]
        assert pids, "rank 0 printed no follower pids"
        proc.kill()
        proc.wait(10)
        assert _gone(pids, 10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        for pid in pids:  # ours (the script's followers): by pid, if the test failed
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass


@pytest.mark.parametrize("pool_tp, want", [({"decode_tp": 1}, ("decode", 1)), ({"prefill_tp": 1}, ("prefill", 1)),
                                           ({}, ("decode", 2))])
def test_a_pool_of_one_rank_under_a_cluster_wide_size_runs_one_rank(pool_tp: dict[str, int],
                                                                    want: tuple[str, int]) -> None:
    """--tensor-parallel-size 2 --decode-tp 1: the decode workers' engines ran two ranks anyway
    (the pool's size of 1 returned the cluster's engine config as it was, size 2 in it)."""
    from pdserve.cluster.placement import WorkerShare
    from pdserve.cluster.serve_config import serve_config
    from pdserve.cluster.worker_start import pool_engine

    cfg = serve_config({"model": "tiny", "tensor_parallel_size": 2, **pool_tp})
    pool, size = want
    engine, _ = pool_engine(cfg.engine, WorkerShare(options={"num_cpus": 2}, threads=4), cfg.pool_tp(pool))
    assert engine.tensor_parallel_size == size == cfg.pool_tp(pool)


_gloo_oracle: list[Any] = []  # the single-rank outputs both cases below compare with: computed once


@pytest.mark.parametrize("eager", [True, False])
def test_ranks_without_shared_memory_reduce_through_gloo_alike(
        eager: bool, make_model: Callable[[TinyModelSpec], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """No shared memory (not x86-64, or a container's small /dev/shm): every collective goes through
    gloo, eager and compiled, and the tokens and logprobs are one rank's."""
    from pdserve.workers.model import shm_collectives

    model_dir = str(make_model(GQA))
    prompts = [list(range(5, 60)), [11, 12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    kw: dict[str, Any] = dict(dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False)
    if not _gloo_oracle:
        _gloo_oracle.extend(LLM(model_dir, **kw).generate(prompts, params))
    want = _gloo_oracle
    monkeypatch.setattr(shm_collectives, "supported", lambda: False)
    llm = LLM(model_dir, tensor_parallel_size=2, enforce_eager=eager, **kw)
    try:
        group = llm.engine.tp_group
        assert group is not None and group.tp.shm is None
        got = llm.generate(prompts, params)
    finally:
        llm.close()
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        for gs, ws in zip(g.outputs[0].logprobs or [], w.outputs[0].logprobs or []):
            assert max(abs(float(gs[t]) - float(ws[t])) for t in ws) < 1e-4


def test_a_bad_row_after_the_steps_collectives_fails_alone_under_two_ranks(
        make_model: Callable[[TinyModelSpec], Path]) -> None:
    """A request whose sampling raises (top_k past int64, slipped past validation: issue 46's
    case) fails alone on one rank and the engine goes on. Under two ranks it raised after every
    collective of the step was done (the followers waited for the next step, in step), yet the
    group was marked broken: one bad request killed the whole worker."""
    model_dir = str(make_model(GQA))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False,
              tensor_parallel_size=2)
    try:
        engine = llm.engine
        engine.add_request("ok", [5, 6, 7, 8], greedy)
        engine.add_request("bad", [9, 10, 11], SamplingParams(temperature=0.8, max_tokens=8, ignore_eos=True))
        object.__setattr__(engine.scheduler.requests["bad"].params, "top_k", 2**63)
        finals: dict[str, Any] = {}
        for _ in range(50):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
        assert finals["bad"].error and finals["ok"].error is None
        assert engine.tp_group is not None and engine.tp_group.broken is None
        again = llm.generate([[5, 6, 7, 8]], greedy)[0].outputs[0].token_ids
        assert again == finals["ok"].outputs[0].token_ids
    finally:
        llm.close()


def test_an_async_engine_closed_mid_step_still_stops_its_followers(
        make_model: Callable[[TinyModelSpec], Path]) -> None:
    """AsyncEngine.close() waits `timeout_s` for the engine thread; a step longer than that (a
    long prefill on CPU) left the engine unclosed: its followers ran on, and the process's one
    tensor-parallel group stayed taken (the next TP engine here was refused)."""
    from factories import slow_steps

    from pdserve.workers.async_engine import AsyncEngine
    from pdserve.workers.tp_group import tp_group_running

    llm = LLM(str(make_model(GQA)), dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False,
              tensor_parallel_size=2)
    group = llm.engine.tp_group
    assert group is not None
    pids = [p.pid for p in group.procs]
    llm.engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=50, ignore_eos=True))
    slow_steps(llm.engine, 1.5)
    engine = AsyncEngine(llm.engine).start()
    try:
        time.sleep(0.5)  # the engine thread is in a step
        engine.close(timeout_s=0.1)
        engine._thread.join(30)
        assert not engine._thread.is_alive()
        assert _gone(pids, 10) and not tp_group_running()
    finally:
        llm.close()


def test_a_follower_that_fails_to_load_fails_the_engines_start_in_time(
        make_model: Callable[[TinyModelSpec], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A follower that raises loading its shard (a missing file, no memory) after it joined: the
    engine's start fails within seconds, naming the rank, and nothing is left running."""
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent("""
        import os
        if os.environ.get("PDSERVE_TEST_FAIL_LOAD"):
            import pdserve.workers.model.loader as loader  # before the follower imports its load_model
            def load_model(*args, **kwargs):
                raise RuntimeError("injected load fault")
            loader.load_model = load_model
    """))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    monkeypatch.setenv("PDSERVE_TEST_FAIL_LOAD", "1")
    model_dir = str(make_model(GQA))
    before = _children()
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        LLM(model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256, progress=False, tensor_parallel_size=2)
    assert time.monotonic() - start < 60
    assert _gone(list(_children() - before), 5)


def test_a_context_the_plan_lowers_is_every_ranks_context(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """A KV pool that cannot hold the model's own context (2,048 positions): two ranks serve the
    largest that fits (the plan tells the follower, whose runner follows it) and give one rank's
    tokens."""
    model_dir = str(make_model(GQA))
    kw: dict[str, Any] = dict(dtype="float32", num_kv_blocks=24, max_num_batched_tokens=512, progress=False)
    prompts = [list(range(5, 300)), [11, 12, 13]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model_dir, enforce_eager=True, **kw).generate(prompts, params)]
    llm = LLM(model_dir, tensor_parallel_size=2, enforce_eager=True, **kw)
    try:
        assert llm.engine.max_model_len == 24 * 16 < 512
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
    finally:
        llm.close()


def test_prompt_logprobs_of_a_chunked_prompt_under_two_ranks(make_model: Callable[[TinyModelSpec], Path]) -> None:
    """A prompt five times max_num_batched_tokens: its middle chunks sample nothing (prompt rows
    only), the last samples too; every prompt token's full-vocabulary logprob is one rank's."""
    model_dir = str(make_model(GQA))
    prompt = list(range(3, 323))
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=3, logprobs=3)
    kw: dict[str, Any] = dict(dtype="float32", num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=64,
                              progress=False)
    want = LLM(model_dir, **kw).generate([prompt, [7, 8]], params)
    llm = LLM(model_dir, tensor_parallel_size=2, **kw)
    try:
        got = llm.generate([prompt, [7, 8]], params)
    finally:
        llm.close()
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.prompt_logprobs is not None and w.prompt_logprobs is not None
        assert len(g.prompt_logprobs) == len(w.prompt_logprobs)
        for gp, wp in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            assert gp.keys() == wp.keys()
            assert max(abs(float(getattr(gp[t], "logprob", gp[t])) - float(getattr(wp[t], "logprob", wp[t])))
                       for t in wp) < 1e-4
