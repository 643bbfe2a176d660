"""Run a router: the front door when there are several prefills; sends each request to the
prefill that already holds most of its prompt's KV, weighed against load.

See ``pdserve.router`` (router/__init__.py) for the request lifecycle. Prefills come from
``--prefill host:grpc_port,...`` (static), ``--discovery file --prefill-file path`` (re-read
when it changes) or ``--discovery kubernetes --prefill-selector label=value --namespace ns``
(the EndpointSlices of the prefill Services, port "grpc"). The prompts are hashed with the
prefills' tokenizer: ``--model`` names the prefills' model (a directory with its tokenizer files,
or the built-in one), or ``--tokenizer-from-prefill`` takes the files from a prefill at start
(``prefill_tokenizer.py``; the router then needs no copy of the model, and exits with status 1 when
no prefill gives them within --tokenizer-wait seconds). /ready is 503 while no prefill is routable
or the tokenizer is not loaded yet. SIGTERM/SIGINT: /ready turns 503, in-flight relays get
--drain-timeout seconds to finish, then the router stops. With --api-key-file every HTTP route but
/health, /ready and /metrics needs one of its keys (``pdserve.http_auth``); the client's
``Authorization`` header goes on to the prefill, so prefills behind a router take the same key file.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from pdserve import defaults, gc_pauses, http_auth, tls
from pdserve.server_setup import drain, setup_logging, wait_for_stop_signal
from pdserve.slo import classes as slo_classes
from pdserve.slo.policies import POLICIES

log = logging.getLogger("pdserve.router")
EVENT_LOOPS = ("uvloop", "asyncio")


def loop_factory(name: str):
    """The ``asyncio.Runner`` loop factory of ``--event-loop`` (None: the standard library's)."""
    if name not in EVENT_LOOPS:
        raise ValueError(f"event loop must be one of {EVENT_LOOPS}, got {name!r}")
    if name == "asyncio":
        return None
    import uvloop

    return uvloop.new_event_loop


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    parser.add_argument("--port", type=int, default=defaults.HTTP_PORT,
                        help="HTTP port (OpenAI API, /health, /ready, /metrics)")
    parser.add_argument("--grpc-port", type=int, default=0,
                        help="gRPC port of the Generate API, relayed to the chosen prefill's (0: no gRPC API)")
    t = parser.add_mutually_exclusive_group()
    t.add_argument("--model", default=None,  # None, not the built-in name: argparse then refuses it with the flag below
                   help="the prefills' model ('tiny' or a directory with tokenizer.json): only its tokenizer is "
                        f"loaded (default {defaults.BUILTIN_MODEL})")
    t.add_argument("--tokenizer-from-prefill", action="store_true",
                   help="instead of --model: at start, take the tokenizer files from the first prefill that answers "
                        "(GET /tokenizer on its HTTP port); /ready is 503 until they are loaded")
    parser.add_argument("--tokenizer-wait", type=float, default=defaults.TOKENIZER_WAIT_S, metavar="SECONDS",
                        help="with --tokenizer-from-prefill: how long to wait for a prefill that gives its tokenizer "
                             f"before exiting with status 1 (default {defaults.TOKENIZER_WAIT_S:g})")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds to let in-flight relays finish on shutdown")
    parser.add_argument("--log-level", default="INFO", help="logging level")
    parser.add_argument("--event-loop", choices=EVENT_LOOPS, default="uvloop",
                        help="the event loop the router runs on: uvloop (libuv's, the default: less CPU per relayed "
                             "request and SSE event) or asyncio (the standard library's)")
    d = parser.add_argument_group("prefill discovery and routing")
    d.add_argument("--discovery", choices=["static", "file", "kubernetes"], default="static",
                   help="how prefills are found")
    d.add_argument("--prefill", default="", help="static prefill gRPC addresses: host:port,host:port")
    d.add_argument("--prefill-file", default="",
                   help="file: prefill gRPC addresses, one host:port a line, re-read when "
                                                      "it changes (pdserve up --autoscale writes it)")
    d.add_argument("--prefill-selector", default="",
                   help="kubernetes: label=value[,label=value...] selecting the prefill Services")
    d.add_argument("--namespace", default="", help="kubernetes: namespace of the prefill Services")
    d.add_argument("--kubeconfig", default=None,
                   help="kubernetes: kubeconfig file (default: in-cluster, then ~/.kube/config)")
    d.add_argument("--discovery-interval", type=float, default=0.2,
                   help="seconds between discovery checks (a prefill gone from discovery leaves the index within this)")
    d.add_argument("--load-interval", type=float, default=0.2, help="seconds between load polls of each prefill")
    d.add_argument("--load-expiry", type=float, default=1.5, help="seconds after which a load report no longer counts")
    d.add_argument("--policy", choices=["prefix", "round-robin"], default="prefix",
                   help="prefix: by cached prefix and load (the default); round-robin: in turn, "
                        "blind to both (a baseline)")
    d.add_argument("--load-weight", type=float, default=64.0,
                   help="prompt tokens one request in flight is worth when weighing load against cached prefix")
    d.add_argument("--max-attempts", type=int, default=2, help="prefills to try when one cannot be connected to")
    d.add_argument("--prefill-wait", type=float, default=defaults.PREFILL_WAIT_S, metavar="SECONDS",
                   help="how long a request waits for a prefill that can take it (none is routable, or each tried "
                        "has no decode for it: a rollout's gap) before 503; 0: answer 503 at once "
                        f"(default {defaults.PREFILL_WAIT_S:g})")
    q = parser.add_argument_group("the global SLO queue (QLM), in front of every prefill")
    q.add_argument("--slo-classes", default=None,
                   help="SLO classes as JSON (the InferenceService's spec.slo) or a JSON file; "
                        "default: the environment "
                        f"variable {defaults.ENV_SLO_CLASSES} the operator sets. Declared classes "
                        f"(or --queue-policy) turn "
                        "the router's queue on: requests wait here, in the policy's order, while every prefill queues")
    q.add_argument("--queue-policy", choices=list(POLICIES), default=None,
                   help="order of the requests waiting for a prefill with room: fifo (the default with classes), edf "
                        "(earliest deadline of their class), qlm (QLM's global scheduler over request groups)")
    q.add_argument("--request-timeout", type=float, default=defaults.REQUEST_TIMEOUT_S,
                   help="seconds a request may wait in the router's queue (a client's X-Request-Timeout or gRPC "
                        "deadline shortens it); then 504 / DEADLINE_EXCEEDED naming the queue")
    http_auth.add_arguments(parser)
    tls.add_arguments(parser)


def make_discovery(args):
    from pdserve.discovery import FileDiscovery, KubernetesDiscovery, StaticDiscovery

    if args.discovery == "kubernetes":
        return KubernetesDiscovery(args.namespace, args.prefill_selector, kubeconfig=args.kubeconfig,
                                   flag="--prefill-selector")
    if args.discovery == "file":
        if not args.prefill_file:
            raise ValueError("--discovery file needs --prefill-file")
        return FileDiscovery(args.prefill_file)
    return StaticDiscovery([a for a in args.prefill.split(",") if a.strip()])


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level, "router")
    from .prompt import load_tokenizer

    for flag in ("request_timeout", "tokenizer_wait"):
        if not getattr(args, flag) > 0:
            raise SystemExit(f"pdserve router: --{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")
    try:
        discovery = make_discovery(args)
        tokenizer = None  # --tokenizer-from-prefill: loaded once the router serves (serve)
        if not args.tokenizer_from_prefill:
            args.model = args.model or defaults.BUILTIN_MODEL
            tokenizer = load_tokenizer(args.model)
        args.slo = None
        if args.slo_classes or os.environ.get(defaults.ENV_SLO_CLASSES) or args.queue_policy:
            args.slo = slo_classes.load(args.slo_classes)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"pdserve router: {exc}")
    if args.discovery == "static" and not discovery.addresses():
        raise SystemExit("pdserve router: no --prefill given")
    door = http_auth.Door.from_args(args, "pdserve router")
    args.tls = tls.from_args(args, "pdserve router")
    with asyncio.Runner(loop_factory=loop_factory(args.event_loop)) as runner:
        return runner.run(serve(args, discovery, tokenizer, door))


async def serve(args: argparse.Namespace, discovery, tokenizer, door: http_auth.Door) -> int:
    """``tokenizer``: None with --tokenizer-from-prefill (a PrefillTokenizer loads it once the router serves);
    ``door``: the API keys (every HTTP route but /health, /ready, /metrics)."""
    import grpc
    from aiohttp import web

    from pdserve.metrics import ServerMetrics
    from pdserve.protos import generate_pb2_grpc as gpb_grpc

    from .grpc_api import RouterGenerateServicer
    from .http_api import RouterApi
    from pdserve.kv_index import PrefixIndex
    from .prefill_tokenizer import PrefillTokenizer
    from .prefills import PrefillSet
    from .relay import Relays
    from .router import Router

    metrics = ServerMetrics.from_env(role="router")
    index = PrefixIndex()
    prefills = PrefillSet(discovery, index, metrics, name=f"router:{args.port}", interval_s=args.discovery_interval,
                          load_interval_s=args.load_interval, load_expiry_s=args.load_expiry, tls=args.tls)
    router = Router(prefills, index, tokenizer, metrics, args.load_weight, args.policy)
    own_key = door.keys.first() if door.keys is not None else None  # the prefills take the same keys
    from_prefill = PrefillTokenizer(prefills, args.tokenizer_wait, api_key=own_key) if tokenizer is None else None
    gate = None
    if args.slo is not None:
        from pdserve.slo import GlobalQueue

        from .slo_gate import SloGate

        gate = SloGate(GlobalQueue(args.slo, args.queue_policy or "fifo", metrics), prefills)
    draining = {"on": False}
    relays = Relays(router, metrics, args.max_attempts, args.prefill_wait)  # both doors' relays (relay.py)
    api = RouterApi(router, metrics, is_draining=lambda: draining["on"], gate=gate,
                    request_timeout_s=args.request_timeout, tokenizer_source=from_prefill, relays=relays)
    generate = RouterGenerateServicer(router, metrics, gate=gate, request_timeout_s=args.request_timeout,
                                      relays=relays)
    await prefills.start()
    app = api.app()
    door.counted_by(metrics).install(app)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port).start()
    grpc_server = None
    if args.grpc_port:
        grpc_server = grpc.aio.server()
        gpb_grpc.add_GeneratorServicer_to_server(generate, grpc_server)
        tls.add_port(grpc_server, f"{args.host}:{args.grpc_port}", args.tls)
        await grpc_server.start()
    gc_pauses.settle(metrics.gc_full_collection.observe)  # freeze the start-up heap, time full collections
    log.info("router ready: http %s:%d, grpc %s, prefills %s, policy %s, load weight %g tokens/request, tokenizer %s",
             args.host, args.port, args.grpc_port or "off", discovery.addresses() or "(none yet)", args.policy,
             args.load_weight, "from a prefill (not loaded yet)" if from_prefill else args.model)
    log.info("HTTP door: %s", door.describe())
    if gate is not None:
        log.info("SLO queue: policy %s, classes %s", gate.queue.policy, "; ".join(c.describe() for c in args.slo))
    stop = asyncio.ensure_future(wait_for_stop_signal())
    status = 0
    if from_prefill is not None:
        sig, status = await _load_tokenizer_until(stop, from_prefill, router)
    else:
        sig = await stop
    draining["on"] = True
    in_flight = lambda: api.in_flight + generate.in_flight + (gate.waiting() if gate else 0)  # noqa: E731
    log.info("%s: draining %d in-flight request(s)", sig, in_flight())
    left = await drain(in_flight, args.drain_timeout)
    if left:
        log.warning("stopping with %d request(s) still in flight", left)
    if grpc_server is not None:
        await grpc_server.stop(grace=1.0)
    await runner.cleanup()
    await prefills.stop()
    return status


async def _load_tokenizer_until(stop: asyncio.Future, from_prefill, router) -> tuple[str, int]:
    """Load the router's tokenizer from a prefill while serving, then wait for a stop signal:
    (the signal's name, 0); or (why, 1) when no prefill gave its tokenizer in time."""
    from .prefill_tokenizer import TokenizerUnavailable

    loading = asyncio.ensure_future(from_prefill.load())
    await asyncio.wait({stop, loading}, return_when=asyncio.FIRST_COMPLETED)
    if not loading.done():  # stopped while still waiting for a prefill
        loading.cancel()
        await asyncio.gather(loading, return_exceptions=True)
        return stop.result(), 0
    try:
        router.tokenizer = loading.result()
    except TokenizerUnavailable as exc:
        log.error("pdserve router: %s", exc)
        stop.cancel()
        return "no tokenizer", 1
    return await stop, 0
