"""API keys at the OpenAI doors (the router, the prefill with its Batch API, ``pdserve batch-server``):
the flags, and the aiohttp middleware that checks ``Authorization: Bearer <key>`` before any handler.

Each request, in order:

1. ``/health`` and ``/ready`` (``OPEN_PATHS``): let in, always (kubelet probes, ``pdserve up``);
2. ``/metrics``: let in, unless ``--metrics-key-file`` is given: then it needs one of those keys;
3. anything else (the OpenAI routes, /v1/files and /v1/batches, /tokenize, /tokenizer, /debug/...,
   and unknown paths, which so get 401 rather than 404): needs a key of ``--api-key-file``. Without
   one: 401 with an OpenAI error body (code ``invalid_api_key``) and ``WWW-Authenticate: Bearer``;
   counted in ``api_key_refusals`` (reason missing|invalid). With one: counted in
   ``api_key_requests`` under the key's name (api_keys.py), then the handler runs.

The key file is read once at start (``Door.from_args``); an unreadable or empty one ends the process at
start with one line naming it. A key is never logged or put in a label: only its name. The router
forwards the client's ``Authorization`` header to the prefill it relays to (``router/http_api.py``), so a
prefill behind a router takes the same key file. docs/security.md says what the keys stop and what not.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace

from aiohttp import hdrs, web

from pdserve import api_keys

OPEN_PATHS = frozenset({"/health", "/ready"})
METRICS_PATH = "/metrics"
SCHEME = "bearer"
API_KEY_FILE_HELP = ("API keys clients must send as 'Authorization: Bearer <key>' on every route but /health, "
                     "/ready and /metrics: a file with one key a line, or name:key (the name is what the "
                     "metrics count requests under); blank lines and # comments ignored. Default: no keys, every "
                     "route open. docs/security.md")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--api-key-file and --metrics-key-file, in a group of their own."""
    g = parser.add_argument_group("API keys (docs/security.md)")
    g.add_argument("--api-key-file", default=None, metavar="PATH", help=API_KEY_FILE_HELP)
    g.add_argument("--metrics-key-file", default=None, metavar="PATH",
                   help="keys (the same format) that GET /metrics then needs as 'Authorization: Bearer <key>'. "
                        "Default: /metrics open")


def unauthorized(message: str) -> web.Response:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    return web.json_response(body, status=401, headers={hdrs.WWW_AUTHENTICATE: "Bearer"})


def presented_key(request: web.Request) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, or None."""
    scheme, _, key = request.headers.get(hdrs.AUTHORIZATION, "").strip().partition(" ")
    key = key.strip()
    return key if scheme.lower() == SCHEME and key else None


@dataclass(slots=True)
class Door:
    """Which keys a server's HTTP port asks for; ``metrics``: the ServerMetrics that count (None: not counted)."""

    keys: api_keys.ApiKeys | None
    metrics_keys: api_keys.ApiKeys | None = None
    metrics: object | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace, prog: str) -> Door:
        """The keys of --api-key-file and --metrics-key-file (not counted yet: ``counted_by``); a file that cannot
        be used ends the process with one line, ``prog: <file>: <why>``."""
        try:
            keys = api_keys.ApiKeys(api_keys.load(args.api_key_file)) if args.api_key_file else None
            metrics_keys = api_keys.ApiKeys(api_keys.load(args.metrics_key_file)) if args.metrics_key_file else None
        except api_keys.KeyFileError as exc:
            raise SystemExit(f"{prog}: {exc}") from None
        return cls(keys, metrics_keys)

    def counted_by(self, metrics) -> Door:
        """This door, its requests counted per key in ``metrics`` (a ServerMetrics)."""
        return replace(self, metrics=metrics)

    @property
    def guarded(self) -> bool:
        return self.keys is not None or self.metrics_keys is not None

    def describe(self) -> str:
        """For the start-up line: the key names, never the keys."""
        api = f"{len(self.keys.keys)} API key(s) ({', '.join(self.keys.names)})" if self.keys else "no API keys"
        return api + (", /metrics behind its own key(s)" if self.metrics_keys else "")

    def install(self, app: web.Application) -> None:
        """Check keys on ``app`` before any of its handlers (nothing when no keys were given)."""
        if self.guarded:
            app.middlewares.append(self.middleware)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        if request.path in OPEN_PATHS:
            return await handler(request)
        if request.path == METRICS_PATH:  # scrapes are not counted per key
            keys, counted = self.metrics_keys, False
        else:
            keys, counted = self.keys, self.metrics is not None
        if keys is None:
            return await handler(request)
        key, refused = _check(request, keys)
        if key is None:
            if counted:
                self.metrics.api_key_refusals.labels(reason=refused).inc()
            return unauthorized(_MESSAGES[refused])
        if counted:
            self.metrics.api_key_requests.labels(api_key=key.name).inc()
        return await handler(request)


def _check(request: web.Request, keys: api_keys.ApiKeys) -> tuple[api_keys.ApiKey | None, str]:
    """(the key the request presents, "") or (None, why not: missing | invalid)."""
    presented = presented_key(request)
    if presented is None:
        return None, "missing"
    key = keys.match(presented)
    return key, "" if key is not None else "invalid"


_MESSAGES = {
    "missing": "no API key: send one as 'Authorization: Bearer <key>' (the OpenAI client's api_key)",
    "invalid": "the API key is not one of this server's keys",
}
