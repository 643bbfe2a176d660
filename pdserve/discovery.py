"""Where the decode servers are: a static list, a file, or Kubernetes EndpointSlices.

All kinds expose the same small interface the prefill server (and the router, for
prefills) uses::

    d = StaticDiscovery(["127.0.0.1:50052", ...])            # or
    d = FileDiscovery("decodes.txt")                         # or
    d = KubernetesDiscovery(namespace="ns", selector="pdserve.io/pool=main")
    await d.start(); d.addresses() -> list["host:port"]; await d.stop()

File mode: one ``host:port`` a line (``#`` starts a comment), re-read whenever the file
changes (checked on every ``addresses()`` call: one ``stat``). ``pdserve up --autoscale``
writes it, atomically (a temporary file renamed over it), as it starts and removes servers.

Kubernetes mode selects the decode **Services** by label, then follows the
EndpointSlices of those Services (label ``kubernetes.io/service-name``). An endpoint
counts while its ``ready`` condition is not false; the port is the slice port named
``port_name`` ("grpc" by default), else the slice's only port if it is unnamed. Both watches run in
daemon threads (the kubernetes client is synchronous) and restart after errors; the
address set is swapped atomically so readers never see a half-applied update.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from pathlib import Path

log = logging.getLogger(__name__)
SERVICE_NAME_LABEL = "kubernetes.io/service-name"


def parse_address(text: str) -> str:
    """Validate ``host:port`` and return it stripped; ValueError naming the problem otherwise."""
    text = text.strip()
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"decode address {text!r} is not host:port (e.g. 127.0.0.1:50052)")
    return text


class StaticDiscovery:
    """A fixed list of decode addresses (``--decode host:port,host:port``)."""

    def __init__(self, addresses: list[str]):
        self._addresses = sorted({parse_address(a) for a in addresses})

    def addresses(self) -> list[str]:
        return list(self._addresses)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


class FileDiscovery:
    """Addresses listed in a file (``--decode-file``, ``--prefill-file``), re-read when it changes.

    The file must exist at start (ValueError naming it). A line that is not ``host:port`` is
    skipped with a warning naming it; a file that goes missing later keeps the last list.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"discovery file {str(self.path)!r} does not exist")
        self._stamp: tuple | None = None
        self._addresses: list[str] = []
        self.addresses()

    def _read(self) -> list[str]:
        found = set()
        for lineno, line in enumerate(self.path.read_text().splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                found.add(parse_address(line))
            except ValueError as exc:
                log.warning("%s line %d skipped: %s", self.path, lineno, exc)
        return sorted(found)

    def addresses(self) -> list[str]:
        try:
            st = os.stat(self.path)
            stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
            if stamp != self._stamp:
                addresses = self._read()
                if addresses != self._addresses:
                    log.info("%s: %s", self.path, addresses or "(empty)")
                self._addresses, self._stamp = addresses, stamp
        except OSError as exc:  # gone or unreadable for a moment: keep what we had
            if self._stamp is not None:
                log.warning("discovery file %s: %s; keeping %s", self.path, exc, self._addresses)
                self._stamp = None
        return list(self._addresses)

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None


def addresses_from_slices(slices: dict[str, dict], services: set[str], port_name: str = "grpc") -> list[str]:
    """The ready ``host:port`` endpoints of the given services (slices as API JSON dicts, by slice name)."""
    out = set()
    for doc in slices.values():
        labels = (doc.get("metadata") or {}).get("labels") or {}
        if labels.get(SERVICE_NAME_LABEL) not in services:
            continue
        ports = doc.get("ports") or []
        named = [p for p in ports if p.get("name") == port_name]
        unnamed = [p for p in ports if not p.get("name")]
        port = named[0] if named else (unnamed[0] if len(ports) == 1 and unnamed else None)
        if not port or not port.get("port"):
            continue
        for endpoint in doc.get("endpoints") or []:
            if ((endpoint.get("conditions") or {}).get("ready")) is False:
                continue
            for ip in endpoint.get("addresses") or []:
                host = f"[{ip}]" if ":" in ip else ip
                out.add(f"{host}:{port['port']}")
    return sorted(out)


class KubernetesDiscovery:
    """Endpoints (decodes for prefill, prefills for the router) from the EndpointSlices of the
    Services matching ``selector`` in ``namespace``; ``flag`` names the selector in errors."""

    def __init__(self, namespace: str, selector: str, port_name: str = "grpc", kubeconfig: str | None = None,
                 resync_s: float = 30.0, flag: str = "--decode-selector"):
        if not namespace:
            raise ValueError("--namespace is required with --discovery kubernetes")
        if not selector or "=" not in selector:
            raise ValueError(f"{flag} must be label=value[,label=value...], got {selector!r}")
        self.namespace, self.selector, self.port_name = namespace, selector, port_name
        self.kubeconfig, self.resync_s = kubeconfig, resync_s
        self._services: set[str] = set()
        self._slices: dict[str, dict] = {}
        self._addresses: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.synced = threading.Event()

    def addresses(self) -> list[str]:
        return list(self._addresses)

    async def start(self) -> None:
        from kubernetes import client, config

        # an ApiClient of our own: the process-wide default configuration is left alone
        if self.kubeconfig:
            api = config.new_client_from_config(config_file=self.kubeconfig)
        else:
            try:
                cfg = client.Configuration()
                config.load_incluster_config(client_configuration=cfg)
                api = client.ApiClient(cfg)
            except config.ConfigException:
                api = config.new_client_from_config()
        self._core, self._disc, self._api = client.CoreV1Api(api), client.DiscoveryV1Api(api), api
        for target in (self._watch_services, self._watch_slices):
            t = threading.Thread(target=self._forever, args=(target,), daemon=True, name=f"k8s-{target.__name__}")
            t.start()
            self._threads.append(t)
        await asyncio.get_running_loop().run_in_executor(None, self.synced.wait, 10.0)

    async def stop(self) -> None:
        self._stop.set()

    def _forever(self, target) -> None:
        while not self._stop.is_set():
            try:
                target()
            except Exception as exc:  # API server restarts, expired resourceVersions...
                log.warning("kubernetes discovery: %s; retrying", exc)
                self._stop.wait(1.0)

    def _recompute(self) -> None:
        with self._lock:
            addresses = addresses_from_slices(self._slices, self._services, self.port_name)
        if addresses != self._addresses:
            log.info("endpoints of services %s: %s", self.selector, addresses)
        self._addresses = addresses

    def _watch_services(self) -> None:
        from kubernetes import watch

        listed = self._core.list_namespaced_service(self.namespace, label_selector=self.selector)
        with self._lock:
            self._services = {s.metadata.name for s in listed.items}
        self._recompute()
        stream = watch.Watch().stream(
            self._core.list_namespaced_service, self.namespace, label_selector=self.selector,
            resource_version=listed.metadata.resource_version, timeout_seconds=int(self.resync_s),
        )
        for event in stream:
            name = event["object"].metadata.name
            with self._lock:
                if event["type"] == "DELETED":
                    self._services.discard(name)
                else:
                    self._services.add(name)
            self._recompute()
            if self._stop.is_set():
                return

    def _watch_slices(self) -> None:
        from kubernetes import watch

        listed = self._disc.list_namespaced_endpoint_slice(self.namespace)
        with self._lock:
            self._slices = {s.metadata.name: self._api.sanitize_for_serialization(s) for s in listed.items}
        self._recompute()
        self.synced.set()
        stream = watch.Watch().stream(
            self._disc.list_namespaced_endpoint_slice, self.namespace,
            resource_version=listed.metadata.resource_version, timeout_seconds=int(self.resync_s),
        )
        for event in stream:
            obj = event["object"]
            with self._lock:
                if event["type"] == "DELETED":
                    self._slices.pop(obj.metadata.name, None)
                else:
                    self._slices[obj.metadata.name] = self._api.sanitize_for_serialization(obj)
            self._recompute()
            if self._stop.is_set():
                return
