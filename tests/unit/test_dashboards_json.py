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


def panels(dash):
    """Every panel that queries (rows are headings; a collapsed row holds its panels)."""
    for panel in dash["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def panel_exprs(dash):
    for panel in panels(dash):
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
    rows = [p for p in dash["panels"] if p["type"] == "row"]
    ids = [p["id"] for p in [*rows, *panels(dash)]]
    assert len(ids) == len(set(ids))
    for row in rows:
        assert row["title"] and "targets" not in row and row["gridPos"]["w"] == 24, row
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "inference_service"} <= set(variables)
    assert variables["datasource"]["query"] == "prometheus"
    for panel in panels(dash):
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


DCGM_RE = re.compile(r"\b(DCGM_FI_DEV_[A-Z_]+)\s*\{([^}]*)\}")
# a GPU's series joined to the pdserve pod holding it (dcgm-exporter's pod mapping labels it namespace/pod)
POD_JOIN = ("* on (namespace, pod) group_left (role) group by (namespace, pod, role) "
            '(pdserve_requests_running{namespace=~"$namespace", inference_service=~"$inference_service"})')


def test_the_gpu_row_reads_dcgm_for_the_services_pods():
    """The latency dashboard's GPU row: utilisation, framebuffer used and free, power, SM clock from dcgm-exporter,
    each series kept only for the pods of the selected InferenceServices (the live check with recorded DCGM
    samples is in tests/prometheus/test_prometheus_dashboards.py)."""
    dash = load(next(p for p in DASHBOARDS if p.name == "pdserve-latency.json"))
    (row,) = [p for p in dash["panels"] if p["type"] == "row"]
    assert "DCGM" in row["title"]
    gpu = [(panel, expr) for panel, expr in panel_exprs(dash) if "DCGM_FI_DEV_" in expr]
    named = {m for _, expr in gpu for m, _ in DCGM_RE.findall(expr)}
    assert named == {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_POWER_USAGE",
                     "DCGM_FI_DEV_SM_CLOCK"}
    for panel, expr in gpu:
        assert panel["gridPos"]["y"] > row["gridPos"]["y"], f"{panel['title']} is not under the GPU row"
        assert expr.endswith(POD_JOIN), f"{panel['title']}: not joined to the service's pods: {expr}"
        for metric, sel in DCGM_RE.findall(expr):
            assert sel == 'namespace=~"$namespace"', f"{panel['title']}: {metric}{{{sel}}}"
