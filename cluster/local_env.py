"""The environment local Ray starts with: what `pdserve serve` turns down on a node it starts.

Only where a variable is not set already (serve_app.init_ray), so an operator's value wins;
deploy/cluster.yaml exports the ones every node of a cluster needs.
"""

from __future__ import annotations

# Local Ray only: the gateway replica's drain on shutdown waits (30 s by
# default) for load balancers on other nodes to stop sending; here there are none.
# RAY_worker_niceness: Ray starts every worker process (the engines, the gateway replica, and
# haproxy, which its manager actor starts) at nice 15 by default, behind its own daemons and any
# other process on the node (a client, a benchmark); a serving node's workers are its point,
# so they run at 0 and Ray's control plane goes behind them (cluster/background_priority.py).
# RAY_SERVE_CONTROL_LOOP_INTERVAL_S: Serve's controller reconciles 10 times a second by default;
# on an idle 2-core node that loop took 4.7% of a core and the GCS it talks to 2.0%; at 0.5 s,
# 1.9% and 0.9% (docs/performance.md). One gateway deployment that never autoscales
# loses nothing but up to 0.4 s in noticing a dead replica (its health checks run every 10 s).
# Bookkeeping every Ray process does on a timer, which a serving node pays for on its engines'
# cores and nobody reads here (no dashboard, no Ray metrics of Serve's): per-handler event-loop
# statistics (RAY_event_stats), Serve's cached metrics flushed 10 times a second in the
# replica, its router and the proxy (1 s here; Ray exports metrics every 10 s), task events sent
# to the GCS every second (5 s: the state API lags by that), the raylet's look for a needed
# GC every 0.1 s (1 s). Together ~1.5% of a core of an idle 2-core node's ~15% (docs/performance.md).
# RAY_SERVE_HAPROXY_METRICS_ENABLED: HAProxy writes a syslog line per request that its manager
# actor parses into Serve's request metrics, which pdserve's gateway counts already (its own
# Prometheus families): ~85 us of CPU a request, over 6% of a one-token request's
# (docs/front-door.md).
# RAY_LOG_MONITOR_MANY_FILES_THRESHOLD, LOG_NAME_UPDATE_INTERVAL_S: the log monitor, which forwards
# the workers' output to `pdserve serve`'s console, globs the log directory 10 times a second while
# it holds under 1,000 files; here every 2 s (a new process's first lines reach the console up to
# 2 s later; none is lost: a file found late is read from its start). REPORTER_UPDATE_INTERVAL_MS:
# the dashboard agent reads every Ray process's CPU and memory every 5 s for a dashboard that is
# off here; once a minute. An idle server's processes took 8.6% of a core with both, 10.8% without
# (the log monitor 1.0 of it, the agent 0.9; docs/performance.md, "What an idle server costs").
LOCAL_ENV: dict[str, str] = {
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "1", "RAY_worker_niceness": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5", "RAY_event_stats": "0",
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000", "RAY_task_events_report_interval_ms": "5000",
    "RAY_raylet_check_gc_period_milliseconds": "1000", "RAY_SERVE_HAPROXY_METRICS_ENABLED": "0",
    "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "2",
    "REPORTER_UPDATE_INTERVAL_MS": "60000",
}


__all__ = ["LOCAL_ENV"]
