"""Benchmark: N InferenceServices reconciling on a real control plane; time to converge and operator memory.

    .venv/bin/python bench/tools/operator_converge.py [--count 50] [--json out.json]

Starts etcd + kube-apiserver + kube-controller-manager (tests/harness/kube.py; or uses the cluster
in $PDSERVE_KUBECONFIG), helm-installs charts/pdserve, runs `pdserve operator` locally with
the chart's ServiceAccount token (RBAC applies), then applies N copies of
examples/inferenceservice.yaml (each: 1 prefill + 2 decode pools -> 3 pools, plus a router:
4 Deployments, 4 Services, 2 ServiceAccounts, Roles and RoleBindings, 3 NetworkPolicies) in one
`kubectl apply`.

Reports:
- converge_s: from the start of the apply (objects are created one by one while the operator
  already works; converge_after_apply_s is the part after the last one exists) until every InferenceService has its 4 Deployments and 4
  Services and a status for its current generation (decodeReady "0/3");
- ready_s: from marking every pod Ready (pods/status, as a kubelet would; there is no
  kubelet here) until every InferenceService is Ready=True;
- operator CPU seconds spent converging (a figure the machine's load distorts less than time);
- operator RSS now and peak (VmRSS / VmHWM from /proc), and the count of ERROR lines and
  tracebacks in the operator's log (should be 0).
This is a benchmark, not a test: nothing is asserted; the figures go to docs/.
"""  # noqa: E501

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path

import yaml
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from harness.kube import kube_cluster  # noqa: E402
from harness.operator_harness import OperatorProcess, install_chart  # noqa: E402


def wait(predicate, total: int, desc: str, timeout: float) -> float:
    """Poll predicate() -> how many are done, with a progress bar, until == total; seconds taken."""
    start = time.monotonic()
    with tqdm(total=total, desc=desc, unit="isvc") as bar:
        while True:
            done = predicate()
            bar.n = done
            bar.refresh()
            if done >= total:
                return time.monotonic() - start
            if time.monotonic() - start > timeout:
                raise TimeoutError(f"{desc}: {done}/{total} after {timeout:.0f}s")
            time.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50, help="InferenceServices to create (default 50)")
    parser.add_argument("--namespace", default="bench", help="namespace for them")
    parser.add_argument("--timeout", type=float, default=600, help="seconds to wait for each phase")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.count < 1:
        parser.error("--count must be >= 1")

    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-operator-"))
    with kube_cluster(work) as kube:
        install_chart(kube)
        op = OperatorProcess(kube, work / "logs", extra_args=("--network-policy",))
        op.start()
        try:
            ns = args.namespace
            kube.kubectl("create", "namespace", ns)
            example = yaml.safe_load((REPO / "examples" / "inferenceservice.yaml").read_text())
            # Deployments (and Services) per InferenceService: prefill, each decode pool, the router
            children = 1 + len(example["spec"]["decode"]) + (example["spec"].get("router", {}).get("replicas", 1) > 0)
            items = []
            for i in range(args.count):
                doc = copy.deepcopy(example)
                doc["metadata"] = {"name": f"svc-{i:03d}", "namespace": ns}
                items.append(doc)
            time.sleep(2)  # let the operator finish its initial listing
            rss_idle = op.rss_kib()[0]
            cpu_idle = op.cpu_seconds()
            t0 = time.monotonic()
            kube.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
            apply_s = time.monotonic() - t0

            api = kube.api_client()
            from kubernetes import client

            core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
            custom = client.CustomObjectsApi(api)
            peak_rss = [0]

            def isvcs():
                peak_rss[0] = max(peak_rss[0], op.rss_kib()[0])
                return custom.list_namespaced_custom_object("pdserve.io", "v1alpha1", ns, "inferenceservices")["items"]

            def converged() -> int:
                deps = {}
                for d in apps.list_namespaced_deployment(ns).items:
                    isvc = (d.metadata.labels or {}).get("pdserve.io/inference-service")
                    deps[isvc] = deps.get(isvc, 0) + 1
                svcs = {}
                for s in core.list_namespaced_service(ns).items:
                    isvc = (s.metadata.labels or {}).get("pdserve.io/inference-service")
                    svcs[isvc] = svcs.get(isvc, 0) + 1
                done = 0
                for o in isvcs():
                    st, name = o.get("status") or {}, o["metadata"]["name"]
                    if (deps.get(name) == children and svcs.get(name) == children and st.get("decodeReady") == "0/3"
                            and st.get("observedGeneration") == o["metadata"]["generation"]):
                        done += 1
                return done

            after_apply_s = wait(converged, args.count, "converging", args.timeout)
            converge_s = apply_s + after_apply_s
            rss_converged, _ = op.rss_kib()
            cpu_converged = op.cpu_seconds() - cpu_idle

            # The ReplicaSet controller (controller-manager, not the operator) creates the pods; wait
            # for all of them, or pods created after the marking below would never become ready.
            pods_per_isvc = sum(int(p.get("replicas", 1))
                                for p in [example["spec"]["prefill"], *example["spec"]["decode"],
                                                                     example["spec"].get("router", {})])
            pods_s = wait(lambda: len(core.list_namespaced_pod(ns).items) // pods_per_isvc, args.count,
                          "pods created (controller-manager)", args.timeout)
            t1 = time.monotonic()
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            body = {"status": {"phase": "Running", "podIP": "10.0.0.1", "conditions": [
                {"type": t, "status": "True", "lastTransitionTime": now}
                for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]}}
            pods = core.list_namespaced_pod(ns).items
            for pod in tqdm(pods, desc="marking pods ready", unit="pod"):
                core.patch_namespaced_pod_status(pod.metadata.name, ns, body)
            mark_s = time.monotonic() - t1

            def ready() -> int:
                return sum(1 for o in isvcs() for c in (o.get("status") or {}).get("conditions", [])
                           if c["type"] == "Ready" and c["status"] == "True")

            ready_s = mark_s + wait(ready, args.count, "becoming Ready", args.timeout)
            rss_now, rss_peak = op.rss_kib()
            log = op.log()
            results = {
                "inference_services": args.count,
                "pods": len(pods),
                "apply_s": round(apply_s, 2),
                "converge_s": round(converge_s, 2),
                "converge_after_apply_s": round(after_apply_s, 2),
                "pods_created_after_converge_s": round(pods_s, 2),
                "mark_pods_ready_s": round(mark_s, 2),
                "ready_s": round(ready_s, 2),
                "operator_cpu_to_converge_s": round(cpu_converged, 2),
                "operator_cpu_total_s": round(op.cpu_seconds() - cpu_idle, 2),
                "operator_rss_idle_mib": round(rss_idle / 1024, 1),
                "operator_rss_converged_mib": round(rss_converged / 1024, 1),
                "operator_rss_end_mib": round(rss_now / 1024, 1),
                "operator_rss_peak_mib": round(max(rss_peak, peak_rss[0]) / 1024, 1),
                "operator_error_lines": sum(1 for line in log.splitlines() if "[ERROR" in line),
                "operator_tracebacks": log.count("Traceback"),
                "operator_log": str(op.log_dir),
            }
            api.close()
        finally:
            op.stop()
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
