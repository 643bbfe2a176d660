"""protocol_rollout: the retired decode Service of a protocol change, and when it goes (pure logic)."""

import copy

from pdserve.operator import naming, pools, protocol_rollout, workloads
from pdserve.operator.config import OperatorConfig
from test_operator_builders import example

OLD, NEW = "7", "8"


def decode_service(version: str) -> dict:
    pool = pools.build_decode_pools(example(), OperatorConfig(default_image="img:1", protocol_version=version))[0]
    return workloads.build_service(pool)


def as_served(service: dict) -> dict:
    """The Service as the API server returns it (defaults and read-only fields filled in)."""
    out = copy.deepcopy(service)
    out["metadata"].update(uid="u-1", resourceVersion="42", creationTimestamp="2026-11-23T00:00:00Z")
    out["spec"].update(clusterIPs=["None"], sessionAffinity="None", type="ClusterIP")
    for port in out["spec"]["ports"]:
        port.setdefault("targetPort", port["name"])
    return out


def test_a_version_change_keeps_the_old_service_under_its_own_name():
    current, wanted = as_served(decode_service(OLD)), decode_service(NEW)
    retired = protocol_rollout.retired_service(current, wanted)
    assert retired["metadata"]["name"] == current["metadata"]["name"] + "-v7"
    assert retired["metadata"]["namespace"] == "ns1"
    labels = retired["metadata"]["labels"]
    assert labels[naming.LABEL_PROTOCOL] == OLD and labels[naming.LABEL_RETIRED] == "true"
    # its slices match an old prefill's --decode-selector, and it selects only old pods
    wanted_by_old_prefill = dict(kv.split("=") for kv in naming.decode_selector("chat", OLD).split(","))
    assert wanted_by_old_prefill.items() <= labels.items()
    assert retired["spec"]["selector"] == current["spec"]["selector"]
    assert retired["spec"]["selector"][naming.LABEL_PROTOCOL] == OLD
    assert retired["spec"]["clusterIP"] == "None" and "clusterIPs" not in retired["spec"]
    assert "uid" not in retired["metadata"] and "resourceVersion" not in retired["metadata"]
    assert [p["port"] for p in retired["spec"]["ports"]] == [p["port"] for p in current["spec"]["ports"]]


def test_no_retired_copy_without_a_change():
    assert protocol_rollout.retired_service(None, decode_service(NEW)) is None  # a new pool
    assert protocol_rollout.retired_service(as_served(decode_service(NEW)), decode_service(NEW)) is None
    retired = protocol_rollout.retired_service(as_served(decode_service(OLD)), decode_service(NEW))
    assert protocol_rollout.retired_service(retired, decode_service(NEW)) is None  # never a copy of a copy


def test_retired_names_are_valid_service_names():
    long = "a" * 40 + "-decode-" + "b" * 15  # the longest name the CRD admits: 63 characters
    for service, version in (("chat-decode-main", "7"), (long, "7"), ("chat-decode-main", "v1.2_rc"),
                             ("chat-decode-main", "___")):
        name = protocol_rollout.retired_name(service, version)
        assert len(name) <= 63 and name[0].isalpha() and name[-1].isalnum() and name == name.lower(), name
        assert all(c.isalnum() or c == "-" for c in name), name
    assert protocol_rollout.retired_name(long, "7") != protocol_rollout.retired_name(long, "8")
    assert protocol_rollout.retired_name("chat-decode-main", "v1.2_rc") == "chat-decode-main-vv1-2-rc"


def prefill_deployment(version: str, replicas=1, updated=1, total=1, observed=3, generation=3) -> dict:
    return {"metadata": {"name": "chat-prefill", "generation": generation},
            "spec": {"replicas": replicas, "template": {"metadata": {"labels": {naming.LABEL_PROTOCOL: version}}}},
            "status": {"observedGeneration": observed, "updatedReplicas": updated, "replicas": total}}


def retired(version: str = OLD, pool: str = "main") -> dict:
    labels = {naming.LABEL_ISVC: "chat", naming.LABEL_POOL: pool, naming.LABEL_PROTOCOL: version,
              naming.LABEL_RETIRED: "true"}
    return {"metadata": {"name": f"chat-decode-{pool}-v{version}", "labels": labels}}


def test_a_retired_service_stays_while_an_old_prefill_may_run():
    versions = {"chat-decode-main": NEW}
    keep = [
        prefill_deployment(OLD),  # the prefill has not started to roll
        prefill_deployment(NEW, updated=1, total=2),  # the new pod is up, the old one still counted
        prefill_deployment(NEW, updated=0, total=1),  # the new pod is not up yet
        prefill_deployment(NEW, observed=2),  # the controller has not seen the new template yet
        prefill_deployment(NEW, replicas=2, updated=1, total=1),
    ]
    for deployment in keep:
        assert protocol_rollout.stale([retired()], deployment, versions) == [], deployment


def test_a_retired_service_goes_once_the_prefills_rolled_or_on_a_roll_back():
    services = [retired(OLD, "main"), retired(OLD, "big")]
    rolled = prefill_deployment(NEW)
    assert protocol_rollout.stale(services, rolled, {"chat-decode-main": NEW, "chat-decode-big": NEW}) == [
        "chat-decode-big-v7", "chat-decode-main-v7"]
    assert protocol_rollout.stale(services, None, {}) == ["chat-decode-big-v7", "chat-decode-main-v7"]  # no prefill
    # rolled back to 7 while prefills still run 8: the main Service selects the 7s again, its copy is redundant
    back = prefill_deployment(NEW, updated=0, total=1)
    assert protocol_rollout.stale(services, back, {"chat-decode-main": OLD, "chat-decode-big": NEW}) == [
        "chat-decode-main-v7"]


class Api:
    """The calls prune makes, over dicts of Services and DecodePools; ``calls`` records their order."""

    def __init__(self, services, pools=()):
        self.services = {s["metadata"]["name"]: s for s in services}
        self.pools, self.calls = list(pools), []

    def list(self, kind, namespace, selector):
        self.calls.append(kind)
        if kind == "DecodePool":
            return self.pools
        assert kind == "Service"
        return [s for s in self.services.values() if selector.items() <= s["metadata"]["labels"].items()]

    def delete(self, kind, namespace, name):
        return self.services.pop(name, None) is not None


def test_prune_deletes_only_what_is_stale():
    pools_now = [{"metadata": {"name": "chat-decode-main"}, "spec": {"protocolVersion": NEW}}]
    api = Api([retired(OLD, "main"), {"metadata": {"name": "chat-decode-main", "labels": {naming.LABEL_ISVC: "chat"}}}],
              pools_now)
    assert protocol_rollout.prune(api, "ns", "chat", {"chat-prefill": prefill_deployment(OLD)}) == []
    assert protocol_rollout.prune(api, "ns", "chat", {"chat-prefill": prefill_deployment(NEW)}) == [
        "chat-decode-main-v7"]
    assert list(api.services) == ["chat-decode-main"]


def test_prune_reads_the_pools_versions_after_the_retired_services():
    # a retired copy exists only once its pool has the new version: read in this order, the copy a
    # pool's reconcile just made is never judged by the pool's old version (it was deleted at once)
    api = Api([retired(OLD, "main")], [{"metadata": {"name": "chat-decode-main"}, "spec": {"protocolVersion": NEW}}])
    assert protocol_rollout.prune(api, "ns", "chat", {"chat-prefill": prefill_deployment(OLD)}) == []
    assert api.calls == ["Service", "DecodePool"]
    assert protocol_rollout.prune(Api([]), "ns", "chat", {}) == []  # nothing retired: no pool read
