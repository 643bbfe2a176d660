"""Benchmark: the operator at scale on the kubelet tier, N `--engine sim` pods of one InferenceService.

    .venv/bin/python bench/tools/operator_scale.py --pods 20,50,100,200 --json OUT.json   (as root)

Starts the one-node cluster of the node tier (tests/harness/kube_node.py: kubelet, containerd,
kube-scheduler, kube-proxy on this machine; its pod capacity raised for the largest N and its rollout's
surge), helm-installs charts/pdserve (the operator runs as a pod), then for each N, in a fresh namespace:

1. apply: an InferenceService of N sim pods (`engine: {name: sim, simProfile: cpu-small}`, no CPU or
   memory requests): N/5 prefills, the rest over --decode-pools decode pools, and one router. Measured
   from the apply: every pod Ready (pods_ready_s), the InferenceService Ready (isvc_ready_s: a ready pod
   in every pool) and its status counting every pod ready (isvc_full_s); each pod's way from creation to
   scheduled, started and Ready, from its own timestamps (whole seconds);
2. kill: SIGKILL of one decode pod's server (its container's task in containerd): the time until the
   pod is not Ready, until its Deployment and until the InferenceService's status count one decode
   fewer (status_latency_s), and until the status counts all again (the kubelet restarts it);
3. rollout: spec.image set to another name of the same image (every pool and the router roll, the
   pools with --max-surge/--max-unavailable) while --clients short streams back to back and
   --long-clients 600-token ones go through the router's Service: the time until every pod runs the
   new image, Ready, and the status counts them all; the streams completed and lost;
4. the namespace deleted: the time until its pods are gone.
Every step records what the processes cost (/proc, by cmdline and cgroup): the sim servers' RSS and
PSS, the routers', containerd's shims', the operator's, kubelet's, containerd's, the control plane's;
CPU seconds per phase; MemAvailable and the load average.

A step runs only if it fits: its pods, surge included, within the pods' network (253 addresses), and
their memory (N x (1 + surge) x the bytes a pod took in the step before, or --guess-mib-per-pod) within
MemAvailable less --reserve-gib; and its time (the step before's, scaled by N) within --budget-min
since the start. The output names the steps not run and why. A benchmark, not a test: nothing is
asserted but the phases' hang guards. Needs root and the node tier's tools (make k8s-tools, make image).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from bench.provenance import run_start, write_json  # noqa: E402
from harness import node_serving  # noqa: E402
from harness.kube_node import node_cluster  # noqa: E402
from bench.tools.cluster_procs import cpu_spent, machine_now, processes, summary  # noqa: E402
from harness.kube_node_config import MAX_PODS  # noqa: E402
from harness.node_streams import Streams  # noqa: E402

ISVC = "scale"
SIM_ENGINE = {"name": "sim", "simProfile": "cpu-small"}
LONG_TOKENS = 600
POLL_S = 1.0        # between two looks at the pods (a list of every pod of the namespace)
FAST_POLL_S = 0.1   # between two looks at one pod, one Deployment and the InferenceService (after the kill)
OTHER_PODS = 4      # besides the pools' pods, at most: the router and its surge pod, the operator, one spare
MIB = 2**20


# ---------------------------------------------------------------------------------------------- the spec

def shape(pods: int, decode_pools: int) -> tuple[int, list[int]]:
    """(prefills, replicas of each decode pool) for `pods` sim pods: a fifth prefills (at least one), the
    rest spread over at most `decode_pools` pools (at least one pod each)."""
    if pods < 2:
        raise ValueError(f"--pods {pods}: an InferenceService needs at least a prefill and a decode pod")
    prefills = max(1, round(pods / 5))
    decodes = pods - prefills
    n = max(1, min(decode_pools, decodes))
    return prefills, [decodes // n + (1 if i < decodes % n else 0) for i in range(n)]


def rollout_pods(value: str, replicas: int, round_up: bool) -> int:
    """The pods a rollout field means for a pool of `replicas`: a count as it is, a percentage of the pool
    rounded as a Deployment rounds it (maxSurge up, maxUnavailable down)."""
    if not value.endswith("%"):
        return int(value)
    share = replicas * int(value[:-1]) / 100
    return math.ceil(share) if round_up else math.floor(share)


def service(image: str, pods: int, decode_pools: int, rollout: dict) -> dict:
    prefills, decodes = shape(pods, decode_pools)
    pool = {"engine": SIM_ENGINE, "rollout": rollout}
    return {
        "apiVersion": "pdserve.io/v1alpha1", "kind": "InferenceService", "metadata": {"name": ISVC},
        "spec": {"model": {"source": "builtin:tiny"}, "image": image, "router": {"replicas": 1},
                 "prefill": {"replicas": prefills, **pool},
                 "decode": [{"name": f"d{i}", "replicas": r, **pool} for i, r in enumerate(decodes)]},
    }


# ------------------------------------------------------------------------------------------------- the API

class Api:
    """The few reads this benchmark polls, through the kubernetes client (raw JSON: no model objects)."""

    def __init__(self, cluster, namespace: str):
        from kubernetes import client

        self.client = cluster.api_client()
        self.core, self.apps = client.CoreV1Api(self.client), client.AppsV1Api(self.client)
        self.custom, self.ns = client.CustomObjectsApi(self.client), namespace

    def pods(self, selector: str = f"pdserve.io/inference-service={ISVC}") -> list[dict]:
        resp = self.core.list_namespaced_pod(self.ns, label_selector=selector, _preload_content=False)
        return json.loads(resp.data)["items"]

    def pod(self, name: str) -> dict:
        return json.loads(self.core.read_namespaced_pod(name, self.ns, _preload_content=False).data)

    def deployment(self, name: str) -> dict:
        return json.loads(self.apps.read_namespaced_deployment(name, self.ns, _preload_content=False).data)

    def isvc(self) -> dict:
        return self.custom.get_namespaced_custom_object("pdserve.io", "v1alpha1", self.ns, "inferenceservices", ISVC)

    def close(self) -> None:
        self.client.close()


def ready(pod: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions", []))


def counts(isvc: dict) -> tuple[int, int] | None:
    """(ready, wanted) pool pods as the InferenceService's status counts them; None before it has any."""
    status = isvc.get("status") or {}
    try:
        parts = [status[k].split("/") for k in ("prefillReady", "decodeReady")]
    except KeyError:
        return None
    return sum(int(p[0]) for p in parts), sum(int(p[1]) for p in parts)


def isvc_ready(isvc: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (isvc.get("status") or {}).get("conditions", []))


def wait(cond, what: str, hang_guard_s: float, pause_s: float = POLL_S):
    """cond()'s first truthy value; TimeoutError naming `what` after the hang guard."""
    deadline = time.monotonic() + hang_guard_s
    while not (value := cond()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"hang guard: not within {hang_guard_s:g}s: {what}")
        time.sleep(pause_s)
    return value


def _stamp(ts: str) -> float:
    return datetime.fromisoformat(ts.replace("Z", "+00:00")).timestamp()


def spread(xs: list[float]) -> dict:
    xs = sorted(xs)
    if not xs:
        return {}
    return {"n": len(xs), "p50": round(statistics.median(xs), 1), "p90": round(xs[math.ceil(0.9 * len(xs)) - 1], 1),
            "max": round(xs[-1], 1)}


def pod_startup(pods: list[dict]) -> dict:
    """Seconds from each pod's creation until scheduled, its container started and Ready (whole-second stamps)."""
    ways: dict[str, list[float]] = {"scheduled": [], "started": [], "ready": []}
    for p in pods:
        created = _stamp(p["metadata"]["creationTimestamp"])
        conds = {c["type"]: c for c in p["status"].get("conditions", [])}
        running = ((p["status"].get("containerStatuses") or [{}])[0].get("state") or {}).get("running") or {}
        for key, ts in (("scheduled", conds.get("PodScheduled", {}).get("lastTransitionTime")),
                        ("started", running.get("startedAt")),
                        ("ready", conds.get("Ready", {}).get("lastTransitionTime"))):
            if ts:
                ways[key].append(_stamp(ts) - created)
    return {key: spread(xs) for key, xs in ways.items()}


# -------------------------------------------------------------------------------------------------- phases

def apply_phase(cluster, api: Api, doc: dict, n: int, hang_guard_s: float) -> dict:
    """1: apply -> every pod Ready, the InferenceService Ready, its status counting every pool pod."""
    start = time.monotonic()
    cluster.kubectl("apply", "-n", api.ns, "-f", "-", input=json.dumps(doc))
    marks: dict[str, float] = {}
    series: list[tuple[float, int, int]] = []  # (seconds, pods, ready pods)

    def look():
        pods = [p for p in api.pods() if not p["metadata"].get("deletionTimestamp")]
        isvc, now = api.isvc(), round(time.monotonic() - start, 1)
        n_ready = sum(ready(p) for p in pods)
        for mark, reached in (("pods_ready_s", n_ready == n + 1), ("isvc_ready_s", isvc_ready(isvc)),
                              ("isvc_full_s", counts(isvc) == (n, n))):
            if reached:
                marks.setdefault(mark, now)
        series.append((now, len(pods), n_ready))
        return pods if len(marks) == 3 else None

    pods = wait(look, f"{n} sim pods and a router Ready, the InferenceService counting them", hang_guard_s)
    return {**marks, "pod_startup_s": pod_startup(pods), "series": series[::max(1, len(series) // 40)]}


def kill_phase(cluster, api: Api, hang_guard_s: float) -> dict:
    """2: SIGKILL one decode server; how long until the pod, its Deployment and the status show it, and back."""
    victim = sorted(api.pods("pdserve.io/role=decode"), key=lambda p: p["metadata"]["name"])[0]
    name, pool = victim["metadata"]["name"], victim["metadata"]["labels"]["pdserve.io/pool"]
    deployment = f"{ISVC}-decode-{pool}"
    wanted = counts(api.isvc())
    before = api.deployment(deployment)["status"].get("readyReplicas", 0)
    status = victim["status"]["containerStatuses"][0]
    container, restarts = status["containerID"].split("://", 1)[1], status["restartCount"]
    marks: dict[str, float] = {}
    t0 = time.monotonic()
    subprocess.run([*cluster.ctr, "tasks", "kill", "-s", "SIGKILL", container], check=True, capture_output=True)

    def look() -> bool:
        now = round(time.monotonic() - t0, 2)
        checks = (("pod_not_ready_s", lambda: not ready(api.pod(name))),
                  ("deployment_s", lambda: api.deployment(deployment)["status"].get("readyReplicas", 0) < before),
                  ("status_latency_s", lambda: (counts(api.isvc()) or wanted)[0] < wanted[0]))
        for mark, seen in checks:
            if mark not in marks and seen():
                marks[mark] = now
        return len(marks) == 3

    wait(look, f"the kill of {name} seen by its pod, its Deployment and the InferenceService", hang_guard_s,
         FAST_POLL_S)

    def back() -> bool:
        pod = api.pod(name)
        return (pod["status"]["containerStatuses"][0]["restartCount"] > restarts and ready(pod)
                and counts(api.isvc()) == wanted)

    wait(back, f"{name} restarted and counted ready again", hang_guard_s, FAST_POLL_S)
    return {"pod": name, **marks, "recovered_s": round(time.monotonic() - t0, 1)}


def rollout_phase(cluster, api: Api, served, image: str, n: int, clients: int, long_clients: int,
                  hang_guard_s: float) -> dict:
    """3: every pod to `image` while streams run through the router; the time and the streams lost."""
    def done():
        pods = api.pods()
        if len(pods) != n + 1 or any(p["metadata"].get("deletionTimestamp") or not ready(p)
                                     or p["spec"]["containers"][0]["image"] != image for p in pods):
            return False
        isvc = api.isvc()
        return isvc["status"].get("observedGeneration") == isvc["metadata"]["generation"] and counts(isvc) == (n, n)

    with (Streams(served, loop=clients) as short,
          Streams(served, loop=long_clients, max_tokens=LONG_TOKENS) as long):
        short.wait_done(clients)
        before = short.ok
        t0 = time.monotonic()
        cluster.kubectl("patch", "inferenceservice", ISVC, "-n", api.ns, "--type=merge",
                        "-p", json.dumps({"spec": {"image": image}}))
        wait(done, f"every pod on {image}, Ready", hang_guard_s)
        rolled = time.monotonic() - t0
        during = short.ok - before
        short.wait_done(clients)
    lost = short.errors + long.errors
    return {"rollout_s": round(rolled, 1), "short_streams_ok": short.ok, "short_during_rollout": during,
            "long_streams_ok": long.ok, "long_tokens": LONG_TOKENS, "clients": clients, "long_clients": long_clients,
            "lost": len(lost), "lost_examples": lost[:3]}


def delete_phase(cluster, api: Api, hang_guard_s: float) -> dict:
    """4: the namespace deleted; the time until its pods and itself are gone."""
    t0 = time.monotonic()
    cluster.kubectl("delete", "namespace", api.ns, "--wait=false")
    wait(lambda: cluster.kubectl("get", "namespace", api.ns, check=False).returncode != 0,
         f"namespace {api.ns} gone", hang_guard_s)
    return {"deleted_s": round(time.monotonic() - t0, 1)}


# ---------------------------------------------------------------------------------------------- the steps

def pods_needed(n: int, decode_pools: int, surge: str, unavailable: str) -> int:
    """Pods on the node at a rollout's peak: the pools', each pool's surge and its terminating pods
    (maxUnavailable: they hold their address until they are gone), and OTHER_PODS."""
    prefills, decodes = shape(n, decode_pools)
    extra = sum(rollout_pods(surge, r, True) + rollout_pods(unavailable, r, False) for r in [prefills, *decodes])
    return n + extra + OTHER_PODS


def bytes_per_pod(step: dict) -> float:
    """What one sim pod cost the machine in a step: the larger of its processes' PSS (server, shim,
    pause) and the fall of MemAvailable from before the apply to Ready, per pod."""
    procs, n = step["at_ready"]["processes"], step["pods"]
    pss = sum(procs.get(k, {}).get("pss_sum_mib", 0) for k in ("sim-prefill", "sim-decode", "shim", "pause")) * MIB
    fall = (step["before"]["mem_available_gib"] - step["at_ready"]["machine"]["mem_available_gib"]) * 2**30
    return max(pss, fall) / n


def refusal(n: int, args, done: list[dict], started: float) -> str | None:
    """Why step n is not run (address space, memory, time), or None."""
    need = pods_needed(n, args.decode_pools, args.max_surge, args.max_unavailable)
    if need > MAX_PODS:
        return f"{need} pods at the rollout's peak; the node's pod network holds {MAX_PODS}"
    last = next((s for s in reversed(done) if "at_ready" in s), None)
    per_pod = bytes_per_pod(last) if last else args.guess_mib_per_pod * MIB
    wanted = (need - OTHER_PODS) * per_pod
    free = machine_now()["mem_available_gib"] * 2**30 - args.reserve_gib * 2**30
    if wanted > free:
        return (f"{need - OTHER_PODS} pods x {per_pod / MIB:.0f} MiB = {wanted / 2**30:.1f} GiB; MemAvailable "
                f"less the {args.reserve_gib} GiB reserve is {free / 2**30:.1f} GiB")
    if last:
        predicted = last["step_s"] * n / last["pods"]
        left = args.budget_min * 60 - (time.monotonic() - started)
        if predicted > left:
            return f"it would take about {predicted / 60:.1f} min (the {last['pods']}-pod step's time x " \
                   f"{n}/{last['pods']}); {left / 60:.1f} min of the budget are left"
    return None


def run_step(cluster, n: int, args, new_image: str) -> dict:
    """One N: apply, kill, rollout, delete, with what the processes cost at each point."""
    t0 = time.monotonic()
    ns = f"{ISVC}-{n}"
    prefills, decodes = shape(n, args.decode_pools)
    rollout = {"maxSurge": args.max_surge, "maxUnavailable": args.max_unavailable}
    step: dict = {"pods": n, "prefills": prefills, "decode_pools": decodes, "rollout": rollout,
                  "before": machine_now()}
    cluster.kubectl("create", "namespace", ns)
    api = Api(cluster, ns)
    guard = args.hang_guard_s
    try:
        procs = processes(cluster.work_dir)
        step["apply"] = apply_phase(cluster, api, service(cluster.image, n, args.decode_pools, rollout), n, guard)
        at_ready = processes(cluster.work_dir)
        step["at_ready"] = {"machine": machine_now(), "processes": summary(at_ready),
                            "cpu_s_since_apply": cpu_spent(procs, at_ready)}
        served = node_serving.wait_served(cluster, ns, ISVC, time.monotonic(), timeout=guard)
        step["kill"] = kill_phase(cluster, api, guard)
        procs = processes(cluster.work_dir)
        step["rollout"] = rollout_phase(cluster, api, served, new_image, n, args.clients, args.long_clients, guard)
        after = processes(cluster.work_dir)
        step["after_rollout"] = {"machine": machine_now(), "processes": summary(after),
                                 "cpu_s_during_rollout": cpu_spent(procs, after)}
    except Exception as e:  # recorded, and the larger steps are not run
        step["error"] = f"{type(e).__name__}: {e}"[:4000]
    finally:
        try:
            step["delete"] = delete_phase(cluster, api, guard)
        finally:
            api.close()
    step["step_s"] = round(time.monotonic() - t0, 1)
    return step


def line(step: dict) -> str:
    """One line of the summary."""
    if "error" in step or "apply" not in step:
        return f"N={step['pods']}: {step.get('error') or step.get('refused')}"
    a, k, r = step["apply"], step.get("kill", {}), step.get("rollout", {})
    procs, m = step["at_ready"]["processes"], step["at_ready"]["machine"]
    sim = [procs[x] for x in ("sim-prefill", "sim-decode") if x in procs]
    rss = max((p["rss_median_mib"] for p in sim), default=0)
    return (f"N={step['pods']} ({step['prefills']} prefills, decode pools {step['decode_pools']}): pods Ready "
            f"{a.get('pods_ready_s')}s, InferenceService Ready {a.get('isvc_ready_s')}s, all counted "
            f"{a.get('isvc_full_s')}s; kill -> status {k.get('status_latency_s')}s (pod {k.get('pod_not_ready_s')}s, "
            f"Deployment {k.get('deployment_s')}s), back {k.get('recovered_s')}s; rollout {r.get('rollout_s')}s, "
            f"streams {r.get('short_streams_ok', 0) + r.get('long_streams_ok', 0)} ok, {r.get('lost')} lost; sim "
            f"server RSS median {rss} MiB, {bytes_per_pod(step) / MIB:.0f} MiB a pod; MemAvailable "
            f"{m['mem_available_gib']} GiB, load {m['load_avg']}; step {step['step_s']}s")


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", default="20,50,100,200",
                        help="sim pods of the InferenceService, one step each, in order (default 20,50,100,200)")
    parser.add_argument("--decode-pools", type=int, default=4, help="decode pools (default 4)")
    parser.add_argument("--max-surge", default="10%", help="the pools' rollout maxSurge (default 10%%)")
    parser.add_argument("--max-unavailable", default="10%", help="the pools' rollout maxUnavailable (default 10%%)")
    parser.add_argument("--clients", type=int, default=4, help="clients of short streams in the rollout (default 4)")
    parser.add_argument("--long-clients", type=int, default=2,
                        help=f"clients of {LONG_TOKENS}-token streams in the rollout (default 2)")
    parser.add_argument("--reserve-gib", type=float, default=4.0,
                        help="memory left to the machine's other users (default 4 GiB)")
    parser.add_argument("--guess-mib-per-pod", type=float, default=150.0,
                        help="a sim pod's memory before a step has measured it (default 150 MiB)")
    parser.add_argument("--budget-min", type=float, default=25.0, help="the run's time budget (default 25 min)")
    parser.add_argument("--hang-guard-s", type=float, default=900.0, help="each phase's hang guard (default 900 s)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    try:
        args.steps = [int(x) for x in args.pods.split(",")]
    except ValueError:
        parser.error(f"--pods {args.pods!r}: a comma-separated list of pod counts, e.g. 20,50,100")
    for value, name in ((args.max_surge, "--max-surge"), (args.max_unavailable, "--max-unavailable")):
        if not (value.rstrip("%").isdigit() and (not value.endswith("%") or int(value[:-1]) <= 100)):
            parser.error(f"{name} {value!r}: a count or a percentage (0 to 100%), as a Deployment's rollout takes")
    for n in args.steps:
        try:
            shape(n, args.decode_pools)
        except ValueError as e:
            parser.error(str(e))
    if args.decode_pools < 1 or args.clients < 1 or args.long_clients < 0:
        parser.error("--decode-pools and --clients must be at least 1, --long-clients at least 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    record, started = run_start(), time.monotonic()
    print(f"operator scale: steps {args.steps}; {record['cpu_model']} ({record['cpus']} CPUs), commit "
          f"{record['git_commit']}{' (dirty)' if record['git_dirty'] else ''}, load {record['load_avg']}", flush=True)
    max_pods = min(MAX_PODS, max(pods_needed(n, args.decode_pools, args.max_surge, args.max_unavailable)
                                 for n in args.steps))
    work = Path(tempfile.mkdtemp(prefix="pdserve-operator-scale-"))
    steps: list[dict] = []
    with node_cluster(work, max_pods=max_pods) as cluster:
        node_s = round(time.monotonic() - started, 1)
        node_serving.helm_install(cluster)
        new_image = f"{cluster.image}-scale"
        subprocess.run([*cluster.ctr, "images", "tag", "--force", cluster.image, new_image], check=True,
                       capture_output=True)
        print(f"node up in {node_s}s (maxPods {max_pods}), operator installed at "
              f"{time.monotonic() - started:.0f}s", flush=True)
        for i, n in enumerate(args.steps):
            why = refusal(n, args, steps, started)
            steps.append({"pods": n, "refused": why} if why else run_step(cluster, n, args, new_image))
            print(line(steps[-1]), flush=True)
            if why or "error" in steps[-1]:
                steps += [{"pods": m, "refused": f"not run: the {n}-pod step stopped the series"}
                          for m in args.steps[i + 1:]]
                break
    doc = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "node_start_s": node_s,
           "max_pods": max_pods, "steps": steps, "total_s": round(time.monotonic() - started, 1)}
    if args.json:
        print(f"wrote {write_json(args.json, doc)}")
    else:
        print(json.dumps(doc, indent=1, default=str))
    return 0 if not any("error" in s for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
