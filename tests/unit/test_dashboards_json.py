"""The Grafana dashboards in charts/pdserve/dashboards: they load, and every metric a panel or
template variable names is one pdserve.metrics defines (histograms via _bucket/_sum/_count).
The live check (every panel's PromQL returns data from a real Prometheus) is in
test_prometheus_dashboards.py."""

import json
import re
from pathlib import Path

import pytest

from pdserve.metrics import METRICS, exported_series_names

DASHBOARDS = sorted((Path(__file__).resolve().parents[2] / "charts" / "pdserve" / "dashboards").glob("*.json"))
METRIC_RE = re.compile(r"\b(pdserve_[a-z0-9_]+)\b")
# a metric name followed by its selector: name{...}
SELECTOR_RE = re.compile(r"\b(pdserve_[a-z0-9_]+)\s*\{([^}]*)\}")


def load(path):
    return json.loads(path.read_text())


def panel_exprs(dash):
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            yield panel, target["expr"]


def variable_queries(dash):
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            yield var["name"], var["query"]["query"] if isinstance(var["query"], dict) else var["query"]


def test_there_are_dashboards_for_latency_and_kv():
    names = {p.name for p in DASHBOARDS}
    assert {"pdserve-latency.json", "pdserve-kv.json"} <= names


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure(path):
    dash = load(path)
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "inference_service"} <= set(variables)
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dash["panels"]:
        assert panel["title"] and panel["targets"], panel
        assert panel["datasource"]["uid"] == "${datasource}"
        g = panel["gridPos"]
        assert g["w"] > 0 and g["h"] > 0 and g["x"] + g["w"] <= 24
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids))


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_named_metric_is_defined(path):
    known = exported_series_names()
    dash = load(path)
    queries = [e for _, e in panel_exprs(dash)] + [q for _, q in variable_queries(dash)]
    named = {m for q in queries for m in METRIC_RE.findall(q)}
    assert named, "no pdserve metric named at all"
    unknown = named - known
    assert not unknown, f"{path.name} names metrics pdserve.metrics does not define: {sorted(unknown)}"


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_selector_honours_the_template_variables(path):
    for panel, expr in panel_exprs(load(path)):
        selectors = SELECTOR_RE.findall(expr)
        assert len(selectors) == len(METRIC_RE.findall(expr)), f"{panel['title']}: a metric without a selector: {expr}"
        for metric, sel in selectors:
            assert 'namespace=~"$namespace"' in sel, f"{panel['title']}: {metric} ignores $namespace"
            assert 'inference_service=~"$inference_service"' in sel, \
                f"{panel['title']}: {metric} ignores $inference_service"


def test_the_dashboards_cover_what_the_issue_asks_for():
    named = set()
    for path in DASHBOARDS:
        for _, expr in panel_exprs(load(path)):
            named |= set(METRIC_RE.findall(expr))
    base = {re.sub(r"_(bucket|sum|count)$", "", n) for n in named}
    for required in ("pdserve_time_to_first_token_seconds", "pdserve_time_between_tokens_seconds",
                     "pdserve_e2e_request_latency_seconds", "pdserve_generation_tokens_total",
                     "pdserve_kv_transfer_bytes_total", "pdserve_kv_transfer_layer_seconds", "pdserve_kv_blocks_used",
                     "pdserve_decode_selections_total", "pdserve_requests_total"):
        assert required in base, f"no panel shows {required}"
    exprs = " ".join(e for path in DASHBOARDS for _, e in panel_exprs(load(path)))
    for q in ("0.5", "0.9", "0.99"):
        assert f"histogram_quantile({q}, " in exprs
    # every metric defined is shown somewhere (a metric nobody can see is dead weight)
    unseen = {spec.name for spec in METRICS} - base
    assert not unseen, f"metrics no dashboard shows: {sorted(unseen)}"
