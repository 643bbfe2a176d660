"""Chaos benchmark: SIGKILL and pause servers of a local cluster under streaming load, and
check that every request completes, fails with a clear error, and never hangs or returns
wrong text; and that nothing is left held afterwards.

  pdserve bench chaos --duration 600 --transfer tcp
  pdserve bench chaos --duration 120 --transfer nixl --faults kill-decode,stop-decode
  pdserve bench chaos --netem --duration 60 --netem-spec "delay 50ms 20ms loss 2%"

It starts its own ``pdserve up --prefill 1 --decode 3`` (whose supervisor restarts
killed servers), computes each prompt's greedy reference text before any fault, then runs
the load and the fault loop together. Outcomes per request: completed, failed (a clear
error), cut (a stream that ended without saying why), hung (no byte for --hang-s) and
wrong (greedy text differing from the reference). At the end every server's KV blocks,
Sessions, CacheStore entries and queued requests must be back to zero. Writes
<out>/<name>.json and <out>/<name>.png; exits 1 when the target is missed: 0 cut, 0 hung,
0 wrong, 0 leaked and >= 99.9% completed of EVERY request sent with --prefill 2 or more (the
router resumes the streams of a prefill that dies); with one prefill (no router, its death
ends its streams) of the requests that met no prefill outage, labelled as such.

--netem (root) runs all of it inside a fresh network namespace ``pdchaos-<pid>`` and adds
the fault kind ``netem``: tc delay/loss on the prefill <-> decode traffic only (netem.py).

Reading path: cli.py (the phases), load.py (client), faults.py (chaos loop), outcome.py
(classification), leaks.py (what must be zero), report.py (table, JSON, PNG), netem.py
(namespace and tc).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pdserve.cachestore import TRANSPORTS
from pdserve.defaults import BUILTIN_MODEL

from .faults import KINDS

NON_NETWORK_KINDS = tuple(k for k in KINDS if k != "netem")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("cluster (started with pdserve up)")
    g.add_argument("--transfer", choices=TRANSPORTS, default="tcp", help="KV transport between prefill and decode")
    g.add_argument("--prefill", type=int, default=1, help="prefill processes")
    g.add_argument("--decode", type=int, default=3, help="decode processes (>= 2)")
    g.add_argument("--model", default=BUILTIN_MODEL, help="model of the servers (default: %(default)s)")
    g.add_argument("--threads", type=int, default=1, help="torch CPU threads per server")
    g.add_argument("--num-blocks", type=int, default=256, help="KV blocks per server")
    g.add_argument("--session-timeout", type=float, default=10.0,
                   help="servers' --session-timeout: how long a decode keeps blocks of a prefill that died")
    g.add_argument("--ready-timeout", type=float, default=300.0, help="seconds for the cluster to start")
    g = parser.add_argument_group("load")
    g.add_argument("--duration", type=float, default=600.0, help="seconds of load under chaos")
    g.add_argument("--concurrency", type=int, default=6, help="streaming requests kept in flight")
    g.add_argument("--pool", type=int, default=24, help="distinct prompts (mixed lengths), each with a reference text")
    g.add_argument("--sampled-fraction", type=float, default=0.25,
                   help="fraction of requests sampled at temperature 0.8 (not checked); the "
                        "rest are greedy and checked")
    g = parser.add_argument_group("faults")
    g.add_argument("--faults", default=None,
                   help=f"comma-separated kinds to inject, among {','.join(KINDS)} "
                        "(default: all; netem only with --netem)")
    g.add_argument("--fault-interval", type=float, default=10.0, help="mean seconds between faults")
    g.add_argument("--pause-min", type=float, default=1.0, help="shortest SIGSTOP pause, seconds")
    g.add_argument("--pause-max", type=float, default=5.0, help="longest SIGSTOP pause, seconds")
    g.add_argument("--netem", action="store_true",
                   help="run everything in a fresh network namespace pdchaos-<pid> (needs root) and enable the "
                        "netem fault: tc on the prefill<->decode traffic only")
    g.add_argument("--netem-spec", default="delay 50ms 20ms loss 2%",
                   help="what a netem fault applies (netem words: delay T [JITTER], loss P%%, rate R); "
                        "default: %(default)s")
    g.add_argument("--netem-min", type=float, default=3.0, help="shortest netem fault, seconds")
    g.add_argument("--netem-max", type=float, default=6.0, help="longest netem fault, seconds")
    g = parser.add_argument_group("judging and report")
    g.add_argument("--hang-s", type=float, default=30.0, help="a request with no byte for this long is hung")
    g.add_argument("--leak-timeout", type=float, default=60.0,
                   help="seconds after the load for every server to hold nothing (> --session-timeout)")
    g.add_argument("--seed", type=int, default=0, help="random seed of prompts, load and faults")
    g.add_argument("--out", type=Path, default=Path("bench-results"), help="directory for the JSON and PNG")
    g.add_argument("--name", default=None, help="file name stem of the outputs (default: chaos-<transfer>)")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from .cli import run_chaos, validate

    args.name = args.name or f"chaos-{args.transfer}"
    if args.faults is None:
        args.faults = ",".join(KINDS if args.netem else NON_NETWORK_KINDS)
    try:
        validate(args)
    except ValueError as e:
        print(f"pdserve bench chaos: error: {e}", file=sys.stderr)
        return 2
    try:
        if args.netem:
            from .netem import inside_namespace, run_in_namespace

            args.netns = inside_namespace()
            if args.netns is None:  # not yet inside: the same command again, in a fresh namespace
                return run_in_namespace(sys.argv[1:])
            _sigterm_interrupts()
        return run_chaos(args)
    except RuntimeError as e:
        print(f"pdserve bench chaos: {e}", file=sys.stderr)
        return 1


def _sigterm_interrupts() -> None:
    """Inside the namespace: SIGTERM (forwarded by the parent) stops the run like Ctrl-C, cleanup included."""
    import signal

    def on_term(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
