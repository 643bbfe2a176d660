"""Run a prefill server: the front door (OpenAI HTTP + gRPC Generate) that splits each
request with a decode server.

Request lifecycle on prefill:

1. **accept** - HTTP /v1/completions, /v1/chat/completions or gRPC Generate; validate and
   tokenize (bad input: 400 / INVALID_ARGUMENT naming the field); its SLO class (--slo-classes:
   header X-SLO-Class or body priority; unknown: 400 naming the known ones); a class with
   early rejection whose SLO cannot be met even if served next: 429 + Retry-After at once.
2. **pick** - the DecodePicker chooses a decode: weighted round robin on free KV bytes
   from load reports polled every --load-report-interval seconds (``--policy rr`` for
   plain round robin); only decodes with our protocol version and a fresh report. With
   --decode-reuse (default) it prefers a decode whose prefix cache holds the prompt's
   leading blocks (each decode's KV events, followed on its gRPC port), weighed against
   free memory; a full decode never.
3. **session** - one bidirectional Session stream to that decode: Start -> Allocation
   (or Refusal: next decode, at most --max-attempts; then --local-fallback; if every
   decode was only busy, wait in the admission queue, in the order of --queue-policy (fifo:
   first come first served; edf; qlm), until a decode has the blocks or the request's
   deadline passes (504); at most
   --max-queued-requests wait (one more: 429); a request larger than any decode's whole
   pool: 413 at once; else 503). The Allocation says how many leading prompt blocks the
   decode already holds (pinned for the request).
4. **decide** - --disaggregation auto: the cost model (measured prefill throughput, link
   bandwidth, the decode's load) says whether the prompt is computed here (5-6) or on the
   decode (``ComputePrompt``: the decode computes what it lacks, streams every token; go
   to 7); ``always`` (default): here; ``never``: on the decode. Metric label + log field.
5. **prefill + push** - the forward pass runs layer by layer; the CacheStore sender pushes
   each layer's blocks the decode lacks as soon as they are written.
6. **first token** - sampled here, sent on the Session and to the client.
7. **relay** - decode's tokens stream back on the Session and out to the client. If the
   decode dies mid-generation, the request resumes on another decode (prefill of prompt +
   tokens so far) unless --no-resume; when none can take it now (full, or not reported yet)
   it waits in the admission queue up to --resume-wait seconds for one; then the client gets
   an error event.
8. **release** - prefill's KV blocks after the push; the Session and CacheStore entry at
   the end, whatever happened (a client disconnect cancels the Session, so decode frees
   its side at once).

Batch jobs (OpenAI's /v1/files and /v1/batches, the top-level ``batch/`` package): kept in --batch-db (SQLite);
their lines run as step 1-8 requests, at most --batch-max-in-flight at once, in the SLO class
--batch-slo-class; unfinished jobs resume at start-up, each line finishing exactly once.

A router that mounts no model (``pdserve router --tokenizer-from-prefill``) takes this server's
config and tokenizer files from GET /tokenizer on the HTTP port (``tokenizer_api.py``).

KV events for routers (``pdserve.kv_events``, ``protos/kv_events.proto``) are served on the
gRPC port: the prefix cache's hash set as a snapshot then BlockStored/BlockRemoved events
stamped with this process's epoch and a sequence number, and ``GetLoad``.

Deadlines: a request ends within --request-timeout seconds (shortened by the client's
X-Request-Timeout header or gRPC deadline) with 504 / an SSE error event / gRPC
DEADLINE_EXCEEDED, and its Session is cancelled; the Session carries that deadline to the
decode as its gRPC deadline. Every wait on a decode has a timer: --connect-timeout for
its allocation, --session-timeout for the KV push and between two of its messages (a
frozen decode is given up on, and the request resumes elsewhere or ends with an error).

Decode discovery: ``--decode host:port,...`` (static), ``--discovery file --decode-file
path`` (re-read when it changes) or ``--discovery kubernetes --decode-selector label=value
--namespace ns`` (watches the EndpointSlices of the selected decode Services). A decode
that leaves discovery gets no new request; the Sessions open on it finish. /ready is 503
while no decode is routable, unless --local-fallback is on. SIGTERM/SIGINT: /ready turns 503, in-flight requests get
--drain-timeout seconds to finish, then the server stops.

Start-up: ``run`` checks the flags, ``serve`` starts the parts (``wiring.py`` says in which order
and what each is given), serves until SIGTERM/SIGINT, drains and stops them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from pdserve import defaults, http_auth
from pdserve.server_setup import add_server_arguments, ensure_engine_environment, setup_logging, wait_for_stop_signal
from pdserve.slo import POLICIES
from pdserve.slo import classes as slo_classes

log = logging.getLogger("pdserve.prefill")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_arguments(parser, drains="in-flight requests")
    parser.add_argument("--port", type=int, default=defaults.HTTP_PORT,
                        help="HTTP port (OpenAI API, /health, /ready, /metrics)")
    parser.add_argument("--grpc-port", type=int, default=defaults.PREFILL_GRPC_PORT, help="gRPC port (Generate)")
    d = parser.add_argument_group("decode discovery and routing")
    d.add_argument("--discovery", choices=["static", "file", "kubernetes"], default="static",
                   help="how decodes are found")
    d.add_argument("--decode", default="", help="static decode gRPC addresses: host:port,host:port")
    d.add_argument("--decode-file", default="",
                   help="file: decode gRPC addresses, one host:port a line, re-read when it "
                                                     "changes (pdserve up --autoscale writes it)")
    d.add_argument("--decode-selector", default="", help="kubernetes: label=value selecting the decode Services")
    d.add_argument("--namespace", default="", help="kubernetes: namespace of the decode Services")
    d.add_argument("--kubeconfig", default=None,
                   help="kubernetes: kubeconfig file (default: in-cluster, then ~/.kube/config)")
    d.add_argument("--policy", choices=["wrr", "rr"], default="wrr",
                   help="wrr: weighted by free KV memory; rr: round robin")
    d.add_argument("--load-report-interval", type=float, default=0.3, help="seconds between load report polls")
    d.add_argument("--load-report-expiry", type=float, default=1.5,
                   help="seconds after which a load report no longer counts")
    d.add_argument("--max-attempts", type=int, default=3, help="decodes to try per request before falling back")
    d.add_argument("--no-resume", dest="resume", action="store_false",
                   help="when a decode fails mid-generation, end the stream with an error instead of resuming the "
                        "request on another decode (re-prefilling prompt + tokens so far)")
    d.add_argument("--decode-leave-grace", type=float, default=None,
                   help="seconds the open Sessions on a decode that left discovery may still run before its channel "
                        "closes (a draining decode finishes them meanwhile); the ones still open then resume on "
                        "another decode (see --no-resume). Default: --request-timeout")
    d.add_argument("--local-fallback", action="store_true", help="decode locally when no decode can take a request")
    d.add_argument("--queue-timeout", type=float, default=None,
                   help="seconds a request may wait in the admission queue for free KV blocks (all decodes busy) "
                        "before a 503 (default: until the request's deadline, then 504)")
    d.add_argument("--resume-wait", type=float, default=defaults.RESUME_WAIT_S,
                   help="seconds a request whose decode failed mid-generation waits in the admission queue for "
                        "another decode when none can take it now (all full, or not reported yet) before its stream "
                        "ends with a decode_failed error (never past the request's deadline; default %(default)g; "
                        "0: end it at once)")
    d.add_argument("--max-queued-requests", type=int, default=defaults.MAX_QUEUED_REQUESTS,
                   help="requests that may wait at once in the admission queue; one more gets 429 (queue_full)")
    d.add_argument("--queue-policy", choices=list(POLICIES), default="fifo",
                   help="order of the requests waiting for free KV blocks: fifo (arrival), edf (earliest deadline of "
                        "their SLO class), qlm (QLM's global scheduler: request groups reordered to minimise SLO "
                        "misses, from the waiting-time estimator)")
    d.add_argument("--slo-classes", default=None,
                   help="SLO classes as JSON (the InferenceService's spec.slo) or a JSON file; default: the "
                        f"environment variable {defaults.ENV_SLO_CLASSES} the operator sets, else one best-effort "
                        "class 'default'. Requests pick one with the header X-SLO-Class or the body field priority")
    d.add_argument("--connect-timeout", type=float, default=5.0,
                   help="seconds to wait for a decode's allocation answer")
    d.add_argument("--request-timeout", type=float, default=defaults.REQUEST_TIMEOUT_S,
                   help="end-to-end deadline of a request in seconds (clients may shorten it with the header "
                        "X-Request-Timeout or a gRPC deadline); then 504 / an SSE error event / DEADLINE_EXCEEDED "
                        "and everything the request holds is freed on both ends")
    d.add_argument("--scheduler", choices=["priority", "fifo"], default="priority", help="CacheStore sender scheduling")
    d.add_argument("--decode-reuse", action=argparse.BooleanOptionalAction, default=True,
                   help="decodes serve a prompt's leading blocks from their prefix cache (finished requests' KV) "
                        "and only the missing blocks move; the picker prefers a decode that holds the prefix "
                        "(--no-decode-reuse: every prompt block moves, the picker ignores prefixes)")
    d.add_argument("--disaggregation", choices=defaults.DISAGGREGATION_MODES, default=defaults.DISAGGREGATION,
                   help="where prompts are computed: always here with the KV moved (P/D, the default); never: on "
                        "the decode itself; auto: per request by cost (measured prefill throughput and link "
                        "bandwidth, the decode's cached prefix and load)")
    d.add_argument("--no-layerwise-push", dest="layerwise_push", action="store_false",
                   help="send the KV only after the whole forward pass instead of each layer as it is written "
                        "(turns compute/transfer overlap off; for comparison)")
    b = parser.add_argument_group("OpenAI Batch API (/v1/files, /v1/batches; docs/batch.md)")
    b.add_argument("--batch-db", default=defaults.BATCH_DB,
                   help="SQLite database of batch jobs and files; unfinished jobs resume from it after a restart "
                        "(one prefill per database; '' turns the Batch API off)")
    b.add_argument("--batch-max-in-flight", type=int, default=defaults.BATCH_MAX_IN_FLIGHT,
                   help="batch lines running at once over all jobs (the others wait; online traffic keeps room)")
    b.add_argument("--batch-max-file-bytes", type=int, default=defaults.BATCH_MAX_FILE_BYTES,
                   help="largest file POST /v1/files accepts (a larger one: 400 file_too_large)")
    b.add_argument("--batch-slo-class", default=None,
                   help=f"SLO class of batch lines (default: {defaults.BATCH_SLO_CLASS!r} when --slo-classes declares "
                        f"it, else the default class); with --queue-policy edf or qlm a class without targets waits "
                        f"behind the online classes")
    http_auth.add_arguments(parser)


def make_discovery(args):
    from pdserve.discovery import FileDiscovery, KubernetesDiscovery, StaticDiscovery

    if args.discovery == "kubernetes":
        return KubernetesDiscovery(args.namespace, args.decode_selector, kubeconfig=args.kubeconfig)
    if args.discovery == "file":
        if not args.decode_file:
            raise ValueError("--discovery file needs --decode-file")
        return FileDiscovery(args.decode_file)
    return StaticDiscovery([a for a in args.decode.split(",") if a.strip()])


def run(args: argparse.Namespace) -> int:
    ensure_engine_environment(args)
    setup_logging(args.log_level, "prefill")
    for flag in ("request_timeout", "session_timeout", "connect_timeout", "queue_timeout",
                 "batch_max_in_flight", "batch_max_file_bytes"):
        value = getattr(args, flag)
        if value is not None and not value > 0:
            raise SystemExit(f"pdserve prefill: --{flag.replace('_', '-')} must be > 0, got {value}")
    if args.max_queued_requests < 0:
        raise SystemExit(f"pdserve prefill: --max-queued-requests must be >= 0, got {args.max_queued_requests}")
    if args.decode_leave_grace is not None and not args.decode_leave_grace >= 0:
        raise SystemExit(f"pdserve prefill: --decode-leave-grace must be >= 0, got {args.decode_leave_grace}")
    if not args.resume_wait >= 0:
        raise SystemExit(f"pdserve prefill: --resume-wait must be >= 0, got {args.resume_wait}")
    try:
        discovery = make_discovery(args)
        slo = slo_classes.load(args.slo_classes)
    except ValueError as exc:
        raise SystemExit(f"pdserve prefill: {exc}")
    if args.batch_slo_class is not None and args.batch_slo_class not in slo.names():
        raise SystemExit(f"pdserve prefill: --batch-slo-class {args.batch_slo_class!r} is not a declared SLO class; "
                         f"known: {slo.known()}")
    door = http_auth.Door.from_args(args, "pdserve prefill")  # before the model loads: a bad key file ends it at once
    if args.discovery == "static" and not discovery.addresses() and not args.local_fallback:
        log.warning("no --decode given and no --local-fallback: every request will get 503")
    return asyncio.run(serve(args, discovery, slo, door))


async def serve(args: argparse.Namespace, discovery, slo: slo_classes.SloClasses, door: http_auth.Door) -> int:
    """Start the parts (``wiring.py``), serve until SIGTERM/SIGINT, drain, stop."""
    from .wiring import start

    server = await start(args, discovery, slo, door)
    sig = await wait_for_stop_signal()
    await server.drain(sig, args.drain_timeout)
    await server.stop()
    return 0
