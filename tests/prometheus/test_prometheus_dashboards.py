"""Every panel of the Grafana dashboards returns data from a real Prometheus scraping a live
local P/D cluster under load.

The cluster: real `pdserve prefill` + two `pdserve decode` processes (tiny model) on
loopback, labelled through PDSERVE_INFERENCE_SERVICE; Prometheus (the Debian package's
binary, started by the test on a free port) scrapes all three every second, adding the
`namespace` label a Kubernetes ServiceMonitor would add. The load: the repository's own
load generator (`pdserve bench serving`'s send_requests) plus a few invalid requests. One
decode has a tiny KV pool and prefill uses round robin with one attempt and local
fallback, so refusals, retries and local fallbacks really happen and their panels have
data; the prefill has KV tiers (host, disk), so the tier panels have series; a second prefill
(SLO classes, its burst queues) is behind an API key, so the per-key panel has series. The GPU
row's panels read NVIDIA's dcgm-exporter: Prometheus also scrapes a recorded dcgm-exporter
/metrics (fixtures/dcgm_exporter.prom: GPUs of these servers' pods, as a ServiceMonitor labels
them with `pod`, and GPUs of other pods). Then every panel's PromQL (template variables
substituted) and every template variable query runs against Prometheus's HTTP API; each must
return data.
"""

import asyncio
import json
import math
import random
import re
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from pdserve.bench.experiments.cluster import SERVED_MODEL, start_decode, start_prefill
from pdserve.bench.experiments.launcher import Launcher
from pdserve.bench.loadgen import LoadConfig, send_requests
from pdserve.bench.loadgen_workload import RequestSpec, arrival_times, make_prompt_ids
from harness.conditions import HANG_GUARD_S, wait_until
from harness.decode_gate import DecodeGate
from harness.pd_cluster import metric
from harness.prometheus import PrometheusServer, RecordedExporter
from pdserve.test_hooks import DECODE_GATE_ENV as TEST_GATE_ENV

pytestmark = [pytest.mark.prometheus, pytest.mark.slow]

DASHBOARDS = sorted((Path(__file__).resolve().parents[2] / "charts" / "pdserve" / "dashboards").glob("*.json"))
NAMESPACE, SERVICE = "pdtest", "obs-test"
# the second prefill's SLO classes: "strict" is missed by every request, "default" met by every one
SLO_CLASSES = {"ttftMs": 60000, "e2eMs": 60000, "classes": [{"name": "strict", "ttftMs": 1, "priority": 1}]}
# the second prefill is behind an API key (the per-key panel): the burst sends it, one request without it is refused
BURST_KEY = "sk-dashboards-burst-3c9a"
BURST_AUTH = {"Authorization": f"Bearer {BURST_KEY}"}
VARIABLES = {"$namespace": NAMESPACE, "$inference_service": SERVICE, "$__rate_interval": "2m"}
DCGM_FIXTURE = Path(__file__).parent / "fixtures" / "dcgm_exporter.prom"
# the `pod` label a ServiceMonitor gives each server's series: the pod names the recorded dcgm-exporter's GPUs carry
PODS = {"prefill": "obs-test-prefill-7c9d5b8f6-k2x7p", "decode-small": "obs-test-decode-small-6b8c9d7f5-w9p3r",
        "decode-big": "obs-test-decode-big-5f6d8c7b9-q4m8n", "prefill-slo": "obs-test-prefill-slo-84d6c9f7b-t5v2z"}


def panels(dash: dict):
    """Every panel that queries (rows are headings; a collapsed row holds its panels)."""
    for panel in dash["panels"]:
        if panel["type"] == "row":
            yield from panel.get("panels", [])
        else:
            yield panel


def substitute(expr: str) -> str:
    for var, value in VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def has_data(result: list) -> bool:
    """At least one series with a real number (NaN means a histogram with no observations)."""
    return any(not math.isnan(float(series["value"][1])) for series in result)


async def slo_burst(url: str) -> list[int]:
    """Six requests at once through a prefill whose only decode holds a few: the others wait in its
    SLO queue (qlm orders them); half of them in the class 'strict'. (The decode's test gate holds
    those it took until the others queued: on a fast CPU they would finish first.)"""
    import aiohttp

    async def one(session, i):
        body = {"model": SERVED_MODEL, "prompt": [7] * 100, "max_tokens": 16, "ignore_eos": True, "priority": i % 2}
        async with session.post(url + "/v1/completions", json=body, headers=BURST_AUTH) as resp:
            await resp.read()
            return resp.status

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        return await asyncio.gather(*(one(session, i) for i in range(6)))


def post_status(url: str, max_tokens: int) -> int:
    """The status of a /v1/completions with no header but its content type (max_tokens -1: a bad request)."""
    body = json.dumps({"model": SERVED_MODEL, "prompt": "x", "max_tokens": max_tokens}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        urllib.request.urlopen(req, timeout=10)
    except urllib.error.HTTPError as e:
        return e.code
    return 200


@pytest.fixture(scope="module")
def loaded_cluster(tmp_path_factory):
    """(prefill server, prometheus) after the load went through the cluster (once per module)."""
    tmp_path = tmp_path_factory.mktemp("dashboards")
    env = pytest.MonkeyPatch()
    env.setenv("PDSERVE_INFERENCE_SERVICE", SERVICE)  # inherited by the servers
    try:
        with Launcher(tmp_path / "logs") as launcher:
            # the small decode behind a gate (open until the SLO burst): the burst's first requests hold its
            # blocks until the others queued at the prefill (on a fast CPU they would finish first)
            gate = DecodeGate(tmp_path / "small-decode-gate", opened=True)
            env.setenv(TEST_GATE_ENV, str(gate.directory))
            small = start_decode(launcher, "decode-small", "tiny", threads=1, num_blocks=6)
            env.delenv(TEST_GATE_ENV)
            big = start_decode(launcher, "decode-big", "tiny", threads=1, num_blocks=128)
            # KV tiers on the prefill, so that the tier panels have series (zero or not)
            prefill = start_prefill(launcher, "prefill", "tiny", [small, big], threads=1, local_fallback=True,
                                    extra=["--policy", "rr", "--max-attempts", "1", "--kv-host-tier-bytes", "1MiB",
                                           "--kv-disk-tier-dir", str(tmp_path / "kv-disk"),
                                           "--kv-disk-tier-bytes", "4MiB"])
            # a second front door without local fallback, so that requests queue (the SLO panels), behind an API key
            keys = tmp_path / "api-keys"
            keys.write_text(f"burst:{BURST_KEY}\n")
            slo_prefill = start_prefill(launcher, "prefill-slo", "tiny", [small], threads=1, extra=[
                "--max-attempts", "1", "--queue-policy", "qlm", "--slo-classes", json.dumps(SLO_CLASSES),
                "--api-key-file", str(keys)])
            targets = [(name, server.url.removeprefix("http://"), {"namespace": NAMESPACE, "pod": PODS[name]})
                       for name, server in (("prefill", prefill), ("decode-small", small), ("decode-big", big),
                                            ("prefill-slo", slo_prefill))]
            with RecordedExporter(DCGM_FIXTURE.read_text()) as dcgm, \
                    PrometheusServer(tmp_path / "prom", [*targets, ("dcgm-exporter", dcgm.target, {})],
                                     interval=1.0) as prom:
                prom.wait_for_targets_up(5)
                rng = random.Random(0)
                # mostly short requests; every fifth a 500-token prompt the small decode (6 blocks) refuses
                specs = [RequestSpec(n, 16, prompt_ids=make_prompt_ids(n, rng, 256))
                         for n in (500 if i % 5 == 4 else rng.randint(20, 150) for i in range(40))]
                config = LoadConfig(url=prefill.url, model=SERVED_MODEL, progress=False, request_timeout=120)
                results, _ = asyncio.run(send_requests(config, specs, arrivals=arrival_times(40, 8.0, "poisson", rng)))
                failed = [r.error for r in results if not r.ok]
                assert not failed, failed[:3]
                assert [post_status(prefill.url, -1) for _ in range(3)] == [400] * 3
                assert post_status(slo_prefill.url, 1) == 401  # no key: the refusals' series
                gate.close()
                burst: list = []
                sender = threading.Thread(target=lambda: burst.extend(asyncio.run(slo_burst(slo_prefill.url))))
                sender.start()
                gate.wait_held(1)
                # those the small decode's 6 blocks take are held there, the others wait in the SLO queue:
                # qlm decides who goes next when the gate opens
                wait_until(lambda: (waiting := metric(slo_prefill.url, "pdserve_slo_queued")) >= 1
                           and len(gate.held()) + waiting == 6, "the burst held on the decode or in the SLO queue")
                gate.open()
                sender.join(HANG_GUARD_S)
                assert burst == [200] * 6
                prom.wait_for_scrapes(2, since=time.time())  # every server scraped twice after the load
                yield prefill, prom
    finally:
        env.undo()


def test_every_panel_returns_data(loaded_cluster):
    _, prom = loaded_cluster
    empty = []
    checked = 0
    for path in DASHBOARDS:
        dash = json.loads(path.read_text())
        for panel in panels(dash):
            for target in panel["targets"]:
                expr = substitute(target["expr"])
                checked += 1
                if not has_data(prom.query(expr)):
                    empty.append(f"{path.name} / {panel['title']} / {target.get('legendFormat', '')}: {expr}")
    assert checked >= 20
    assert not empty, "panels without data:\n" + "\n".join(empty)


def test_template_variables_find_the_cluster(loaded_cluster):
    _, prom = loaded_cluster
    for path in DASHBOARDS:
        for var in json.loads(path.read_text())["templating"]["list"]:
            if var["type"] != "query":
                continue
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", var["query"]["query"])
            assert m, f"{var['name']}: expected label_values(selector, label)"
            selector, label = substitute(m.group(1)), m.group(2)
            values = prom.api(f"label/{label}/values", **{"match[]": selector})
            assert {"namespace": NAMESPACE, "inference_service": SERVICE}[var["name"]] in values


def test_the_slo_burst_queued_and_was_judged_by_class(loaded_cluster):
    _, prom = loaded_cluster
    sel = f'namespace="{NAMESPACE}", job="prefill-slo"'

    def value(expr):
        return sum(float(s["value"][1]) for s in prom.query(expr))

    assert value(f'sum(pdserve_slo_attainment_total{{{sel}, slo_class="strict", target="ttft", result="missed"}})') == 3
    assert value(f'sum(pdserve_slo_attainment_total{{{sel}, slo_class="default", target="all", result="met"}})') == 3
    assert value(f'sum(pdserve_slo_policy_seconds_count{{{sel}}})') >= 1  # requests waited: qlm decided
    assert value(f'sum(pdserve_slo_queued{{{sel}}})') == 0


def test_dashboard_metrics_are_exported_by_the_servers(loaded_cluster):
    _, prom = loaded_cluster
    exported = set(prom.api("label/__name__/values"))
    named = set()
    for path in DASHBOARDS:
        for panel in panels(json.loads(path.read_text())):
            for target in panel["targets"]:
                named |= set(re.findall(r"\bpdserve_[a-z0-9_]+\b", target["expr"]))
    assert not named - exported, f"named by a panel but not scraped from any server: {sorted(named - exported)}"


def test_load_shows_up_in_the_headline_panels(loaded_cluster):
    _, prom = loaded_cluster
    sel = f'namespace="{NAMESPACE}", inference_service="{SERVICE}", job!="prefill-slo"'

    def value(expr):
        r = prom.query(expr)
        return sum(float(s["value"][1]) for s in r)

    by_outcome = {f'{r["metric"].get("outcome")}/{r["metric"].get("reason")}': float(r["value"][1])
                  for r in prom.query(f'sum by (outcome, reason) (pdserve_requests_total{{{sel}, role="prefill"}})')}
    assert value(f'sum(pdserve_requests_total{{{sel}, role="prefill", outcome="ok"}})') == 40, by_outcome
    assert value(f'sum(pdserve_requests_total{{{sel}, role="prefill", reason="bad_request"}})') == 3
    assert value(f'sum(pdserve_generation_tokens_total{{{sel}, role="prefill"}})') == 40 * 16
    assert value(f'sum(pdserve_kv_allocation_refusals_total{{{sel}, role="decode"}})') >= 1
    assert value(f'sum(pdserve_local_fallbacks_total{{{sel}}})') >= 1
    assert value(f'sum(pdserve_decode_selections_total{{{sel}}})') >= 40
    assert value(f'sum(pdserve_kv_transfer_bytes_total{{{sel}, role="prefill"}})') > 0


def recorded_gpus(metric: str) -> dict[tuple[str, str, str], float]:
    """(namespace, pod, gpu) -> value of `metric` in the recorded dcgm-exporter output."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.labels["namespace"], s.labels["pod"], s.labels["gpu"]): s.value
            for family in text_string_to_metric_families(DCGM_FIXTURE.read_text()) for s in family.samples
            if s.name == metric}


def test_the_gpu_row_shows_the_gpus_of_the_services_pods_and_no_others(loaded_cluster):
    """Each GPU panel's series are exactly the GPUs dcgm-exporter maps to this InferenceService's pdserve pods,
    with their role and the recorded values (in the panel's unit): not another team's pod's GPU, not a
    non-pdserve pod's in the same namespace, not an idle GPU; with $namespace = All too."""
    _, prom = loaded_cluster
    dash = json.loads((DASHBOARDS[0].parent / "pdserve-latency.json").read_text())
    gpu_panels = {p["title"]: p for p in panels(dash) if "DCGM_FI_DEV_" in p["targets"][0]["expr"]}
    assert set(gpu_panels) == {"GPU utilisation", "GPU memory used and free", "GPU power", "GPU SM clock"}
    roles = {pod: "prefill" if name.startswith("prefill") else "decode" for name, pod in PODS.items()}
    recorded = recorded_gpus("DCGM_FI_DEV_GPU_UTIL")
    ours = {key for key in recorded if key[0] == NAMESPACE and key[1] in roles}
    assert len(ours) == 4 and len(recorded) == 7  # three GPUs to leave out
    for namespace in (NAMESPACE, ".*"):
        for panel in gpu_panels.values():
            for target in panel["targets"]:
                expr = target["expr"].replace("$namespace", namespace)
                metric = re.search(r"DCGM_FI_DEV_[A-Z_]+", expr).group(0)
                scale = {"DCGM_FI_DEV_FB_USED": 1 << 20, "DCGM_FI_DEV_FB_FREE": 1 << 20,
                         "DCGM_FI_DEV_SM_CLOCK": 1e6}.get(metric, 1)
                got = {(s["metric"]["namespace"], s["metric"]["pod"], s["metric"]["gpu"]): (s["metric"]["role"],
                       float(s["value"][1])) for s in prom.query(substitute(expr))}
                want = {key: (roles[key[1]], value * scale)
                        for key, value in recorded_gpus(metric).items() if key in ours}
                assert got == want, f"{panel['title']} ($namespace={namespace}): {expr}"
