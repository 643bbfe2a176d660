"""The flags of ``pdserve up`` (up.py): what it starts, how it supervises, how it autoscales."""

from __future__ import annotations

import argparse

from pdserve import defaults, tls
from pdserve.cachestore import TRANSPORTS
from pdserve.http_auth import API_KEY_FILE_HELP

from . import autoscale
from .supervisor import POLICIES

UP_ENGINES = ("builtin", "sim")  # the servers' --engine choices up starts (vLLM's needs its own environment)
SIM_DEFAULT_PROFILE = "cpu-small"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=defaults.BUILTIN_MODEL, help="'tiny' (built-in) or a model directory")
    parser.add_argument("--engine", choices=UP_ENGINES, default="builtin",
                        help="every server's engine: builtin, or sim (no model: the scheduler, prefix cache and KV "
                             "moves of builtin, each step the time --sim-profile models; engine/sim/); a sim server "
                             "takes 60-75 MiB, so a hundred fit in 8 GiB")
    parser.add_argument("--sim-profile", default=SIM_DEFAULT_PROFILE, metavar="PATH",
                        help="--engine sim: the profile JSON, or a shipped one by name: cpu-small (measured on a "
                             "2-core Xeon for the bench's small model), h200-llama3-8b (default %(default)s)")
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill processes")
    parser.add_argument("--decode", type=int, default=2, help="number of decode processes")
    parser.add_argument("--transfer", choices=TRANSPORTS, default="tcp", help="KV transport between them")
    parser.add_argument("--port", type=int, default=defaults.HTTP_PORT,
                        help="HTTP port of the OpenAI endpoint: the prefill's, or with --prefill > 1 the router's "
                             "(the prefills then get free ports)")
    parser.add_argument("--grpc-port", type=int, default=defaults.PREFILL_GRPC_PORT,
                        help="gRPC port of the Generate API: the prefill's, or with --prefill > 1 the router's")
    parser.add_argument("--policy", choices=["wrr", "rr"], default="wrr", help="decode selection policy")
    parser.add_argument("--local-fallback", action="store_true",
                        help="prefills decode locally when no decode can take a request")
    parser.add_argument("--disaggregation", choices=defaults.DISAGGREGATION_MODES, default=defaults.DISAGGREGATION,
                        help="where prefills compute prompts: always themselves (KV moved), never (the decode does), "
                             "auto (per request, by measured cost)")
    parser.add_argument("--decode-reuse", action=argparse.BooleanOptionalAction, default=True,
                        help="decodes serve prompts' cached prefixes, only missing KV blocks move "
                             "(--no-decode-reuse: all move)")
    parser.add_argument("--quantization", choices=defaults.QUANTIZATIONS, default=None,
                        help=defaults.QUANTIZATION_HELP)
    parser.add_argument("--num-blocks", type=int, default=256, help="KV blocks per process")
    parser.add_argument("--kv-cache-dtype", choices=defaults.KV_CACHE_DTYPES, default="auto",
                        help="every server's: " + defaults.KV_CACHE_DTYPE_HELP)
    parser.add_argument("--max-num-batched-tokens", type=int, default=defaults.MAX_NUM_BATCHED_TOKENS, metavar="N",
                        help="every server's engine: tokens one step computes, prompt chunks and decode rows together "
                             "(chunked prefill; default %(default)s)")
    parser.add_argument("--long-prefill-threshold", type=int, default=defaults.LONG_PREFILL_THRESHOLD, metavar="N",
                        help="every server's engine: while a short prompt waits, the most tokens of a long prompt a "
                             "step computes (0: the whole budget; default %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads per process (per rank)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="every server's engine split over N ranks, one process each (engine/tp/); P/D KV goes "
                             "through each server's rank 0 (engine/tp/transfer.py) (default: 1)")
    parser.add_argument("--log-dir", default=None,
                        help="where process logs go, with servers.json and a <server>.pid per running server "
                             "(default: a new temporary folder)")
    parser.add_argument("--ready-timeout", type=float, default=180.0,
                        help="seconds to wait for all processes to be ready")
    parser.add_argument("--extra", default="", help="extra flags passed to every server process (one string)")
    parser.add_argument("--prefill-extra", default="", help="extra flags passed to every prefill process (one string)")
    parser.add_argument("--api-key-file", default=None, metavar="PATH",
                        help="passed to the router and every prefill (the OpenAI doors); the decodes' ports take no "
                             "keys. " + API_KEY_FILE_HELP)
    parser.add_argument("--tls", action="store_true",
                        help="mutual TLS on every internal connection with a throwaway CA and certificate made in "
                             "<log-dir>/tls at start (or give your own: --tls-cert/--tls-key/--tls-ca)")
    tls.add_arguments(parser)
    r = parser.add_argument_group("supervision (what happens when a server process dies)")
    r.add_argument("--restart", choices=POLICIES, default="always",
                   help="always: restart it with capped exponential backoff, same ports, the others keep serving; "
                        "never: stop the whole cluster (for debugging)")
    r.add_argument("--backoff-initial", type=float, default=0.5,
                   help="seconds before the first restart (doubles each time)")
    r.add_argument("--backoff-cap", type=float, default=10.0, help="longest wait between restarts, seconds")
    r.add_argument("--backoff-reset", type=float, default=30.0,
                   help="a run that stayed up this many seconds resets the backoff to --backoff-initial")
    r.add_argument("--max-failed-starts", type=int, default=5,
                   help="give up (and stop everything) when a server dies before becoming "
                        "ready this many times in a row")
    autoscale.add_arguments(parser)
