"""ServeConfig and EngineConfig check their fields as declared (pydantic dataclasses, strict) and
name the setting in every error; the YAML's and the flags' names are in test_deploy_configs.py."""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest

from pdserve.cluster.serve_config import SERVE_SETTINGS, ServeConfig, serve_config
from pdserve.workers.config import DType, EngineConfig

PLANNER_PROFILE = Path(__file__).resolve().parents[2] / "bench" / "results" / "profile_smollm2_2026-11-27.json"


def test_every_bad_setting_is_named_on_a_line_of_its_own() -> None:
    with pytest.raises(ValueError) as e:
        ServeConfig(EngineConfig("/m"), num_prefill=0, num_decode="2", request_timeout=-1)  # type: ignore[arg-type]
    assert str(e.value).splitlines() == ["prefill: must be > 0, got 0", "decode: must be an integer, got '2'",
                                         "request_timeout: must be > 0.0, got -1"]
    assert type(e.value) is ValueError  # not pydantic's ValidationError, with its report


@pytest.mark.parametrize(("name", "value"), [
    ("max_num_seqs", "8"), ("max_num_seqs", 8.0), ("max_num_seqs", True), ("max_model_len", 0),
    ("gpu_memory_utilization", "0.5"), ("gpu_memory_utilization", float("nan")), ("gpu_memory_utilization", 1.5),
    ("enable_prefix_caching", "false"), ("enable_prefix_caching", 0), ("block_size", 24), ("dtype", "fp8"),
    ("spec_token_cost", float("inf")), ("cpu_turns", ""),
])
def test_the_engine_takes_no_value_it_would_have_to_guess_at(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{name}: "):
        EngineConfig("/m", **{name: value})


def test_an_enum_takes_its_value_and_a_float_an_int() -> None:
    cfg = EngineConfig("/m", dtype="float16", gpu_memory_utilization=1)  # type: ignore[arg-type]
    assert cfg.dtype is DType.FLOAT16 and cfg.gpu_memory_utilization == 1.0
    assert dataclasses.replace(cfg, dtype="bfloat16").dtype is DType.BFLOAT16  # type: ignore[arg-type]


def test_a_changed_copy_is_checked_too() -> None:
    cfg = serve_config({"model": "/m", "prefill": 2})
    assert dataclasses.replace(cfg, num_prefill=3).num_prefill == 3
    with pytest.raises(ValueError, match="^prefill: "):
        dataclasses.replace(cfg, num_prefill=0)


def test_a_key_s_value_is_never_in_an_error() -> None:
    for name in ("api_key", "metrics_api_key"):
        with pytest.raises(ValueError, match=rf"^{name}: must be a string$"):
            ServeConfig(EngineConfig("/m"), **{name: 12345678})
        with pytest.raises(ValueError, match=rf"^{name}: must not be blank$"):
            ServeConfig(EngineConfig("/m"), **{name: " \n"})


def test_the_setting_names_are_the_field_names_but_three() -> None:
    renamed = {setting: field for setting, field in SERVE_SETTINGS.items() if setting != field}
    assert renamed == {"prefill": "num_prefill", "decode": "num_decode", "workers": "num_colocated"}
    assert "engine" not in SERVE_SETTINGS.values() and "cluster_secret" not in SERVE_SETTINGS.values()


def test_the_planner_is_made_where_the_config_is_and_travels_with_it(tmp_path: Path) -> None:
    """The profile is read on the machine that starts the cluster; the gateway gets the planner."""
    profile = tmp_path / "profile.json"
    shutil.copy(PLANNER_PROFILE, profile)
    cfg = serve_config({"model": "/m", "dtype": "float32", "planner_profile": str(profile), "slo": "ttft:500",
                        "planner_interval": 15})
    profile.unlink()
    there = pickle.loads(pickle.dumps(cfg))
    assert there == cfg and there.slo == ("ttft:500",)
    assert there.planner is not None and there.planner.interval_s == 15.0 and there.planner.slo.ttft == 0.5


def test_a_poll_interval_the_stall_watch_would_mistake_for_a_hang_is_refused() -> None:
    """A disaggregated worker is heard from once a poll: polled every 20 s with a 10 s stall
    timeout, a busy healthy worker would be taken for hung and restarted on every cycle."""
    with pytest.raises(ValueError, match=r"^load_poll_interval: 20 s leaves stall_timeout \(10 s\) under four polls"):
        serve_config({"model": "/m", "load_poll_interval": 20.0})
    assert serve_config({"model": "/m", "load_poll_interval": 20.0, "stall_timeout": 0}).stall_timeout == 0
    assert serve_config({"model": "/m", "load_poll_interval": 2.0, "stall_timeout": 10}).load_poll_interval == 2.0


@pytest.mark.parametrize("seed", [2**64, -(2**63) - 1, 10**30])
def test_an_engine_seed_torch_cannot_take_is_refused_by_name(seed: int) -> None:
    """`--seed` / YAML `seed:` went unchecked to each worker's `torch.manual_seed`, which refused
    it ("Overflow when unpacking long long"): every worker failed to start once Ray was up, where
    any other bad setting is refused here, by name, before anything starts."""
    import torch

    with pytest.raises(ValueError, match=r"Overflow"):  # the oracle: what the engine would meet
        torch.manual_seed(seed)
    with pytest.raises(ValueError, match=r"^seed: "):
        serve_config({"model": "tiny", "seed": seed})


@pytest.mark.parametrize("seed", [-(2**63), -1, 0, 2**64 - 1])
def test_every_engine_seed_torch_takes_is_taken(seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    assert serve_config({"model": "tiny", "seed": seed}).engine.seed == seed
