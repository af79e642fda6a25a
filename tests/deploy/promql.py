"""PromQL from deploy/: the expressions of the Grafana dashboard and of the Prometheus
rules, the metric names they read, and a real `prometheus` to run them against.

Used by tests/deploy/test_prometheus_config.py (no pdserve running: every expression
must parse and evaluate) and meant for an integration test that scrapes a running
pdserve and expects data from each expression:

    with PrometheusServer(write_config(tmp_path / "p.yml", targets=["127.0.0.1:8000"]),
                          tmp_path / "data") as prom:
        for expr in dashboard_expressions(DASHBOARD) + rule_expressions(RULES_DIR):
            assert prom.query(expr)["result"], expr

Nothing here imports pdserve.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
RULES_DIR = PROMETHEUS_DIR / "rules"
CONTRACT = PROMETHEUS_DIR / "metrics.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve-dashboard.json"

# Set in CI (.ci/run): a missing promtool/prometheus fails the tests instead of skipping them.
REQUIRE_ENV = "PDSERVE_REQUIRE_PROMETHEUS"

# Grafana's built-in interval variables, as an integration test with a short scrape
# interval wants them.
BUILTIN_VARIABLES = {
    "__rate_interval": "1m",
    "__interval": "1m",
    "__interval_ms": "60000",
    "__range": "1h",
    "__range_s": "3600",
    "__range_ms": "3600000",
}


def find_binary(name: str) -> str:
    """The path of `name` on PATH; skips the calling test when it is missing, or fails it
    when PDSERVE_REQUIRE_PROMETHEUS=1 (CI installs Debian's `prometheus` package)."""
    import pytest

    path = shutil.which(name)
    if path is None:
        msg = f"`{name}` not found on PATH (Debian: apt-get install prometheus)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{msg}, and {REQUIRE_ENV}=1")
        pytest.skip(msg)
    return path


# --- the metric contract -------------------------------------------------------------

@dataclass(frozen=True)
class Metric:
    name: str
    type: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    def series_names(self) -> tuple[str, ...]:
        """The names this metric has in an exposition (a histogram has three)."""
        if self.type == "histogram":
            return (f"{self.name}_bucket", f"{self.name}_sum", f"{self.name}_count")
        return (self.name,)


def load_contract(path: Path = CONTRACT) -> dict[str, Metric]:
    doc = yaml.safe_load(path.read_text())
    metrics = {}
    for m in doc["metrics"]:
        metrics[m["name"]] = Metric(m["name"], m["type"], tuple(m["labels"]), tuple(m.get("buckets", ())))
    return metrics


def exposed_le(bound: float) -> str:
    """A bucket bound as prometheus_client writes it in `le` (and Prometheus 2 keeps it):
    0.5 -> "0.5", 1 -> "1.0"."""
    from prometheus_client.utils import floatToGoString

    return floatToGoString(bound)


# --- rules ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Rule:
    kind: str  # "record" | "alert"
    name: str
    expr: str
    group: str
    file: Path
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    for_: str | None = None


def load_rules(directory: Path = RULES_DIR) -> list[Rule]:
    """Every rule of every *.yml / *.yaml rule file in `directory`, in file order."""
    rules = []
    for path in sorted(list(directory.glob("*.yml")) + list(directory.glob("*.yaml"))):
        for group in yaml.safe_load(path.read_text())["groups"]:
            for r in group["rules"]:
                kind = "record" if "record" in r else "alert"
                rules.append(Rule(kind, r[kind], r["expr"].strip(), group["name"], path,
                                  dict(r.get("labels") or {}), dict(r.get("annotations") or {}), r.get("for")))
    return rules


def rule_expressions(directory: Path = RULES_DIR) -> list[str]:
    """Recording rules' expressions as they are; alert expressions with their top-level
    comparisons made `bool`, so each returns a sample (0 or 1) wherever its metrics exist,
    whether or not the alert would fire."""
    return [r.expr if r.kind == "record" else alert_as_bool(r.expr) for r in load_rules(directory)]


# --- dashboard -----------------------------------------------------------------------

def iter_panels(panels: Sequence[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested panels included."""
    for p in panels:
        yield p
        yield from iter_panels(p.get("panels", ()))


def dashboard_variables(dashboard: dict[str, Any]) -> dict[str, str]:
    """Each template variable's value for a test: a query variable matches any value
    (its allValue, else `.+`); a custom or constant one keeps its current value."""
    values = {}
    for v in dashboard.get("templating", {}).get("list", ()):
        if v["type"] == "datasource":
            continue
        if v["type"] == "query":
            values[v["name"]] = v.get("allValue") or ".+"
        else:
            current = v.get("current", {}).get("value")
            if isinstance(current, list):
                current = current[0] if current else None
            if current in (None, "", "$__all"):
                current = v.get("allValue") or ".+"
            values[v["name"]] = str(current)
    return values


_VAR = re.compile(r"\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)")


def substitute(expr: str, values: dict[str, str]) -> str:
    """Replace $var, ${var}, ${var:fmt} and [[var]]; an unknown variable raises KeyError."""
    known = {**BUILTIN_VARIABLES, **values}

    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2) or m.group(3)
        if name not in known:
            raise KeyError(f"undefined dashboard variable ${name} in {expr!r}")
        return known[name]

    return _VAR.sub(one, expr)


_LABEL_VALUES = re.compile(r"^\s*label_values\(\s*(?:(.*?)\s*,\s*)?(\w+)\s*\)\s*$", re.S)


def variable_query_as_promql(query: str) -> str | None:
    """A Grafana Prometheus variable query as the PromQL it runs:
    label_values(sel, label) -> group by (label) (sel); query_result(e) -> e."""
    m = _LABEL_VALUES.match(query)
    if m:
        selector, label = m.group(1), m.group(2)
        if not selector:
            selector = f'{{{label}!=""}}'
        return f"group by ({label}) ({selector})"
    m = re.match(r"^\s*query_result\((.*)\)\s*$", query, re.S)
    return m.group(1) if m else None


def dashboard_expressions(path: Path = DASHBOARD, *, include_variables: bool = True) -> list[str]:
    """Every PromQL expression of the dashboard (panel targets, and with
    include_variables the variables' label_values queries), variables substituted."""
    dashboard = json.loads(Path(path).read_text())
    values = dashboard_variables(dashboard)
    exprs = []
    if include_variables:
        for v in dashboard.get("templating", {}).get("list", ()):
            if v["type"] != "query":
                continue
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            promql = variable_query_as_promql(q)
            if promql is None:
                raise ValueError(f"variable {v['name']}: unsupported query {q!r}")
            exprs.append(substitute(promql, values))
    for panel in iter_panels(dashboard.get("panels", ())):
        for target in panel.get("targets", ()):
            if target.get("expr"):
                exprs.append(substitute(target["expr"], values))
    return exprs


# --- PromQL text ---------------------------------------------------------------------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"' r"|'(?:[^'\\]|\\.)*'" r"|`[^`]*`")
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_COMPARISON = ("==", "!=", "<=", ">=", "<", ">")
_SET_OPS = ("and", "or", "unless")
_MODIFIERS = re.compile(r"\s*(?:(bool)\b)?\s*(?:(?:on|ignoring)\s*\([^)]*\))?"
                        r"\s*(?:(?:group_left|group_right)\b\s*(?:\([^)]*\))?)?")


@dataclass(frozen=True)
class _Op:
    op: str
    start: int
    end: int  # past the operator and its bool/on/ignoring/group_* modifiers
    is_bool: bool


def _top_level_ops(expr: str) -> list[_Op]:
    """Comparison and set operators outside any (), {}, [] or string."""
    ops, depth, i = [], 0, 0
    while i < len(expr):
        c = expr[i]
        if c in "\"'`":
            m = _STRING.match(expr, i)
            i = m.end() if m else len(expr)
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        elif depth == 0:
            op = next((o for o in _COMPARISON if expr.startswith(o, i)), None)
            if op is None and _IDENT.match(expr, i) and (i == 0 or not re.match(r"[\w:.]", expr[i - 1])):
                word = _IDENT.match(expr, i).group()
                if word in _SET_OPS:
                    op = word
                else:
                    i += len(word)
                    continue
            if op is not None:
                mod = _MODIFIERS.match(expr, i + len(op))
                ops.append(_Op(op, i, mod.end(), bool(mod.group(1))))
                i = mod.end()
                continue
        i += 1
    return ops


def _strip_parens(expr: str) -> str:
    e = expr.strip()
    while e.startswith("(") and e.endswith(")"):
        depth = 0
        for i, c in enumerate(e):  # the first "(" must close at the very end
            depth += c == "("
            depth -= c == ")"
            if depth == 0 and i < len(e) - 1:
                return e
        e = e[1:-1].strip()
    return e


def alert_as_bool(expr: str) -> str:
    """`a > 1` -> `a > bool 1`, through `and`, `or` and the left side of `unless`, so
    that an alert expression returns 0/1 samples instead of filtering them out."""
    e = _strip_parens(expr)
    ops = _top_level_ops(e)
    for level in (("or",), ("and", "unless"), _COMPARISON):
        found = [o for o in ops if o.op in level]
        if not found:
            continue
        o = found[-1]  # all these operators are left-associative: the last one is outermost
        left, operator, right = e[:o.start], e[o.start:o.end], e[o.end:]
        if level == _COMPARISON:
            return e if o.is_bool else f"{left}{o.op} bool{operator[len(o.op):]}{right}"
        converted_right = right if o.op == "unless" else alert_as_bool(right)
        return f"({alert_as_bool(left)}) {operator.strip()} ({converted_right.strip()})"
    return e


_KEYWORDS = {"and", "or", "unless", "bool", "by", "without", "on", "ignoring", "group_left", "group_right",
             "offset", "inf", "nan", "start", "end"}


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects (by bare name or {__name__="..."})."""
    names = set(re.findall(r'__name__\s*=\s*"([^"]+)"', expr))
    e = _STRING.sub('""', expr)
    e = re.sub(r"\{[^{}]*\}", "{}", e)
    e = re.sub(r"\[[^\[\]]*\]", "[]", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    for m in re.finditer(r"(?<![\w:.])([a-zA-Z_:][\w:]*)(\s*\()?", e):
        word, is_call = m.group(1), m.group(2)
        if not is_call and word.lower() not in _KEYWORDS:
            names.add(word)
    return names


# --- a real Prometheus -----------------------------------------------------------------

class PromQLError(RuntimeError):
    """Prometheus answered a query with status "error"."""


def write_config(path: Path, *, targets: Sequence[str] = (), job: str = "pdserve",
                 scrape_interval: str = "1s", rule_files: Sequence[Path] = ()) -> Path:
    """A Prometheus config scraping `targets`' /metrics as `job` (none: no scrape config)."""
    config: dict[str, Any] = {"global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
                              "rule_files": [str(p) for p in rule_files], "scrape_configs": []}
    if targets:
        config["scrape_configs"].append({"job_name": job, "metrics_path": "/metrics",
                                         "static_configs": [{"targets": list(targets)}]})
    path.write_text(json.dumps(config, indent=2))  # JSON is YAML
    return path


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    """A `prometheus` process on a free 127.0.0.1 port for the length of a `with` block.

    Start waits for /-/ready until `ready_timeout_s` and raises (with the log's tail) if
    the process exits or the deadline passes; the process is killed on every way out.
    """

    def __init__(self, config: Path, data_dir: Path, *, binary: str = "prometheus",
                 ready_timeout_s: float = 30.0, extra_args: Sequence[str] = ()) -> None:
        self.config, self.data_dir, self.binary = Path(config), Path(data_dir), binary
        self.ready_timeout_s, self.extra_args = ready_timeout_s, tuple(extra_args)
        self.port: int | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.data_dir / "prometheus.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> PrometheusServer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        for attempt in range(3):  # another process may take the free port before prometheus binds it
            self.port = free_port()
            self._spawn()
            try:
                self._wait_ready()
                return
            except BaseException as e:
                self.stop()
                if not (isinstance(e, RuntimeError) and attempt < 2 and "address already in use" in self.log_tail()):
                    raise

    def _spawn(self) -> None:
        args = [self.binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.data_dir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}", *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready after {self.ready_timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.proc = None

    def log_tail(self, n: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def api(self, path: str, params: dict[str, str] | None = None, *, timeout_s: float = 10.0) -> Any:
        """The `data` of a GET of the HTTP API, e.g. api("rules") for /api/v1/rules;
        PromQLError if Prometheus answers with status "error"."""
        url = f"{self.url}/api/v1/{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                body = json.load(r)
        except urllib.error.HTTPError as e:  # 400/422/503 carry the error as JSON
            body = json.loads(e.read() or b"{}")
        if body.get("status") != "success":
            raise PromQLError(f"{body.get('errorType')}: {body.get('error')} ({path} {params or ''})")
        return body["data"]

    def query(self, expr: str, *, at: float | None = None, timeout_s: float = 10.0) -> dict[str, Any]:
        """The `data` of /api/v1/query ({"resultType", "result"}); PromQLError if the
        query fails (a parse error among others)."""
        params = {"query": expr}
        if at is not None:
            params["time"] = str(at)
        return self.api("query", params, timeout_s=timeout_s)
