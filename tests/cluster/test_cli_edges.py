"""The command line's edges: what an operator types that is wrong is refused before
anything starts, in one line naming the flag (exit 2), never with a traceback.

Nothing here starts Ray: `pdserve serve`'s start (preflight, the run) is replaced by a
trap that fails the test if it is reached.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from factories import tiny_spec, with_bos_added

from pdserve.cluster import cli
from pdserve.cluster.cli import build_parser
from pdserve.workers.tiny.builder import TinyModelSpec


@pytest.fixture
def no_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """`pdserve serve` must refuse before it starts anything: reaching the start fails the test."""
    from pdserve.cluster import serve_app, shutdown

    def started(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("pdserve serve started although its settings should have been refused")

    monkeypatch.setattr(serve_app, "preflight", started)
    monkeypatch.setattr(shutdown, "run_until_stopped", started)
    monkeypatch.setattr(shutdown, "serve_in_own_group", started)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """`pdserve ARGV`'s stderr, once it has exited with status 2 (argparse's, and main's for a ValueError)."""
    try:
        status = cli.main(argv)
    except SystemExit as e:  # argparse's own refusals
        status = e.code  # type: ignore[assignment]
    err = capsys.readouterr().err
    assert status == 2, f"exit status {status}, stderr: {err}"
    assert "Traceback" not in err
    return err


# -- --cluster-secret-file -----------------------------------------------------------------


@pytest.mark.parametrize("where", ["missing", "a directory", "too short"])
def test_a_cluster_secret_file_that_cannot_be_used_is_refused_naming_the_flag(
        where: str, tmp_path: Path, no_start: None, capsys: pytest.CaptureFixture[str]) -> None:
    """It escaped main as a FileNotFoundError (IsADirectoryError) traceback, exit 1, or (too
    short) an error naming no flag; the two other key files (--api-key-file,
    --metrics-api-key-file) were one line naming the flag."""
    path = {"missing": tmp_path / "secret", "a directory": tmp_path, "too short": tmp_path / "short"}[where]
    if where == "too short":
        path.write_text("abc\n")
        path.chmod(0o600)
    err = refused(["serve", "--model", "/m", "--cluster-secret-file", str(path)], capsys)
    assert "cluster_secret_file" in err and str(path) in err and len(err.strip().splitlines()) == 1


# -- one setting, one flag of its name ------------------------------------------------------


def serve_parser() -> Any:
    return build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr,index]


def test_every_setting_is_a_flag_of_pdserve_serve_by_its_name() -> None:
    """README ("Flags"): the same settings, by the same names, make a Serve YAML's args. The YAML
    took `metrics_api_key` with no flag of that name (the one exception documented is
    `--no-prefix-caching`, YAML `enable_prefix_caching: false`)."""
    from pdserve.cluster.serve_config import ENGINE_SETTINGS, SERVE_SETTINGS

    options = {o for a in serve_parser()._actions for o in a.option_strings}
    missing = {name for name in ENGINE_SETTINGS | SERVE_SETTINGS.keys()
               if f"--{name.replace('_', '-')}" not in options} - {"enable_prefix_caching"}
    assert missing == set()


def _config(*argv: str) -> dict[str, Any]:
    """The settings `pdserve serve --model /m ARGV` makes (but the cluster secret: made afresh by each)."""
    cfg = cli._serve_config(build_parser().parse_args(["serve", "--model", "/m", *argv]))
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "cluster_secret"}


@pytest.mark.parametrize(("vllm", "ours"), [
    # vLLM refuses tool_choice "auto" without --enable-auto-tool-choice: here auto is always on
    (["--enable-auto-tool-choice", "--tool-call-parser", "hermes"], ["--tool-call-parser", "hermes"]),
    # always so here: prefix caching on, chunked prefill on, no checkpoint code run
    (["--enable-prefix-caching", "--enable-chunked-prefill", "--trust-remote-code"], []),
    (["--no-enable-prefix-caching"], ["--no-prefix-caching"]),
    # vLLM's deprecated spelling of the default (no request log)
    (["--disable-log-requests"], []),
    (["--api-server-count", "3"], ["--gateway-replicas", "3"]),
    (["--enable-prompt-tokens-details"], []),  # usage always names its cached prompt tokens here
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2, '
      '"prompt_lookup_max": 6, "disable_by_batch_size": 8}'],
     ["--speculative", "ngram", "--num-speculative-tokens", "2", "--spec-ngram-min", "2", "--spec-ngram-max", "6",
      "--spec-max-batch-size", "8"]),
    (["--speculative-config", '{"model": "/d", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}'],
     ["--speculative", "draft", "--draft-model", "/d", "--num-speculative-tokens", "3"]),
    # vLLM's rule: a prompt_lookup bound given alone is the other one too (min 6 alone was min 6 > max 4)
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 6}'],
     ["--speculative", "ngram", "--num-speculative-tokens", "2", "--spec-ngram-min", "6", "--spec-ngram-max", "6"]),
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2}'],
     ["--speculative", "ngram", "--num-speculative-tokens", "2", "--spec-ngram-min", "2", "--spec-ngram-max", "2"]),
    # null is vLLM's unset (a config dumped from its dataclass has them): the bound given is both
    (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": null, '
      '"prompt_lookup_max": 3, "disable_by_batch_size": null}'],
     ["--speculative", "ngram", "--num-speculative-tokens", "2", "--spec-ngram-min", "3", "--spec-ngram-max", "3"]),
    # vLLM's older spelling: the model "[ngram]" (or "ngram") names the method (it was a draft model's directory)
    (["--speculative-config", '{"model": "[ngram]", "num_speculative_tokens": 3}'],
     ["--speculative", "ngram", "--num-speculative-tokens", "3"]),
    (["--speculative-config", '{"method": "[ngram]", "model": "ngram", "num_speculative_tokens": 3}'],
     ["--speculative", "ngram", "--num-speculative-tokens", "3"]),
])
def test_vllms_command_line_flags_run_as_written(vllm: list[str], ours: list[str]) -> None:
    """A vLLM command line carries these; `pdserve serve` exited 2 on each as an unknown flag.
    Each makes the config that pdserve's own flags (or none) make."""
    assert _config(*vllm) == _config(*ours)
    assert _config("--no-enable-prefix-caching") != _config()


def test_metrics_api_key_on_the_command_line_is_the_key_and_is_never_printed(
        no_start: None, capsys: pytest.CaptureFixture[str]) -> None:
    """`--metrics-api-key KEY` (as `--api-key KEY`, and the YAML's `metrics_api_key`) was taken by
    argparse's prefix matching for `--metrics-api-key-file KEY`: the key was read as a path, and
    the error printed it ("metrics_api_key_file: cannot read KEY: No such file or directory")."""
    key = "sk-metrics-0123456789"
    cfg = cli._serve_config(build_parser().parse_args(["serve", "--model", "/m", "--metrics-api-key", key]))
    assert cfg.metrics_api_key == key
    err = refused(["serve", "--model", "/m", "--metrics-api-key", key, "--metrics-api-key-file", "/nonexistent"],
                  capsys)
    assert "metrics_api_key" in err and key not in err


# Each setting as a flag and as the Serve YAML's arg: (argv after `serve --model /m`, YAML args besides `model`).
PLANNER_PROFILE = str(Path(__file__).resolve().parents[2] / "bench" / "results" / "profile_smollm2_2026-11-27.json")
FLAG_AND_YAML: list[tuple[list[str], dict[str, Any]]] = [
    (["--tokenizer", "/t"], {"tokenizer": "/t"}), (["--dtype", "float16"], {"dtype": "float16"}),
    (["--device", "cpu"], {"device": "cpu"}), (["--max-model-len", "512"], {"max_model_len": 512}),
    (["--block-size", "32"], {"block_size": 32}), (["--max-num-seqs", "8"], {"max_num_seqs": 8}),
    (["--max-num-batched-tokens", "512"], {"max_num_batched_tokens": 512}),
    (["--num-kv-blocks", "64"], {"num_kv_blocks": 64}),
    (["--kv-cache-memory", "1048576"], {"kv_cache_memory": 1 << 20}),
    (["--gpu-memory-utilization", "0.5"], {"gpu_memory_utilization": 0.5}),
    (["--no-prefix-caching"], {"enable_prefix_caching": False}),
    (["--attention-backend", "torch"], {"attention_backend": "torch"}),
    (["--speculative", "ngram", "--num-speculative-tokens", "2", "--spec-ngram-min", "2", "--spec-ngram-max", "6",
      "--spec-token-cost", "0.5", "--spec-max-batch-size", "0"],
     {"speculative": "ngram", "num_speculative_tokens": 2, "spec_ngram_min": 2, "spec_ngram_max": 6,
      "spec_token_cost": 0.5, "spec_max_batch_size": 0}),
    (["--speculative", "draft", "--draft-model", "/d"], {"speculative": "draft", "draft_model": "/d"}),
    (["--enforce-eager"], {"enforce_eager": True}), (["--quantization", "fp8"], {"quantization": "fp8"}),
    (["--kv-cache-dtype", "fp8"], {"kv_cache_dtype": "fp8"}), (["--no-async-scheduling"], {"async_scheduling": False}),
    (["--async-scheduling"], {"async_scheduling": True}),
    (["--tensor-parallel-size", "2"], {"tensor_parallel_size": 2}), (["--seed", "7"], {"seed": 7}),
    (["--mode", "colocated", "--workers", "2", "--worker-resources", '{"w": 1}'],
     {"mode": "colocated", "workers": 2, "worker_resources": {"w": 1}}),
    (["--prefill", "2", "--decode", "3", "--prefill-tp", "2", "--decode-tp", "2"],
     {"prefill": 2, "decode": 3, "prefill_tp": 2, "decode_tp": 2}),
    (["--prefill-resources", '{"p": 1}', "--decode-resources", '{"d": 2}', "--gateway-resources", '{"g": 0.5}'],
     {"prefill_resources": {"p": 1}, "decode_resources": {"d": 2}, "gateway_resources": {"g": 0.5}}),
    (["--api-key", "k-0123456789"], {"api_key": "k-0123456789"}),
    (["--metrics-api-key", "m-0123456789"], {"metrics_api_key": "m-0123456789"}),
    (["--max-in-flight", "10", "--gateway-replicas", "2"], {"max_in_flight": 10, "gateway_replicas": 2}),
    (["--transport", "nccl"], {"transport": "nccl"}), (["--cpu-sharing", "split"], {"cpu_sharing": "split"}),
    (["--router-policy", "round_robin"], {"router_policy": "round_robin"}),
    (["--kv-host", "auto"], {"kv_host": "auto"}),
    (["--kv-failure-policy", "fail"], {"kv_failure_policy": "fail"}),
    (["--request-timeout", "60", "--prefill-timeout", "10", "--transfer-timeout", "5"],
     {"request_timeout": 60, "prefill_timeout": 10, "transfer_timeout": 5}),
    (["--max-logprobs", "-1"], {"max_logprobs": -1}),
    (["--uvicorn-log-level", "warning"], {"uvicorn_log_level": "warning"}),
    (["--disable-log-stats", "--disable-uvicorn-access-log", "--disable-fastapi-docs", "--enable-force-include-usage"],
     {"disable_log_stats": True, "disable_uvicorn_access_log": True, "disable_fastapi_docs": True,
      "enable_force_include_usage": True}),
    (["--override-generation-config", '{"temperature": 0.5, "max_new_tokens": 64}'],
     {"override_generation_config": {"temperature": 0.5, "max_new_tokens": 64}}),
    (["--enable-log-requests", "--enable-log-outputs", "--max-log-len", "40"],
     {"enable_log_requests": True, "enable_log_outputs": True, "max_log_len": 40}),
    (["--max-migrations", "0", "--stream-interval", "4", "--worker-wait", "0"],
     {"max_migrations": 0, "stream_interval": 4, "worker_wait": 0}),
    (["--generation-config", "vllm", "--exclude-tools-when-tool-choice-none", "--chat-template", "{{ 'x' }}",
      "--reasoning-parser", "qwen3", "--default-chat-template-kwargs", '{"enable_thinking": false}',
      "--tool-call-parser", "hermes", "--return-tokens-as-token-ids"],
     {"generation_config": "vllm", "exclude_tools_when_tool_choice_none": True, "chat_template": "{{ 'x' }}",
      "reasoning_parser": "qwen3", "default_chat_template_kwargs": {"enable_thinking": False},
      "tool_call_parser": "hermes", "return_tokens_as_token_ids": True}),
    (["--load-poll-interval", "0.5", "--stall-timeout", "0", "--max-prefill-backlog-tokens", "0",
      "--max-restarts", "0"],
     {"load_poll_interval": 0.5, "stall_timeout": 0, "max_prefill_backlog_tokens": 0, "max_restarts": 0}),
    (["--served-model-name", "a", "b"], {"served_model_name": ["a", "b"]}),
    (["--allowed-origins", '["http://localhost:3000"]', "--allowed-methods", '["GET", "POST"]',
      "--allowed-headers", '["authorization"]', "--allow-credentials"],
     {"allowed_origins": ["http://localhost:3000"], "allowed_methods": ["GET", "POST"],
      "allowed_headers": ["authorization"], "allow_credentials": True}),
    (["--max-n", "2", "--max-prompts", "3", "--max-stop", "4", "--max-stop-length", "5", "--max-messages", "6",
      "--max-logit-bias", "7", "--max-cache-salt-length", "8", "--max-body-bytes", "9000", "--body-timeout", "3",
      "--write-timeout", "4"],
     {"max_n": 2, "max_prompts": 3, "max_stop": 4, "max_stop_length": 5, "max_messages": 6, "max_logit_bias": 7,
      "max_cache_salt_length": 8, "max_body_bytes": 9000, "body_timeout": 3, "write_timeout": 4}),
    (["--dtype", "float32", "--planner-profile", PLANNER_PROFILE, "--slo", "ttft:500", "tpot:50",
      "--planner-interval", "15", "--autoscale-roles"],
     {"dtype": "float32", "planner_profile": PLANNER_PROFILE, "slo": ["ttft:500", "tpot:50"], "planner_interval": 15,
      "autoscale_roles": True}),
]
# Set elsewhere under Ray Serve (deploy/pdserve_app.py refuses them as args, naming where they go).
ELSEWHERE_FLAGS: list[tuple[list[str], str, Any]] = [
    (["--host", "0.0.0.0"], "host", "0.0.0.0"), (["--port", "8001"], "port", 8001),
    (["--haproxy-metrics-port", "9102"], "haproxy_metrics_port", 9102),
    (["--haproxy-stats-port", "8405"], "haproxy_stats_port", 8405),
    (["--haproxy-fallback-port", "8501"], "haproxy_fallback_port", 8501),
    (["--max-connections", "1000"], "max_connections", 1000), (["--ingress", "proxy"], "ingress", "proxy"),
    (["--max-connections-per-client", "10"], "max_connections_per_client", 10),
    (["--header-timeout", "5"], "header_timeout", 5), (["--keep-alive-timeout", "5"], "keep_alive_timeout", 5),
    (["--cpu-pinning", "off"], "cpu_pinning", "off"), (["--control-plane-nice", "0"], "control_plane_nice", 0),
    (["--worker-start-timeout", "900"], "worker_start_timeout", 900),
]


@pytest.fixture
def deploy_pkg(monkeypatch: pytest.MonkeyPatch) -> Any:
    """`deploy.pdserve_app`, imported as Serve does (the repository root on sys.path)."""
    import importlib

    pytest.importorskip("ray")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2]))
    return importlib.import_module("deploy.pdserve_app")


def test_the_table_below_holds_every_setting() -> None:
    from pdserve.cluster.serve_config import ENGINE_SETTINGS, SERVE_SETTINGS

    covered = {k for _, args in FLAG_AND_YAML for k in args} | {name for _, name, _ in ELSEWHERE_FLAGS}
    assert (ENGINE_SETTINGS | SERVE_SETTINGS.keys()) - {"model"} - covered == set()


@pytest.mark.parametrize(("argv", "args"), FLAG_AND_YAML, ids=lambda v: " ".join(v) if isinstance(v, list) else "")
def test_each_flag_and_its_yaml_arg_make_the_same_config(deploy_pkg: Any, argv: list[str], args: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.cluster.serve_config import ServeConfig, serve_config

    # The suite's default: --enforce-eager would change nothing.
    monkeypatch.delenv("PDSERVE_ENFORCE_EAGER", raising=False)

    from_flags = cli._serve_config(build_parser().parse_args(["serve", "--model", "/m", *argv]))
    from_yaml = deploy_pkg.config_from_args({"model": "/m", **args})
    assert from_flags == from_yaml and from_flags != serve_config({"model": "/m"})
    assert isinstance(from_flags, ServeConfig)


@pytest.mark.parametrize(("argv", "name", "value"), ELSEWHERE_FLAGS, ids=lambda v: v if isinstance(v, str) else "")
def test_a_flag_set_elsewhere_under_serve_is_refused_as_a_yaml_arg_by_name(
        deploy_pkg: Any, argv: list[str], name: str, value: Any) -> None:
    from pdserve.cluster.serve_config import SERVE_SETTINGS, serve_config

    cfg = cli._serve_config(build_parser().parse_args(["serve", "--model", "/m", *argv]))
    assert cfg == serve_config({"model": "/m", name: value}) and getattr(cfg, SERVE_SETTINGS[name]) is not None
    with pytest.raises(ValueError, match=f"^{name}: not an application arg"):
        deploy_pkg.config_from_args({"model": "/m", name: value})


# -- pdserve generate ----------------------------------------------------------------------


@pytest.mark.parametrize(("flag", "value", "name"), [
    ("--max-tokens", "0", "max_tokens"), ("--temperature", "-1", "temperature"), ("--top-p", "2", "top_p"),
    ("--top-k", "-5", "top_k"), ("--repetition-penalty", "0", "repetition_penalty"), ("--stop", "", "stop"),
])
def test_generate_refuses_a_bad_sampling_flag_before_it_loads_the_model(
        flag: str, value: str, name: str, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The sampling flags were checked only once the engine was built: a model loaded (and
    compiled, and its tensor-parallel ranks started, never closed) to say `--max-tokens 0`."""
    from pdserve import LLM

    def loaded(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the model was loaded before the sampling flags were checked")

    monkeypatch.setattr(LLM, "from_config", loaded)
    err = refused(["generate", "hi", "--model", "/m", flag, value], capsys)
    assert err.startswith(f"pdserve: error: {name}:")


def test_generate_chat_gives_the_model_one_bos(make_model: Callable[[TinyModelSpec], Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """`--chat` rendered the template to text and generate() encoded it with the tokenizer's
    special tokens: a model whose tokenizer adds BOS and whose template writes it (Llama 3's)
    saw two."""
    from pdserve import LLM

    model = with_bos_added(make_model(tiny_spec()), tmp_path / "bos")
    seen: list[list[int]] = []
    generate = LLM.generate

    def spy(self: LLM, *args: Any, **kwargs: Any) -> Any:
        outs = generate(self, *args, **kwargs)
        seen.extend(o.prompt_token_ids for o in outs)
        return outs

    monkeypatch.setattr(LLM, "generate", spy)
    argv = ["generate", "--chat", "hi", "--model", str(model), "--max-tokens", "2", "--num-kv-blocks", "32",
            "--max-model-len", "128"]
    assert cli.main(argv) == 0
    assert "--- 2 tokens" in capsys.readouterr().out
    bos = 0  # the tiny tokenizer's <|begin_of_text|>
    assert len(seen) == 1 and seen[0][0] == bos and seen[0].count(bos) == 1, seen


# -- pdserve bench -------------------------------------------------------------------------

# Nothing listens there: a bench that gets as far as the server fails on connecting.
NO_SERVER = ["--base-url", "http://127.0.0.1:9/v1", "--num-requests", "2", "--no-progress"]


@pytest.mark.parametrize(("argv", "name"), [
    (["--workload", "trace", "--trace", "/nonexistent/trace.jsonl"], "trace"),
    (["--tokenizer", "/nonexistent/tokenizer"], "tokenizer"),
])
def test_bench_refuses_a_path_that_is_not_there_in_one_line(argv: list[str], name: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A FileNotFoundError (the trace) or transformers' OSError (the tokenizer) traceback, exit 1."""
    err = refused(["bench", *NO_SERVER, *argv], capsys)
    assert err.startswith(f"pdserve: error: {name}") and "/nonexistent/" in err


@pytest.mark.parametrize(("argv", "name"), [
    (["--input-len", "0"], "input len"), (["--output-len", "0"], "output len"), (["--output-len", "-3"], "output len"),
    (["--burstiness", "0"], "burstiness"),
])
def test_bench_names_the_length_or_burstiness_it_refuses_before_it_connects(
        argv: list[str], name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`--output-len 0` said "length: must be >= 1" (which one?); `--burstiness 0` was checked only
    after the bench had asked the server for its models (here: a connection error instead)."""
    err = refused(["bench", *NO_SERVER, *argv], capsys)
    assert err.startswith(f"pdserve: error: {name}:")


# -- pdserve profile -----------------------------------------------------------------------


@pytest.mark.parametrize("where", ["a directory that is not there", "a directory"])
def test_profile_refuses_an_out_path_it_cannot_write_before_it_profiles(
        where: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`--out` was first written after the whole profile (minutes of engine steps), and then as
    a FileNotFoundError (IsADirectoryError) traceback: the measurements were lost."""
    from pdserve.cluster.planner import profiler

    def built(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("the engine was built (the profile begun) before --out was checked")

    monkeypatch.setattr(profiler, "build_engine", built)
    out = tmp_path / "missing" / "profile.json" if where.endswith("not there") else tmp_path
    err = refused(["profile", "--model", "/m", "--out", str(out)], capsys)
    assert err.startswith("pdserve: error: out:") and str(out) in err


# -- pdserve serve: what the model allows ----------------------------------------------------


@pytest.fixture
def model_shape(tmp_path: Path) -> str:
    """A model directory's config.json (all that these checks read): 4 heads, 2 KV heads, 1024 positions."""
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}))
    return str(tmp_path)


@pytest.mark.parametrize(("argv", "name"), [
    (["--max-model-len", "4096"], "max_model_len"),
    (["--prefill-tp", "3"], "prefill_tp"), (["--decode-tp", "3"], "decode_tp"),
    (["--tensor-parallel-size", "3"], "tensor_parallel_size"),
    (["--mode", "colocated", "--tensor-parallel-size", "3"], "tensor_parallel_size"),
])
def test_serve_refuses_what_the_model_cannot_do_before_ray_starts(
        argv: list[str], name: str, model_shape: str, no_start: None, capsys: pytest.CaptureFixture[str]) -> None:
    """`--max-model-len` past the model's positions, or a pool's tensor-parallel size that does not
    divide its heads, were found by the workers once Ray, Serve and their processes were up (and a
    `--prefill-tp 3` was reported as `tensor_parallel_size: 3 ...`, a flag not given)."""
    err = refused(["serve", "--model", model_shape, *argv], capsys)
    assert err.startswith(f"pdserve: error: {name}: ")


def test_a_blank_model_is_refused_before_the_working_directory_is_read(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_start: None, capsys: pytest.CaptureFixture[str]) -> None:
    """`--model ""` was the working directory (Path("") exists): a GGUF file there was converted
    into the cache before the blank name was refused. /dev/null was said not to exist."""
    from pdserve.workers.model import resolve

    monkeypatch.chdir(tmp_path)
    (tmp_path / "some.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    converted: list[str] = []
    real = resolve.resolve_model

    def spy(model: str, **kw: Any) -> Any:
        converted.append(model)
        return real(model, **kw)

    monkeypatch.setattr(resolve, "resolve_model", spy)
    for command in ("generate", "serve"):
        err = refused([command, "--model", "", *(["hi"] if command == "generate" else [])], capsys)
        assert err.startswith("pdserve: error: model: must not be blank") and converted == []
    err = refused(["serve", "--model", "/dev/null"], capsys)
    assert err == "pdserve: error: model: /dev/null is neither a model directory nor a GGUF file\n"


@pytest.mark.parametrize("host", ["999.1.1.1", "not a host", "-x.example.com", "a..b"])
def test_serve_refuses_a_host_that_is_no_address_before_anything_starts(
        host: str, no_start: None, capsys: pytest.CaptureFixture[str]) -> None:
    """`--host 999.1.1.1` started Ray, Serve and every worker; 14 s later HAProxy could not bind
    it and the start ended in a traceback naming another port. (`--kv-host` was refused so.)"""
    assert refused(["serve", "--model", "/m", f"--host={host}"], capsys).startswith("pdserve: error: host: ")


def test_a_local_start_refuses_a_host_this_machine_cannot_listen_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from pdserve.cluster import port_lock, serve_app

    monkeypatch.setattr(serve_app, "starts_local_ray", lambda: True)
    held: list[int] = []
    monkeypatch.setattr(port_lock, "hold", held.append)
    cfg = cli._serve_config(build_parser().parse_args(["serve", "--model", "/m", "--host", "192.0.2.1"]))
    with pytest.raises(ValueError, match=r"^host: cannot listen on 192\.0\.2\.1"):  # TEST-NET-1: no machine's
        serve_app.preflight(cfg)
    assert held == []  # refused before it took the port
    monkeypatch.setattr(serve_app, "check_ports", lambda ports: [])
    assert serve_app.preflight(dataclasses.replace(cfg, host="localhost")) and held == [cfg.port]


@pytest.mark.parametrize(("text", "says"), [
    ("{bad json", "not valid JSON"), ('["LlamaForCausalLM"]', "not a JSON object"),
    ('{"architectures": ["LlamaForCausalLM"]}', "'num_attention_heads'"),
    ('{"architectures": ["LlamaForCausalLM"], "num_attention_heads": "four", "hidden_size": 64}', "four"),
])
def test_serve_refuses_a_broken_config_json_naming_the_file(
        text: str, says: str, tmp_path: Path, no_start: None, capsys: pytest.CaptureFixture[str]) -> None:
    """A model directory whose config.json is not JSON was refused with json's words alone
    ("Expecting property name enclosed in double quotes: line 1 column 2"), naming no file; one
    that lacks a field the model needs (or holds a word for a number) escaped `pdserve serve` as
    a KeyError (ValueError) traceback, exit 1. (A worker reading it hit the same.) One line
    naming the file, exit 2."""
    (tmp_path / "config.json").write_text(text)
    err = refused(["serve", "--model", str(tmp_path)], capsys)
    assert err.startswith(f"pdserve: error: model: {tmp_path / 'config.json'}") and says in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("local", [True, False])
def test_serve_refuses_a_model_path_that_is_not_there_before_it_starts_local_ray(
        local: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A `--model` path this machine has not was left to the workers (their nodes may have it),
    also where the workers would run here, on the local Ray `pdserve serve` starts: Ray, Serve and
    every worker started, and the start ended 20-odd seconds later in "a worker could not start:
    model: ... does not exist". On local Ray it is refused before anything starts; a cluster it
    joins still gets the path (its nodes may have it)."""
    from pdserve.cluster import serve_app, shutdown

    reached: list[Any] = []
    monkeypatch.setattr(serve_app, "starts_local_ray", lambda: local)
    monkeypatch.setattr(serve_app, "preflight", lambda cfg: reached.append(cfg))
    monkeypatch.setattr(shutdown, "serve_in_own_group", lambda run: 0)
    if local:
        err = refused(["serve", "--model", "/nonexistent/model"], capsys)
        assert err == "pdserve: error: model: /nonexistent/model does not exist\n" and reached == []
    else:
        assert cli.main(["serve", "--model", "/nonexistent/model"]) == 0 and len(reached) == 1


@pytest.mark.parametrize("local", [True, False])
def test_serve_refuses_a_tokenizer_path_that_is_not_there_before_it_starts_local_ray(
        local: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A `--tokenizer` directory this machine has not was found by each worker's engine, whose
    transformers took it for a hub id: "Repo id must be in the form 'repo_name' or
    'namespace/repo_name'", in Ray's whole traceback, exit 1. On local Ray it is refused before
    anything starts, by name; a cluster it joins still gets it (its nodes may have it)."""
    from pdserve.cluster import serve_app, shutdown

    reached: list[Any] = []
    monkeypatch.setattr(serve_app, "starts_local_ray", lambda: local)
    monkeypatch.setattr(serve_app, "preflight", lambda cfg: reached.append(cfg))
    monkeypatch.setattr(shutdown, "serve_in_own_group", lambda run: 0)
    argv = ["serve", "--model", "tiny", "--tokenizer", "/nonexistent/tokenizer"]
    if local:
        err = refused(argv, capsys)
        last = err.strip().splitlines()[-1]  # (after the tiny model's making, on a first run)
        assert last == "pdserve: error: tokenizer: /nonexistent/tokenizer is not a directory on this machine"
        assert reached == []
    else:
        assert cli.main(argv) == 0 and len(reached) == 1


def test_an_engines_tokenizer_path_that_is_not_there_is_refused_by_name() -> None:
    """Where the worker loads it (a joined cluster's node without the directory): a ValueError
    naming the setting, which ends the start in one line; a hub id is left to transformers."""
    from pdserve.workers.engine_setup import tokenizer_source

    with pytest.raises(ValueError, match="^tokenizer: ./no/such/dir is not a directory"):
        tokenizer_source("./no/such/dir", "/models/m")
    assert tokenizer_source("org/name", "/models/m") == "org/name"
    assert tokenizer_source(None, "/models/m") == "/models/m"


def test_serve_takes_what_the_model_can_do(model_shape: str, monkeypatch: pytest.MonkeyPatch) -> None:
    reached: list[Any] = []
    from pdserve.cluster import serve_app, shutdown

    monkeypatch.setattr(serve_app, "preflight", lambda cfg: reached.append(cfg))
    monkeypatch.setattr(shutdown, "serve_in_own_group", lambda run: 0)
    assert cli.main(["serve", "--model", model_shape, "--max-model-len", "1024", "--prefill-tp", "2",
                     "--decode-tp", "4"]) == 0
    assert reached and reached[0].engine.max_model_len == 1024


def test_a_cluster_secret_in_the_environment_that_is_too_short_is_refused_naming_the_variable(
        monkeypatch: pytest.MonkeyPatch, no_start: None, capsys: pytest.CaptureFixture[str]) -> None:
    """README: `--cluster-secret-file` (or PDSERVE_CLUSTER_SECRET). A bad variable said only "cluster
    secret: need at least 16 bytes", naming neither the variable nor the flag: an operator who had
    given no flag could not tell where the secret came from."""
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "short")
    err = refused(["serve", "--model", "/m"], capsys)
    assert "PDSERVE_CLUSTER_SECRET" in err and "short" not in err.replace("too short", "")


@pytest.mark.parametrize("device", ["cuda:1", "cuda:3"])
def test_serve_refuses_a_device_naming_one_gpu_before_ray_starts(
        device: str, no_start: None, capsys: pytest.CaptureFixture[str]) -> None:
    """Under Ray each worker sees only the GPU Ray gave it (cluster/placement.py says so, refusing
    `cuda:N`), but only once Ray was up and the workers were being placed; the Serve YAML's
    `device: cuda:1` likewise passed its checks (`config_from_args`) and failed in the build."""
    from pdserve.cluster.serve_config import serve_config

    err = refused(["serve", "--model", "/m", "--device", device], capsys)
    assert err.startswith(f"pdserve: error: device: {device}")
    with pytest.raises(ValueError, match=f"^device: {device}"):
        serve_config({"model": "/m", "device": device})
    assert serve_config({"model": "/m", "device": "cuda:0"}).engine.device == "cuda:0"


@pytest.mark.parametrize(("flag", "value", "name"), [
    ("--num-speculative-tokens", "8", "num_speculative_tokens"), ("--spec-ngram-min", "2", "spec_ngram_min"),
    ("--spec-ngram-max", "6", "spec_ngram_max"), ("--spec-token-cost", "0.3", "spec_token_cost"),
    ("--spec-max-batch-size", "16", "spec_max_batch_size"),
])
def test_a_speculative_setting_without_speculative_is_refused_not_ignored(
        flag: str, value: str, name: str, no_start: None, capsys: pytest.CaptureFixture[str]) -> None:
    """`--draft-model` without `--speculative draft` is refused ("give it exactly when speculative is
    draft"), and a colocated cluster refuses the disaggregated settings it would not read ("the
    operator believed them in force"); `--num-speculative-tokens 8` with no `--speculative` was
    taken and ignored."""
    err = refused(["serve", "--model", "/m", flag, value], capsys)
    assert err.startswith(f"pdserve: error: {name}: ") and "--speculative" in err
    argv = ["serve", "--model", "/m", "--speculative", "ngram", flag, value]
    cfg = cli._serve_config(build_parser().parse_args(argv))
    assert cfg.engine.speculative is not None


def test_uvicorn_log_flags_set_the_gateways_serve_logging() -> None:
    """vLLM's --disable-uvicorn-access-log: the gateway deployment logs no line per request. Without
    it the deployment keeps Serve's own logging settings (none given: its access log on)."""
    from pdserve.cluster import serve_app
    from pdserve.cluster.serve_config import serve_config

    quiet = serve_app.gateway_app(serve_config({"model": "/m", "disable_uvicorn_access_log": True}))
    assert quiet._bound_deployment.logging_config["enable_access_log"] is False
    assert serve_app.gateway_app(serve_config({"model": "/m"}))._bound_deployment.logging_config is None
    # vLLM's --uvicorn-log-level: the replicas' Serve logger at that level (trace is below Python's: DEBUG)
    for level, want in (("warning", "WARNING"), ("trace", "DEBUG")):
        app = serve_app.gateway_app(serve_config({"model": "/m", "uvicorn_log_level": level}))
        assert app._bound_deployment.logging_config["log_level"] == want


@pytest.mark.parametrize(("spec", "named"), [
    ('{"method": "eagle", "model": "/e"}', "method 'eagle'"),
    ('{"method": "ngram", "prompt_lookup_maxx": 4}', "prompt_lookup_maxx"),
    ('{"method": "draft_model"}', "model"),
    ('{"method": "ngram", "model": "/d"}', "model"),
    ('{"method": "ngram", "draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size"),
    ('[1, 2]', "JSON object"),
    ("{not json", "not a JSON object"),
    ('{"method": ["ngram"]}', "method"),  # was a TypeError's traceback (unhashable)
    ('{"method": {"name": "ngram"}}', "method"),
])
def test_a_vllm_speculative_config_pdserve_cannot_run_is_refused_naming_the_key(
        spec: str, named: str, no_start: None, capsys: pytest.CaptureFixture[str]) -> None:
    """vLLM's --speculative-config asks for EAGLE, MTP and more: pdserve must refuse those, naming what,
    not serve without speculation (or with a key it misread)."""
    err = refused(["serve", "--model", "/m", "--speculative-config", spec], capsys)
    assert "speculative_config" in err and named in err and len(err.strip().splitlines()) == 1
