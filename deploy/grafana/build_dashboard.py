"""Writes pdserve-dashboard.json, the Grafana (10+) dashboard of a pdserve deployment.

    python deploy/grafana/build_dashboard.py           # rewrite the JSON
    python deploy/grafana/build_dashboard.py --check   # exit 1 if the JSON is stale

The panels are listed once, below, as (title, unit, queries); layout, ids and the
datasource wiring are derived. Edit here and rerun rather than editing the JSON; the
test suite (tests/deploy) fails while the two differ. Standard library only.

Every query reads the raw metrics of deploy/prometheus/metrics.yaml, not the recording
rules, so the dashboard works on a Prometheus without pdserve's rule files.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

OUT = Path(__file__).with_name("pdserve-dashboard.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"
GW = 'job=~"$job"'  # gateway series
WK = 'job=~"$job", pool=~"$pool", worker=~"$worker"'  # per-worker series
PL = 'job=~"$job", pool=~"$pool"'  # the gateway's per-pool series (no worker label)

# SLO thresholds offered in the dashboard: bucket bounds of the TTFT and TPOT
# histograms, written as the exporter writes `le` (1 s is "1.0").
TTFT_SLOS = ["0.1", "0.25", "0.5", "1.0", "2.5"]
TPOT_SLOS = ["0.01", "0.025", "0.05", "0.1", "0.15", "0.2"]
TTFT_SLO_DEFAULT, TPOT_SLO_DEFAULT = "0.5", "0.05"
OBJECTIVE = 0.99  # drawn as a line on the attainment panel; the alerts use the same


@dataclass
class Q:
    expr: str
    legend: str


@dataclass
class Panel:
    title: str
    unit: str
    queries: list[Q]
    description: str = ""
    kind: str = "timeseries"
    width: int = 8
    max: float | None = None
    threshold: float | None = None  # drawn as a dashed line
    good_above: bool = False  # the threshold is a floor (attainment), not a ceiling (usage)
    slo_series: bool = False  # the query with legend "SLO" is drawn as a red dashed line
    extra: dict[str, Any] = field(default_factory=dict)


def quantiles(metric: str, sel: str, by: str = "", ps: tuple[float, ...] = (0.5, 0.9, 0.99)) -> list[Q]:
    group = f"{by}, le" if by else "le"
    prefix = "{{" + by.replace(", ", "}} {{") + "}} " if by else ""
    return [Q(f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket{{{sel}}}[{RATE}])))",
              f"{prefix}p{round(p * 100)}") for p in ps]


def per_worker_ratio(num: str, den: str) -> str:
    return (f"sum by (pool, worker) (rate({num}{{{WK}}}[{RATE}]))"
            f" / sum by (pool, worker) (rate({den}{{{WK}}}[{RATE}]))")


ROWS: list[tuple[str, list[Panel]]] = [
    ("Latency and SLOs (gateway, whole deployment)", [
        Panel("Time to first token", "s",
              quantiles("pdserve:time_to_first_token_seconds", GW) + [Q("vector($ttft_slo)", "SLO")],
              "Request arrival at the gateway to the first token sent: queueing, prefill and KV transfer included. "
              "The dashed line is the TTFT SLO (variable ttft_slo).", slo_series=True),
        Panel("Time per output token", "s",
              quantiles("pdserve:time_per_output_token_seconds", GW) + [Q("vector($tpot_slo)", "SLO")],
              "Per request, (E2E - TTFT) / (output tokens - 1). The dashed line is the TPOT SLO (variable tpot_slo).",
              slo_series=True),
        Panel("Inter-token latency", "s",
              quantiles("pdserve:inter_token_latency_seconds", GW) + [Q("vector($tpot_slo)", "SLO")],
              "Gaps between tokens sent to clients, one observation per token. The dashed line is the TPOT SLO.",
              slo_series=True),
        Panel("SLO attainment", "percentunit", [
            Q(f'sum(rate(pdserve:time_to_first_token_seconds_bucket{{{GW}, le="$ttft_slo"}}[{RATE}]))'
              f" / sum(rate(pdserve:time_to_first_token_seconds_count{{{GW}}}[{RATE}]))", "TTFT <= $ttft_slo s"),
            Q(f'sum(rate(pdserve:time_per_output_token_seconds_bucket{{{GW}, le="$tpot_slo"}}[{RATE}]))'
              f" / sum(rate(pdserve:time_per_output_token_seconds_count{{{GW}}}[{RATE}]))", "TPOT <= $tpot_slo s"),
        ], f"Share of requests within each SLO, read exactly from the histogram bucket at the threshold. "
           f"The dashed line is the {OBJECTIVE:.0%} objective of the burn-rate alerts.",
              max=1, threshold=OBJECTIVE, good_above=True),
        Panel("End-to-end latency and queue time", "s",
              quantiles("pdserve:e2e_request_latency_seconds", GW, ps=(0.5, 0.99))
              + [Q(q.expr, "queue " + q.legend)
                 for q in quantiles("pdserve:request_queue_time_seconds", GW, ps=(0.5, 0.99))],
              "Arrival to last token, and the time spent in the first worker's scheduler queue."),
    ]),
    ("Throughput and load", [
        Panel("Token throughput", "short", [
            Q(f"sum(rate(pdserve:prompt_tokens_total{{{GW}}}[{RATE}]))", "prompt tokens/s"),
            Q(f"sum(rate(pdserve:generation_tokens_total{{{GW}}}[{RATE}]))", "generation tokens/s"),
        ], "Tokens per second over the deployment."),
        Panel("Requests in flight and queued (gateway)", "short", [
            Q(f"sum(pdserve:num_requests_in_flight{{{GW}}})", "in flight"),
            Q(f"sum(pdserve:num_requests_queued{{{GW}}})", "queued (no token yet)"),
        ], "Admitted and not finished; admitted with no token sent yet."),
        Panel("Workers up", "short", [Q(f"pdserve:worker_up{{{WK}}}", "{{worker}}")],
              "1 when the gateway's last metrics fetch from the worker succeeded within its deadline.",
              kind="stat", extra={"mappings": [{"type": "value", "options": {
                  "0": {"text": "DOWN", "color": "red", "index": 0},
                  "1": {"text": "up", "color": "green", "index": 1}}}]}),
        Panel("Running requests per pool", "short",
              [Q(f"sum by (pool) (pdserve:num_requests_running{{{WK}}})", "{{pool}}")],
              "Requests in the workers' running batches."),
        Panel("Waiting requests per pool", "short",
              [Q(f"sum by (pool) (pdserve:num_requests_waiting{{{WK}}})", "{{pool}}")],
              "Requests waiting to be scheduled; on decode workers, including those awaiting their KV."),
        Panel("Engine step time", "s",
              quantiles("pdserve:engine_step_duration_seconds", WK, by="pool", ps=(0.5, 0.99)),
              "Wall time of one engine step per pool."),
        Panel("Prefill tokens per step (mean)", "short",
              [Q(per_worker_ratio("pdserve:iteration_prefill_tokens_sum", "pdserve:iteration_prefill_tokens_count"),
                 "{{worker}}")], "Prompt tokens computed per engine step."),
        Panel("Decode batch size (mean)", "short",
              [Q(per_worker_ratio("pdserve:iteration_decode_batch_size_sum",
                                  "pdserve:iteration_decode_batch_size_count"),
                 "{{worker}}")], "Sequences decoded per engine step."),
    ]),
    ("KV cache", [
        Panel("KV cache usage per worker", "percentunit", [Q(f"pdserve:kv_cache_usage_perc{{{WK}}}", "{{worker}}")],
              "Used blocks / total blocks. The dashed line is the saturation alert's 95%.", max=1, threshold=0.95),
        Panel("Prefix-cache hit rate per worker", "percentunit",
              [Q(per_worker_ratio("pdserve:prefix_cache_hits_total", "pdserve:prefix_cache_queries_total"),
                 "{{worker}}")], "Prompt tokens found in the prefix cache / prompt tokens looked up.", max=1),
        Panel("Preemptions per worker", "short",
              [Q(f"sum by (pool, worker) (rate(pdserve:num_preemptions_total{{{WK}}}[{RATE}]))", "{{worker}}")],
              "Requests preempted per second (KV freed, recomputed later)."),
    ]),
    ("KV transfer (prefill to decode)", [
        Panel("KV transfer rate per worker", "Bps",
              [Q(f"sum by (pool, worker) (rate(pdserve:kv_transfer_bytes_total{{{WK}}}[{RATE}]))", "{{worker}}")],
              "KV bytes per second sent by each prefill worker (shown in GB/s at load)."),
        Panel("KV transfer latency", "s", quantiles("pdserve:kv_transfer_duration_seconds", WK),
              "One request's KV handoff, timed on the sending side."),
        Panel("KV transfer failures", "short",
              [Q(f"sum by (worker, kind) (rate(pdserve:kv_transfer_failures_total{{{WK}}}[{RATE}]))",
                 "{{worker}} {{kind}}")], "Failed handoffs per second by kind, on the side that saw the failure."),
    ]),
    ("Speculative decoding", [
        Panel("Draft acceptance rate per worker", "percentunit",
              [Q(per_worker_ratio("pdserve:spec_decode_num_accepted_tokens_total",
                                  "pdserve:spec_decode_num_draft_tokens_total"), "{{worker}}")],
              "Accepted draft tokens / proposed draft tokens.", max=1),
        Panel("Mean acceptance length", "short",
              [Q("1 + " + per_worker_ratio("pdserve:spec_decode_num_accepted_tokens_total",
                                           "pdserve:spec_decode_num_drafts_total"), "{{worker}}")],
              "Tokens emitted per verification pass (1 + accepted drafts per pass)."),
        Panel("Acceptance per draft position", "percentunit", [
            Q(f"sum by (position) (rate(pdserve:spec_decode_num_accepted_tokens_per_pos_total{{{WK}}}[{RATE}]))"
              f" / ignoring (position) group_left sum(rate(pdserve:spec_decode_num_drafts_total{{{WK}}}[{RATE}]))",
              "position {{position}}")],
              "Share of verification passes that accepted the draft token at each position.", max=1),
    ]),
    ("Reliability", [
        Panel("Workers live per pool", "short", [
            Q(f"min by (pool) (pdserve:pool_workers_live{{{PL}}})", "{{pool}} live"),
            Q(f"max by (pool) (pdserve:pool_workers_configured{{{PL}}})", "{{pool}} configured"),
        ], "Workers the gateway routes to now, and the workers each pool is deployed with. Live below configured "
           "for a minute is the PdservePoolDegraded alert."),
        Panel("Health", "short", [
            Q(f'pdserve:health_state{{{GW}, state="degraded"}}'
              f' + ignoring (state) 2 * pdserve:health_state{{{GW}, state="unavailable"}}', "{{instance}}")],
              "What /health reports: ok (every worker live), degraded (a pool short of workers, requests still "
              "served) or unavailable (no request can be served: 503).",
              kind="stat", extra={"mappings": [{"type": "value", "options": {
                  "0": {"text": "ok", "color": "green", "index": 0},
                  "1": {"text": "degraded", "color": "orange", "index": 1},
                  "2": {"text": "UNAVAILABLE", "color": "red", "index": 2}}}]}),
        Panel("Migrations", "short", [
            Q(f"sum(rate(pdserve:request_migrations_total{{{GW}}}[{RATE}]))", "tries moved/s"),
            Q(f"sum(rate(pdserve:request_migrations_exhausted_total{{{GW}}}[{RATE}]))", "failed after last try/s"),
            Q(f"sum(rate(pdserve:request_migration_resumed_tokens_total{{{GW}}}[{RATE}]))", "tokens resumed/s"),
        ], "Tries started because the previous try's worker died or its token stream broke; requests that failed "
           "after their last allowed try; output tokens the moved tries did not send again."),
        Panel("Worker events", "short", [
            Q(f"max(increase(pdserve:workers_lost_total{{{GW}}}[{RATE}]))", "lost"),
            Q(f"max(increase(pdserve:workers_readmitted_total{{{GW}}}[{RATE}]))", "readmitted"),
            Q(f"max(increase(pdserve:workers_restarted_total{{{GW}}}[{RATE}]))", "restarted"),
        ], "What the gateway saw happen to workers per interval: stopped answering, answered again, answered "
           "from a new process (restarted)."),
        Panel("Awaiting KV and expired leases", "short", [
            Q(f"sum by (worker) (pdserve:num_requests_awaiting_kv{{{WK}}})", "{{worker}} awaiting KV"),
            Q(f"sum by (worker) (increase(pdserve:kv_leases_expired_total{{{WK}}}[{RATE}]))",
              "{{worker}} leases expired"),
        ], "Decode workers: requests whose KV has not all arrived yet, and reservations released per interval "
           "because their KV did not come within the remote prefill's budget."),
        Panel("KV links lost and resynced", "short", [
            Q(f"sum by (worker) (increase(pdserve:kv_links_lost_total{{{WK}}}[{RATE}]))", "{{worker}} lost"),
            Q(f"sum by (worker) (increase(pdserve:kv_link_resyncs_total{{{WK}}}[{RATE}]))", "{{worker}} resynced"),
        ], "Prefill workers, per interval: KV links to decode workers lost after they were up (transfers in flight "
           "fail with peer_lost), and links that came back."),
        Panel("Token stream gaps and stale deltas", "short", [
            Q(f"sum(increase(pdserve:token_stream_gaps_total{{{GW}}}[{RATE}]))", "gaps"),
            Q(f"sum(increase(pdserve:token_stream_stale_deltas_total{{{GW}}}[{RATE}]))", "stale deltas"),
            Q(f"sum(increase(pdserve:token_stream_diverged_total{{{GW}}}[{RATE}]))", "diverged"),
        ], "Per interval, at the gateway: batches missing from a worker's token stream (their requests move on), "
           "deltas of tries given up on (dropped), and repeats of tokens the client has that differed from them "
           "(a recompute after the first token went out: the try moves on)."),
        Panel("Requests aborted for a gateway gone", "short", [
            Q(f"sum by (worker) (increase(pdserve:orphan_requests_aborted_total{{{WK}}}[{RATE}]))", "{{worker}}")],
              "Per interval: requests a worker aborted because the gateway they stream to was gone."),
    ]),
    ("Errors and routing", [
        Panel("Errors by code", "reqps",
              [Q(f"sum by (code) (rate(pdserve:request_errors_total{{{GW}}}[{RATE}]))", "{{code}}")],
              "Failed requests per second by HTTP status (or a stream's in-band error)."),
        Panel("Finished requests by reason", "reqps",
              [Q(f"sum by (finished_reason) (rate(pdserve:request_success_total{{{GW}}}[{RATE}]))",
                 "{{finished_reason}}")], "stop, length; failures are under errors by code."),
        Panel("Gateway HTTP requests", "reqps",
              [Q(f"sum by (endpoint, status) (rate(pdserve:gateway_requests_total{{{GW}}}[{RATE}]))",
                 "{{endpoint}} {{status}}")], "HTTP requests per second by endpoint and status."),
        Panel("Router decisions", "reqps",
              [Q(f"sum by (role, reason) (rate(pdserve:router_decisions_total{{{GW}}}[{RATE}]))",
                 "{{role}}: {{reason}}")], "Placements per second by role (prefill/decode) and reason."),
        Panel("Prompt tokens already cached at the chosen prefill worker", "percentunit", [
            Q(f"sum(rate(pdserve:router_cached_prompt_tokens_total{{{GW}}}[{RATE}]))"
              f" / sum(rate(pdserve:router_prompt_tokens_total{{{GW}}}[{RATE}]))", "cached share")],
              "By the router's index: the share of the prompt tokens it placed (each sample, each migrated try) "
              "that the chosen prefill worker already held.", max=1),
    ]),
]


def field_config(p: Panel) -> dict[str, Any]:
    steps: list[dict[str, Any]] = [{"color": "green", "value": None}]
    if p.threshold is not None:
        steps = ([{"color": "red", "value": None}, {"color": "green", "value": p.threshold}] if p.good_above
                 else steps + [{"color": "red", "value": p.threshold}])
    defaults: dict[str, Any] = {"unit": p.unit, "min": 0, "thresholds": {"mode": "absolute", "steps": steps},
                                "color": {"mode": "palette-classic"}, **p.extra}
    if p.max is not None:
        defaults["max"] = p.max
    if p.kind == "timeseries":
        defaults["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 0, "showPoints": "never",
                              "spanNulls": False, "axisSoftMin": 0,
                              "thresholdsStyle": {"mode": "dashed" if p.threshold is not None else "off"}}
    else:
        defaults["color"] = {"mode": "thresholds"}
    overrides = []
    if p.slo_series:
        overrides.append({"matcher": {"id": "byName", "options": "SLO"}, "properties": [
            {"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}},
            {"id": "custom.lineStyle", "value": {"fill": "dash", "dash": [10, 10]}}]})
    return {"defaults": defaults, "overrides": overrides}


def panel_json(p: Panel, pid: int, x: int, y: int, height: int) -> dict[str, Any]:
    refs = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    options: dict[str, Any] = (
        {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
         "tooltip": {"mode": "multi", "sort": "desc"}} if p.kind == "timeseries" else
        {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}, "colorMode": "background",
         "graphMode": "none", "justifyMode": "auto", "orientation": "auto", "textMode": "value_and_name"})
    return {
        "id": pid, "type": p.kind, "title": p.title, "description": p.description, "datasource": DS,
        "gridPos": {"h": height, "w": p.width, "x": x, "y": y},
        "fieldConfig": field_config(p), "options": options,
        "targets": [{"datasource": DS, "refId": refs[i], "expr": q.expr, "legendFormat": q.legend,
                     "range": True, "instant": False, "editorMode": "code"} for i, q in enumerate(p.queries)],
    }


def query_variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "query", "datasource": DS, "query": query, "definition": query,
            "refresh": 2, "includeAll": True, "multi": True, "allValue": ".+", "sort": 1, "hide": 0, "regex": "",
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": []}


def custom_variable(name: str, label: str, values: list[str], default: str, description: str) -> dict[str, Any]:
    return {"name": name, "label": label, "type": "custom", "query": ",".join(values), "description": description,
            "includeAll": False, "multi": False, "hide": 0,
            "current": {"selected": True, "text": default, "value": default},
            "options": [{"selected": v == default, "text": v, "value": v} for v in values]}


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y, height = 1, 0, 8
    for row_title, row_panels in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y, x = pid + 1, y + 1, 0
        for p in row_panels:
            if x + p.width > 24:
                x, y = 0, y + height
            panels.append(panel_json(p, pid, x, y, height))
            pid, x = pid + 1, x + p.width
        y += height
    templating = [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus", "hide": 0,
         "includeAll": False, "multi": False, "regex": "", "current": {}, "options": [], "refresh": 1},
        query_variable("job", "Job", "label_values(pdserve:worker_up, job)"),
        query_variable("pool", "Pool", 'label_values(pdserve:worker_up{job=~"$job"}, pool)'),
        query_variable("worker", "Worker", 'label_values(pdserve:worker_up{job=~"$job", pool=~"$pool"}, worker)'),
        custom_variable("ttft_slo", "TTFT SLO (s)", TTFT_SLOS, TTFT_SLO_DEFAULT,
                        "A bucket bound of pdserve:time_to_first_token_seconds, as exported (1 s is 1.0)"),
        custom_variable("tpot_slo", "TPOT SLO (s)", TPOT_SLOS, TPOT_SLO_DEFAULT,
                        "A bucket bound of pdserve:time_per_output_token_seconds"),
    ]
    return {
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
            {"type": "panel", "id": "stat", "name": "Stat", "version": ""},
        ],
        "uid": "pdserve-overview", "title": "pdserve", "description": "pdserve: SLOs, pools, KV cache and transfer, "
        "speculative decoding, reliability, errors and routing. Built by deploy/grafana/build_dashboard.py.",
        "tags": ["pdserve", "llm-serving"], "timezone": "browser", "editable": True, "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "30s", "schemaVersion": 38, "version": 1,
        "fiscalYearStartMonth": 0, "liveNow": False, "links": [], "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "templating": {"list": templating}, "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed JSON differs from this script's")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python deploy/grafana/build_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
