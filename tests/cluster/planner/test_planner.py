"""The planner's answers and `pdserve plan` end to end, on a synthetic profile."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest
from sim_factories import synthetic_profile

from pdserve.cluster.bench.config import BenchConfig
from pdserve.cluster.bench.metrics import SLO
from pdserve.cluster.cli import build_parser, main
from pdserve.cluster.planner.plan_cli import build_planner
from pdserve.cluster.planner.planner import Planner, parse_shape, shapes
from pdserve.cluster.planner.sim_workload import Workload
from pdserve.cluster.planner.simulator import engine_settings

SLO_ARGS = ["--slo", "ttft:200", "tpot:20"]
WORKLOAD_ARGS = ["--input-len", "1024", "--output-len", "64", "--num-requests", "150"]


def planner(num_requests: int = 150) -> Planner:
    p = synthetic_profile()
    e = engine_settings(p)
    cfg = BenchConfig("http://sim/v1", num_requests=num_requests, input_len=1024, output_len=64)
    return Planner(p.costs(), e, Workload.build(cfg, e.block_size), SLO(ttft=0.2, tpot=0.02))


@pytest.fixture
def profile_path(tmp_path: Path) -> str:
    path = tmp_path / "profile.json"
    synthetic_profile().save(path)
    return str(path)


def test_every_split_of_n_workers_is_a_candidate() -> None:
    assert [s.label for s in shapes(3)] == ["3 colocated", "1P+2D", "2P+1D"]
    assert [s.label for s in shapes(1)] == ["1 colocated"]


def test_a_lower_rate_needs_fewer_workers() -> None:
    pl = planner()
    low, high = pl.for_rate(5.0), pl.for_rate(90.0)
    assert low.best and high.best
    assert low.best[0].shape.num_workers < high.best[0].shape.num_workers
    for plan in (low, high):
        n = plan.best[0].shape.num_workers
        assert all(e.meets for e in plan.best)
        assert all(e.shape.num_workers == n for e in plan.best)
        assert not any(e.meets for e in plan.evaluated if e.shape.num_workers < n)  # none smaller meets


def test_goodput_for_n_workers_ranks_every_split() -> None:
    found = planner(100).for_workers(2)
    assert sorted(g.shape.label for g in found) == ["1P+1D", "2 colocated"]
    assert found[0].rate is not None and found[0].rate >= (found[1].rate or 0.0)
    assert found[0].at_goodput is not None and found[0].at_goodput.attainment >= 0.9


def test_plan_cli_prints_the_fewest_workers_that_meet_the_slos(profile_path: str,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", profile_path, *SLO_ARGS, "--rate", "5", *WORKLOAD_ARGS]) == 0
    out = capsys.readouterr().out
    assert "5 req/s" in out and "<- meets, fewest workers" in out and "best: 1 colocated" in out


def test_plan_cli_simulates_one_configuration_as_bench_reports_it(profile_path: str,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", profile_path, *SLO_ARGS, "--rate", "3", "--config", "1P+1D",
                 *WORKLOAD_ARGS]) == 0
    out = capsys.readouterr().out
    assert "1P+1D at 3 req/s" in out and "SLO attainment:" in out and "Simulated plans:" in out
    assert main(["plan", "--profile", profile_path, *SLO_ARGS, "--rate", "3", "--config", "2", "--json",
                 *WORKLOAD_ARGS]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["config"] == "2 colocated" and d["summary"]["completed"] == 150
    assert main(["plan", "--profile", profile_path, *SLO_ARGS, "--rate", "3", "--config", "1X"]) != 0
    assert "expected PP+DD" in capsys.readouterr().err


def test_parse_shape() -> None:
    assert parse_shape("1P+2D").label == "1P+2D"
    assert parse_shape("3").label == parse_shape("3c").label == parse_shape("3 colocated").label == "3 colocated"
    for bad in ("", "0", "P+D", "1P", "2D+1P", "0P+2D", "1P+0D"):
        with pytest.raises(ValueError):
            parse_shape(bad)


def test_plan_cli_json_for_a_number_of_workers(profile_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", profile_path, *SLO_ARGS, "--gpus", "2", "--json",
                 "--workload", "shared-prefix", "--input-len", "1024", "--prefix-len", "512",
                 "--output-len", "32", "--num-requests", "100"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["mode"] == "gpus" and d["slo_ms"] == {"ttft": 200.0, "tpot": 20.0}
    assert {c["config"] for c in d["candidates"]} == {"2 colocated", "1P+1D"}
    assert all(c["goodput_rps"] is None or c["goodput_rps"] > 0 for c in d["candidates"])


def test_plan_cli_says_when_nothing_meets_the_slos(profile_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--profile", profile_path, "--slo", "ttft:1", "--rate", "5", "--max-workers", "2",
               *WORKLOAD_ARGS])
    assert rc == 1
    assert "no configuration of up to 2 workers" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--slo", "ttft500", "--rate", "1"], "expected ttft:MS"),
    (["--slo", "ttft:abc", "--rate", "1"], "not a number"),
    (["--slo", "ttft:500", "--rate", "1", "--attainment", "1.5"], "--attainment"),
])
def test_plan_cli_rejects_bad_input_clearly(profile_path: str, argv: list[str], message: str,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["plan", "--profile", profile_path, *argv, "--num-requests", "10"])
    assert rc != 0
    assert message in capsys.readouterr().err


def test_plan_cli_rejects_a_missing_or_bad_profile(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--profile", str(tmp_path / "nope.json"), *SLO_ARGS, "--rate", "1"]) != 0
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"version": 1}))
    assert main(["plan", "--profile", str(bad), *SLO_ARGS, "--rate", "1"]) != 0
    assert "not a pdserve profile" in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, "[]", '"profile.json"', "3"])
def test_plan_cli_rejects_a_profile_that_is_a_directory_or_no_json_object(tmp_path: Path, content: str | None,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """A message naming the profile, as for a missing file: not an IsADirectoryError or an
    AttributeError traceback."""
    path = tmp_path / "profile.json"
    if content is None:
        path.mkdir()
    else:
        path.write_text(content)
    assert main(["plan", "--profile", str(path), *SLO_ARGS, "--rate", "1"]) == 2
    assert f"pdserve: error: profile {path}: " in capsys.readouterr().err


@pytest.mark.parametrize("field, value", [("block_size", "16"), ("num_kv_blocks", 4096.5), ("torch_threads", None)])
def test_plan_cli_rejects_a_profile_whose_engine_settings_are_no_counts(
        tmp_path: Path, field: str, value: object, capsys: pytest.CaptureFixture[str]) -> None:
    """A hand-edited profile's engine settings ("16", a float, null): a message naming the setting,
    not a TypeError traceback from the simulator's arithmetic, nor a plan made on 4096.5 blocks."""
    d = synthetic_profile().to_json()
    d["engine"][field] = value  # type: ignore[index]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(d))
    assert main(["plan", "--profile", str(path), *SLO_ARGS, "--rate", "1", "--num-requests", "5"]) == 2
    assert f"profile {path}: engine.{field}" in capsys.readouterr().err


def test_plan_cli_warns_when_the_cost_models_fit_the_profile_badly(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    d = synthetic_profile().to_json()
    d["prefill"][2]["seconds"] *= 3  # one point far off the shape
    path = tmp_path / "noisy.json"
    path.write_text(json.dumps(d))
    assert main(["plan", "--profile", str(path), *SLO_ARGS, "--rate", "2", "--config", "1", *WORKLOAD_ARGS]) == 0
    assert "warning: the prefill cost model's fitted shape is" in capsys.readouterr().err


def test_plan_cli_needs_a_rate_or_a_number_of_workers(profile_path: str) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--profile", profile_path, *SLO_ARGS])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--profile", profile_path, *SLO_ARGS, "--rate", "1", "--gpus", "2"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["plan", "--profile", profile_path, *SLO_ARGS, "--rate", "-1"])


def test_plan_table_to_a_stream() -> None:
    from pdserve.cluster.planner.plan_cli import print_rate_plan

    pl = planner(50)
    buf = io.StringIO()
    print_rate_plan(pl, pl.for_rate(2.0, max_workers=1), buf)
    assert "1 colocated" in buf.getvalue()


def _tp2_profile(prefill_speedup: float = 3.0) -> Any:
    """The synthetic profile as a worker of two ranks would measure it: prefill (compute-bound)
    `prefill_speedup` times faster, decode as fast, twice the KV blocks."""
    p = synthetic_profile()
    return dataclasses.replace(
        p, engine=dataclasses.replace(p.engine, tensor_parallel_size=2, num_kv_blocks=2 * p.engine.num_kv_blocks),
        prefill=tuple(dataclasses.replace(q, seconds=q.seconds / prefill_speedup) for q in p.prefill))


def _pools() -> dict[int, Any]:
    return {size: (p.costs(), engine_settings(p)) for size, p in ((1, synthetic_profile()), (2, _tp2_profile()))}


def test_with_two_tensor_parallel_sizes_every_split_of_the_devices_is_a_candidate() -> None:
    """4 devices over workers of 1 or 2 ranks: each candidate uses all 4, every pool size pairing
    is there, and with one size the candidates are the one-rank splits as before."""
    found = shapes(4, sizes=(1, 2))
    assert all(s.devices == 4 for s in found)
    labels = [s.label for s in found]
    assert len(labels) == len(set(labels))
    assert {"4 colocated", "2 colocated(tp2)", "1P+3D", "2P+1D(tp2)", "1P(tp2)+2D", "1P(tp2)+1D(tp2)"} <= set(labels)
    assert "1P(tp2)+1D" not in labels  # 3 devices
    assert [s.label for s in shapes(4, sizes=(1,))] == [s.label for s in shapes(4)]
    assert [s.label for s in shapes(3, sizes=(2,))] == []  # no split of 3 into workers of 2


def test_a_pool_of_two_rank_workers_simulates_with_its_own_profile() -> None:
    """1P(tp2)+1D beside 1P+1D at one rate: the prefill worker of two ranks (its profile 3x faster
    at prefill) gives a lower TTFT; decode, the same one-rank worker in both, keeps its TPOT."""
    base = planner(60)
    pl = dataclasses.replace(base, pools=_pools())
    one, two = (pl.evaluate(parse_shape("1P+1D"), 4.0),
                pl.evaluate(dataclasses.replace(parse_shape("1P+1D"), prefill_tp=2), 4.0))
    assert two.shape.devices == 3 and two.ttft_s[0] is not None and one.ttft_s[0] is not None
    assert two.ttft_s[0] < 0.6 * one.ttft_s[0]
    assert one.tpot_s[0] == pytest.approx(two.tpot_s[0], rel=0.1)
    assert pl.evaluate(parse_shape("1P+1D"), 4.0) == base.evaluate(parse_shape("1P+1D"), 4.0)  # one rank: as before


def test_plan_cli_plans_devices_from_a_profile_per_tensor_parallel_size(
        tmp_path: Path, profile_path: str, capsys: pytest.CaptureFixture[str]) -> None:
    tp2 = tmp_path / "tp2.json"
    _tp2_profile().save(tp2)
    assert main(["plan", "--profile", profile_path, "--profile", str(tp2), *SLO_ARGS, "--gpus", "3", "--json",
                 "--input-len", "512", "--output-len", "16", "--num-requests", "40"]) in (0, 1)
    d = json.loads(capsys.readouterr().out)
    configs = {c["config"]: c for c in d["candidates"]}
    assert {"3 colocated", "1P+2D", "2P+1D", "1P(tp2)+1D", "1P+1D(tp2)"} == set(configs)
    assert all(c["devices"] == 3 for c in d["candidates"])
    main(["plan", "--profile", profile_path, "--profile", str(tp2), *SLO_ARGS, "--gpus", "3",
          "--input-len", "512", "--output-len", "16", "--num-requests", "40"])
    out = capsys.readouterr().out
    assert "3 devices" in out and "1P(tp2)+1D" in out
    with pytest.raises(ValueError, match="second profile"):
        build_planner(build_parser().parse_args(["plan", "--profile", profile_path, "--profile", profile_path,
                                                 *SLO_ARGS, "--gpus", "2"]))


def test_a_rate_plan_with_no_configuration_to_try_is_at_the_rate_asked_for(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Workers of 2 ranks and at most 1 device: no configuration fits, none is simulated. The
    plan is still at --rate: the table said 'nan req/s', and --json wrote NaN, which is no JSON."""
    tp2 = tmp_path / "tp2.json"
    _tp2_profile().save(tp2)
    argv = ["plan", "--profile", str(tp2), *SLO_ARGS, "--rate", "5", "--max-workers", "1", *WORKLOAD_ARGS]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "nan" not in out and "pdserve plan: 5 req/s" in out and "at 5 req/s" in out

    def no_json(constant: str) -> None:
        raise AssertionError(f"{constant} is not JSON")

    assert main([*argv, "--json"]) == 1
    d = json.loads(capsys.readouterr().out, parse_constant=no_json)
    assert d["rate"] == 5.0 and d["best"] == [] and d["evaluated"] == []
