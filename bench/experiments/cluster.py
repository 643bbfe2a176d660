"""The server layouts the experiments compare, started through a Launcher.

- ``start_pd``: one prefill + N decodes (``pdserve prefill --decode ...``, ``pdserve decode``).
- ``start_colocated``: one prefill with ``--local-fallback`` and no decode: the colocated
  engine (prefill and decode in one process, continuous batching) behind the same HTTP API.
- ``start_routed``: N prefills (each knows every decode) + M decodes behind ``pdserve router``.

Every server gets free ports and serves its model under the name ``SERVED_MODEL``.
``host`` lets decodes listen on a namespace's address (experiments 2 and 4); by default
everything is on 127.0.0.1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.net import free_port

from .launcher import Launcher, Proc

SERVED_MODEL = "bench"  # the name clients put in "model", whatever checkpoint is loaded


@dataclass
class Server:
    proc: Proc
    url: str            # HTTP base (prefill, router: OpenAI API; decode: /metrics)
    grpc: str = ""      # decode: the Session address prefill dials; prefill: its KV events and Generate
    netns: str | None = None

    @property
    def metrics_url(self) -> str:
        return self.url + "/metrics"


@dataclass
class Cluster:
    prefill: Server
    decodes: list[Server] = field(default_factory=list)
    prefills: list[Server] = field(default_factory=list)  # start_routed: every prefill (prefill is the router)

    @property
    def url(self) -> str:
        return self.prefill.url


def engine_flags(model: str, threads: int | None, num_blocks: int | None, max_model_len: int | None) -> list[str]:
    out = ["--model", model, "--served-model-name", SERVED_MODEL, "--log-level", "WARNING"]
    if threads:
        out += ["--threads", str(threads)]
    if num_blocks:
        out += ["--num-blocks", str(num_blocks)]
    if max_model_len:
        out += ["--max-model-len", str(max_model_len)]
    return out


def start_decode(launcher: Launcher, name: str, model: str, *, threads: int | None = None, cpus: str | None = None,
                 num_blocks: int | None = None, max_model_len: int | None = None, host: str = "127.0.0.1",
                 netns: str | None = None, extra: list[str] | None = None) -> Server:
    port, http_port, kv_port = free_port(), free_port(), free_port()
    args = ["decode", "--host", host, "--port", str(port), "--http-port", str(http_port), "--kv-port", str(kv_port),
            *engine_flags(model, threads, num_blocks, max_model_len), *(extra or [])]
    proc = launcher.start(name, args, cpus=cpus, netns=netns, threads=threads)
    server = Server(proc, f"http://{host}:{http_port}", f"{host}:{port}", netns)
    launcher.wait_ready(proc, server.url + "/ready", netns=netns)
    return server


def start_prefill(launcher: Launcher, name: str, model: str, decodes: list[Server], *, threads: int | None = None,
                  cpus: str | None = None, num_blocks: int | None = None, max_model_len: int | None = None,
                  local_fallback: bool = False, netns: str | None = None, extra: list[str] | None = None) -> Server:
    port, grpc_port = free_port(), free_port()
    args = ["prefill", "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port),
            *engine_flags(model, threads, num_blocks, max_model_len), *(extra or [])]
    if decodes:
        args += ["--decode", ",".join(d.grpc for d in decodes)]
    if local_fallback:
        args.append("--local-fallback")
    proc = launcher.start(name, args, cpus=cpus, netns=netns, threads=threads)
    server = Server(proc, f"http://127.0.0.1:{port}", f"127.0.0.1:{grpc_port}", netns=netns)
    launcher.wait_ready(proc, server.url + "/ready", netns=netns)
    return server


def start_pd(launcher: Launcher, model: str, n_decodes: int = 1, *, prefill_threads: int | None = None,
             decode_threads: int | None = None, prefill_cpus: str | None = None, decode_cpus: str | None = None,
             num_blocks: int | None = None, decode_blocks: list[int] | None = None, max_model_len: int | None = None,
             prefill_extra: list[str] | None = None, decode_extra: list[str] | None = None) -> Cluster:
    """One prefill and n_decodes decodes on loopback; decode_blocks sets each decode's KV pool size."""
    decodes = [start_decode(launcher, f"decode{i}", model, threads=decode_threads, cpus=decode_cpus,
                            num_blocks=(decode_blocks[i] if decode_blocks else num_blocks),
                            max_model_len=max_model_len, extra=decode_extra)
               for i in range(n_decodes)]
    prefill = start_prefill(launcher, "prefill", model, decodes, threads=prefill_threads, cpus=prefill_cpus,
                            num_blocks=num_blocks, max_model_len=max_model_len, extra=prefill_extra)
    return Cluster(prefill, decodes)


def start_colocated(launcher: Launcher, model: str, *, threads: int | None = None, cpus: str | None = None,
                    num_blocks: int | None = None, max_model_len: int | None = None,
                    extra: list[str] | None = None) -> Cluster:
    prefill = start_prefill(launcher, "colocated", model, [], threads=threads, cpus=cpus, num_blocks=num_blocks,
                            max_model_len=max_model_len, local_fallback=True, extra=extra)
    return Cluster(prefill)


def start_routed(launcher: Launcher, model: str, n_prefills: int, n_decodes: int, *, threads: int | None = None,
                 num_blocks: int | None = None, max_model_len: int | None = None,
                 prefill_extra: list[str] | None = None,
                 decode_extra: list[str] | None = None, router_extra: list[str] | None = None,
                 prefill_cpus: str | None = None, decode_cpus: str | None = None) -> Cluster:
    """n_prefills prefills (each knows every decode) behind ``pdserve router``; Cluster.url is the router's."""
    decodes = [start_decode(launcher, f"decode{i}", model, threads=threads, cpus=decode_cpus, num_blocks=num_blocks,
                            max_model_len=max_model_len, extra=decode_extra) for i in range(n_decodes)]
    prefills = [start_prefill(launcher, f"prefill{i}", model, decodes, threads=threads, cpus=prefill_cpus,
                              num_blocks=num_blocks, max_model_len=max_model_len, extra=prefill_extra)
                for i in range(n_prefills)]
    port = free_port()
    args = ["router", "--port", str(port), "--model", model, "--log-level", "WARNING",
            "--prefill", ",".join(p.grpc for p in prefills), *(router_extra or [])]
    proc = launcher.start("router", args)
    router = Server(proc, f"http://127.0.0.1:{port}")
    launcher.wait_ready(proc, router.url + "/ready")
    return Cluster(router, decodes, prefills)
