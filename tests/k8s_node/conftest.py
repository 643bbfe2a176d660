"""Fixtures of the real-node tier: pods run (tests/harness/kube_node.py: kubelet, containerd, runc,
bridge CNI, kube-proxy, kube-scheduler on this machine, the pdserve image built by `make image`).

- `node_kube` (package): the one-node cluster, started once for this folder (once per run: the
  harness's own checks are here too, test_node_harness.py), torn down after it; node_cluster then
  compares the machine with how it was before the node started (processes, iptables chains, mounts,
  the bridge, cgroups, sysctls), and a NodeTeardownError fails the last test's teardown if anything
  was left;
- `chart` (package): `helm install` of charts/pdserve with the built image as the operator image;
- `chat` (package): the user's path: examples/inferenceservice.yaml applied, its status Ready,
  then a first chat completion streamed with the `openai` client through the router's Service
  (its ClusterIP, from this machine through kube-proxy); the times are in `chat.timings`.
Every test file here is marked k8s and slow (they need `make k8s-tools` and `make image`). They run
after every other test: `make test` builds the image in the background meanwhile, and the cluster's
start-up waits for that build (the first of them gets the wait added to its time limit).

Order (`ORDER`): the files share one InferenceService, and the rollouts leave it on a new image and
protocol (they do not roll back: test_node_rollout.py), so the user's path, which checks what the
example makes by default, runs first and the rollouts last; the tests between them (day-2, readiness,
the harness's pod) depend on neither image nor protocol and leave the replica counts as they found them.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from harness import node_serving
from harness.kube_node_images import IMAGE_WAIT_S


# Files run in this order (the others between the first and the last, in file order): see above.
ORDER = {"test_node_user_path.py": 0, "test_node_rollout.py": 2}


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    mine = [item for item in items if here in Path(item.path).parents]
    if not mine:
        return
    mine.sort(key=lambda item: ORDER.get(Path(item.path).name, 1))  # stable: file order otherwise
    items[:] = [item for item in items if item not in mine] + mine   # last: the image may still be building
    timeout = mine[0].get_closest_marker("timeout")
    base = timeout.args[0] if timeout and timeout.args else 600
    mine[0].add_marker(pytest.mark.timeout(base + IMAGE_WAIT_S), append=False)


@pytest.fixture(scope="package")
def node_kube(tmp_path_factory):
    from harness.kube_node import node_cluster

    with node_cluster(tmp_path_factory.mktemp("node")) as cluster:
        print(f"\none-node cluster start-up (s): { {k: round(v, 1) for k, v in cluster.timings.items()} }")
        yield cluster


@pytest.fixture(scope="package")
def chart(node_kube):
    start = time.monotonic()
    node_serving.helm_install(node_kube)
    return {"helm_install_s": time.monotonic() - start}


@pytest.fixture(scope="package")
def chat(node_kube, chart):
    served = node_serving.apply_example(node_kube)
    served.timings.update(chart)
    return served
