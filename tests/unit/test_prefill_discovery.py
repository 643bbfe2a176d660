"""Discovery: static address validation and EndpointSlice -> address extraction."""

import asyncio

import pytest

from pdserve.discovery import KubernetesDiscovery, StaticDiscovery, addresses_from_slices


def _slice(service, ips, ready=True, port_name="grpc", port=50052, extra_ports=()):
    return {
        "metadata": {"labels": {"kubernetes.io/service-name": service}},
        "ports": [{"name": port_name, "port": port}, *extra_ports],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": ready}} for ip in ips],
    }


def test_static_discovery_validates_and_dedupes():
    d = StaticDiscovery(["127.0.0.1:2", "127.0.0.1:1", "127.0.0.1:2"])
    asyncio.run(d.start())
    assert d.addresses() == ["127.0.0.1:1", "127.0.0.1:2"]
    for bad in ["localhost", "h:0", "h:x", ":5"]:
        with pytest.raises(ValueError, match="host:port"):
            StaticDiscovery([bad])


def test_slices_of_selected_services_only_ready_endpoints():
    slices = {
        "a-1": _slice("decode-a", ["10.0.0.1", "10.0.0.2"]),
        "a-2": _slice("decode-a", ["10.0.0.3"], ready=False),
        "b-1": _slice("decode-b", ["10.0.1.1"], extra_ports=({"name": "http", "port": 8001},)),
        "other": _slice("prefill", ["10.0.2.1"]),
        "noport": _slice("decode-b", ["10.0.1.9"], port_name="http"),
    }
    got = addresses_from_slices(slices, {"decode-a", "decode-b"})
    assert got == ["10.0.0.1:50052", "10.0.0.2:50052", "10.0.1.1:50052"]


def test_single_unnamed_port_and_ipv6():
    slices = {"x": _slice("d", ["fd00::1"], port_name=None, port=7000)}
    assert addresses_from_slices(slices, {"d"}) == ["[fd00::1]:7000"]


def test_kubernetes_discovery_arguments_are_checked():
    with pytest.raises(ValueError, match="namespace"):
        KubernetesDiscovery(namespace="", selector="a=b")
    with pytest.raises(ValueError, match="label=value"):
        KubernetesDiscovery(namespace="ns", selector="nolabel")
