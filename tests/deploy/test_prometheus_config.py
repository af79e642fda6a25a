"""deploy/prometheus and deploy/grafana, checked by the real tools.

promtool checks the config and the rules and runs the rules' unit tests; a real
`prometheus` (empty, scraping nothing) evaluates every dashboard and rule expression;
and every metric name that the rules and the dashboard read must be in the metric
contract (deploy/prometheus/metrics.yaml), so a misspelt name cannot pass. The tool
tests skip when promtool/prometheus are missing, and fail instead in CI, where
.ci/run installs them and sets PDSERVE_REQUIRE_PROMETHEUS=1.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from promql import (
    CONTRACT,
    DASHBOARD,
    PROMETHEUS_DIR,
    ROOT,
    RULES_DIR,
    PrometheusServer,
    PromQLError,
    alert_as_bool,
    dashboard_expressions,
    dashboard_variables,
    exposed_le,
    find_binary,
    iter_panels,
    load_contract,
    load_rules,
    metric_names,
    rule_expressions,
    write_config,
)

CONFIG = PROMETHEUS_DIR / "prometheus.yml"
RULE_FILES = sorted(RULES_DIR.glob("*.yml"))
RULE_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))
DOCS = ROOT / "docs" / "observability.md"


def run_promtool(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([find_binary("promtool"), *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def assert_ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, f"{' '.join(proc.args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"


# --- promtool --------------------------------------------------------------------------

def test_promtool_check_config() -> None:
    """The config is valid and its rule_files glob loads every rule file."""
    proc = run_promtool("check", "config", CONFIG)
    assert_ok(proc)
    checked = {Path(line.split(" ", 1)[1]).name for line in proc.stdout.splitlines() if line.startswith("Checking ")}
    assert {f.name for f in RULE_FILES} <= checked, "a rule file not loaded by prometheus.yml"


def test_promtool_check_rules() -> None:
    assert RULE_FILES
    assert_ok(run_promtool("check", "rules", *RULE_FILES))


@pytest.mark.parametrize("test_file", RULE_TESTS, ids=lambda p: p.name)
def test_promtool_rule_unit_tests(test_file: Path) -> None:
    assert_ok(run_promtool("test", "rules", test_file))


# --- a real Prometheus -----------------------------------------------------------------

@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusServer]:
    """An empty Prometheus: nothing scraped, so every query parses and evaluates to nothing."""
    tmp = tmp_path_factory.mktemp("prometheus")
    with PrometheusServer(write_config(tmp / "prometheus.yml"), tmp / "data", binary=find_binary("prometheus"),
                          ready_timeout_s=60) as server:
        yield server


def test_dashboard_expressions_evaluate(prometheus: PrometheusServer) -> None:
    exprs = dashboard_expressions(DASHBOARD)
    assert len(exprs) >= 40
    for expr in exprs:
        data = prometheus.query(expr)
        assert data["resultType"] in ("vector", "scalar"), expr


def test_rule_expressions_evaluate(prometheus: PrometheusServer) -> None:
    """The recording rules as they are, and the alerts as rule_expressions() rewrites them."""
    exprs = rule_expressions(RULES_DIR)
    assert len(exprs) == len(load_rules(RULES_DIR))
    for expr in exprs:
        assert prometheus.query(expr)["resultType"] == "vector", expr


def test_bool_alerts_return_data_where_the_plain_ones_do_not(prometheus: PrometheusServer) -> None:
    """What the integration test relies on: `x > bool 0.95` answers 0 where `x > 0.95` answers nothing."""
    expr = 'label_replace(vector(0.5), "worker", "w0", "", "") > 0.95'
    assert prometheus.query(expr)["result"] == []
    assert [float(r["value"][1]) for r in prometheus.query(alert_as_bool(expr))["result"]] == [0.0]


def test_a_bad_expression_is_reported(prometheus: PrometheusServer) -> None:
    with pytest.raises(PromQLError, match="bad_data"):
        prometheus.query("sum by (le (rate(x[5m]))")


def test_a_prometheus_that_cannot_start_is_reported_and_stopped(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yml"
    bad.write_text("scrape_configs: [{job_name: x, static_configs: [{targets: [':::']}]}]\nnot_a_key: 1\n")
    server = PrometheusServer(bad, tmp_path / "data", binary=find_binary("prometheus"), ready_timeout_s=30)
    with pytest.raises(RuntimeError, match="exited"):
        server.start()
    assert server.proc is None


# --- names, against the contract --------------------------------------------------------

CONTRACT_METRICS = load_contract(CONTRACT)
RULES = load_rules(RULES_DIR)
RECORDED = {r.name for r in RULES if r.kind == "record"}
EXPOSED = {name for m in CONTRACT_METRICS.values() for name in m.series_names()}
PROMETHEUS_OWN = {"up"}  # set by Prometheus per target


def test_contract_is_well_formed() -> None:
    for m in CONTRACT_METRICS.values():
        assert m.name.startswith("pdserve:"), m.name
        assert m.type in ("counter", "gauge", "histogram"), m.name
        assert (m.type == "counter") == m.name.endswith("_total"), m.name
        assert bool(m.buckets) == (m.type == "histogram"), m.name
        assert list(m.buckets) == sorted(m.buckets), m.name
    # The SLO thresholds the issue names are bucket bounds.
    assert {0.1, 0.25, 0.5, 1, 2.5} <= set(CONTRACT_METRICS["pdserve:time_to_first_token_seconds"].buckets)
    for h in ("pdserve:time_per_output_token_seconds", "pdserve:inter_token_latency_seconds"):
        assert {0.01, 0.025, 0.05, 0.1, 0.15, 0.2} <= set(CONTRACT_METRICS[h].buckets)


def test_rules_read_only_contract_metrics() -> None:
    for r in RULES:
        unknown = metric_names(r.expr) - EXPOSED - RECORDED - PROMETHEUS_OWN
        assert not unknown, f"{r.name} reads {sorted(unknown)}, not in {CONTRACT.name} nor recorded"


def test_dashboard_reads_only_contract_metrics() -> None:
    for expr in dashboard_expressions(DASHBOARD):
        unknown = metric_names(expr) - EXPOSED
        assert not unknown, f"dashboard query reads {sorted(unknown)}, not in {CONTRACT.name}: {expr}"


def test_metric_names_finds_every_selector() -> None:
    """The name check is only as good as the extraction: it sees through functions,
    grouping, matchers, ranges, offsets and numbers."""
    expr = ('histogram_quantile(0.99, sum by (le, pool) (rate(a:b_bucket{le="0.5", x=~"c:d"}[5m] offset 1h)))'
            ' / ignoring (position) group_left sum(c_total) + 1e-6 * {__name__="d"} and on (job) e > bool 2')
    assert metric_names(expr) == {"a:b_bucket", "c_total", "d", "e"}


def test_every_alert_reads_a_metric() -> None:
    for r in RULES:
        assert metric_names(r.expr), r.name


# --- rule conventions -----------------------------------------------------------------

def test_recording_names_follow_level_metric_operations() -> None:
    for name in RECORDED:
        assert re.fullmatch(r"pdserve:[a-z0-9_]+:[a-z0-9_]+", name), name
        assert name not in EXPOSED, f"{name} shadows an exported metric"


def test_alerts_have_severity_summary_and_description() -> None:
    alerts = [r for r in RULES if r.kind == "alert"]
    assert len(alerts) >= 10
    for a in alerts:
        assert a.name.startswith("Pdserve"), a.name
        assert a.labels.get("severity") in ("critical", "warning", "info"), a.name
        assert a.annotations.get("summary") and a.annotations.get("description"), a.name


def test_every_alert_is_unit_tested_firing_and_quiet() -> None:
    """Each alert appears in deploy/prometheus/tests with a case where it fires and one where it does not."""
    fires, quiet = set(), set()
    for f in RULE_TESTS:
        for case in yaml.safe_load(f.read_text())["tests"]:
            for t in case.get("alert_rule_test", ()):
                (fires if t.get("exp_alerts") else quiet).add(t["alertname"])
    alerts = {r.name for r in RULES if r.kind == "alert"}
    assert alerts - fires == set(), "never seen firing"
    assert alerts - quiet == set(), "never seen quiet"


SLO_HISTOGRAMS = {"ttft": "pdserve:time_to_first_token_seconds", "tpot": "pdserve:time_per_output_token_seconds"}


def test_slo_thresholds_are_bucket_bounds() -> None:
    """A `le` in a rule or dashboard query must be exported exactly so (1 s is le="1.0"),
    and each SLO uses one threshold throughout its rules."""
    thresholds: dict[str, set[str]] = {}
    exprs = [r.expr for r in RULES] + dashboard_expressions(DASHBOARD)
    for expr in exprs:
        for metric, le in re.findall(r'(pdserve:\w+)_bucket\{[^}]*\ble="([^"]+)"', expr):
            assert le in {exposed_le(b) for b in CONTRACT_METRICS[metric].buckets}, f'{metric} has no le="{le}"'
    for r in RULES:
        for slo, metric in SLO_HISTOGRAMS.items():
            if r.name.startswith(f"pdserve:{slo}_slo_"):
                thresholds.setdefault(slo, set()).update(re.findall(rf'{metric}_bucket\{{le="([^"]+)"\}}', r.expr))
    assert thresholds == {"ttft": {"0.5"}, "tpot": {"0.05"}}
    dash = json.loads(DASHBOARD.read_text())
    for var in dash["templating"]["list"]:
        if var["name"] in ("ttft_slo", "tpot_slo"):
            bounds = {exposed_le(b) for b in CONTRACT_METRICS[SLO_HISTOGRAMS[var["name"][:4]]].buckets}
            assert {o["value"] for o in var["options"]} <= bounds, var["name"]
            assert var["current"]["value"] == next(iter(thresholds[var["name"][:4]]))


# --- dashboard ---------------------------------------------------------------------------

DASH = json.loads(DASHBOARD.read_text())


def test_dashboard_is_generated_from_its_script() -> None:
    proc = subprocess.run([sys.executable, str(DASHBOARD.with_name("build_dashboard.py")), "--check"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_dashboard_datasource_and_variables() -> None:
    variables = {v["name"]: v for v in DASH["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("pool", "worker"):
        assert variables[name]["type"] == "query"
        assert variables[name]["query"].startswith("label_values(")
        assert variables[name]["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    assert DASH["schemaVersion"] >= 36  # Grafana 9.x+ / 10 schema
    dashboard_variables(DASH)  # every variable resolvable


def test_every_panel_uses_the_datasource_variable() -> None:
    panels = [p for p in iter_panels(DASH["panels"]) if p["type"] != "row"]
    assert len({p["id"] for p in iter_panels(DASH["panels"])}) == len(list(iter_panels(DASH["panels"])))
    for p in panels:
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]


def test_dashboard_covers_the_issue() -> None:
    exprs = "\n".join(dashboard_expressions(DASHBOARD))
    for metric in ("time_to_first_token_seconds_bucket", "time_per_output_token_seconds_bucket",
                   "inter_token_latency_seconds_bucket", "generation_tokens_total", "prompt_tokens_total",
                   "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "kv_transfer_bytes_total",
                   "kv_transfer_duration_seconds_bucket", "prefix_cache_hits_total",
                   "spec_decode_num_accepted_tokens_total", "spec_decode_num_accepted_tokens_per_pos_total",
                   "request_errors_total", "request_success_total", "router_decisions_total"):
        assert f"pdserve:{metric}" in exprs, metric
    slo_lines = [t["expr"] for p in iter_panels(DASH["panels"]) for t in p.get("targets", ())
                 if t.get("legendFormat") == "SLO"]
    assert slo_lines == ["vector($ttft_slo)", "vector($tpot_slo)", "vector($tpot_slo)"]


# --- docs and CI -------------------------------------------------------------------------

def test_docs_name_every_metric_rule_and_alert() -> None:
    text = DOCS.read_text()
    for name in [*CONTRACT_METRICS, *(r.name for r in RULES)]:
        assert f"`{name}`" in text, f"docs/observability.md does not mention `{name}`"


def test_ci_script_installs_prometheus_and_requires_it() -> None:
    script = ROOT / ".ci" / "run"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    assert "apt-get install" in text and "prometheus" in text
    assert "PDSERVE_REQUIRE_PROMETHEUS=1" in text
