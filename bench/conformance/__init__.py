"""Conformance suite: check any OpenAI-compatible endpoint (pdserve, vLLM's P/D proxy, a
colocated server) for correct answers, clean cancellation, 4xx on bad input and, given a
kill command, sane streams when a server process dies. Prints a pass/fail table.

  pdserve bench conformance --url http://127.0.0.1:8000
  pdserve bench conformance --url http://127.0.0.1:8000 --reference-url http://127.0.0.1:8100
  pdserve bench conformance --url http://127.0.0.1:8000 --json conformance.json \\
      --kill-cmd decode='kill -9 $(cat /tmp/up/decode-0.pid)' --areas faults

Areas and checks (each check's module docstring says what it asserts and why):

  correctness   models; greedy.* (temperature 0: equal to --reference-url, or without one
                to a repeated request), stream.* (streamed = not streamed), stop.* (output
                ends before the stop string, finish_reason "stop"), n.* (n choices indexed
                0..n-1), logprobs.* (one per token, finite, <= 0, greedy = argmax), usage.*
                (prompt_tokens consistent; completion_tokens = tokens streamed, counted from
                stream_options.include_usage), usage.tokenize (counts = POST /tokenize's,
                where the server has it), sse.* (valid JSON events, same id, one per token in
                order, exactly one data: [DONE] at the end); on /v1/completions and
                /v1/chat/completions (bench/conformance/correctness.py)
  client        the official openai client (AsyncOpenAI) parses the same answers and raises
                APIStatusError 4xx on bad input; skipped without the openai package (sdk.py)
  bad-input     malformed requests (missing model/prompt/messages, negative or string or
                beyond-context max_tokens, a prompt beyond the context, absurd n, wrong
                types, invalid JSON, unknown model, a bad streaming request, ...): each a
                4xx with an OpenAI error body, never a 5xx or a hang; then the server
                still serves (bad_input.py)
  cancellation  a client closes a stream (completions, chat) or a whole request mid-way: the
                server's in-flight counters return to before (where /metrics has them;
                optional: a server without them passes the rest) and it serves the next
                request with the same greedy text (cancellation.py)
  faults        only with --kill-cmd ROLE=CMD: under --fault-streams concurrent greedy
                streams, CMD runs once every stream produced --fault-after-tokens tokens;
                each stream must complete (text = reference) or end with a clear error
                (error event, HTTP error, broken connection); none may hang, end silently
                (cut) or be wrong; then the endpoint must serve again within
                --recover-timeout. Counts per outcome are reported (faults.py)

Verdicts: PASS, FAIL (an assertion failed, the check raised, or it hit a hang guard) or SKIP
(not applicable here; the detail says why). Every request is bounded: --hang-s without a byte
or --request-timeout in all is a hang, reported as a failure, never waited out; every check
is bounded by --check-timeout. Exit status: 0 when no check failed, 1 when one did, 2 when
the command line is wrong or --url cannot be reached.

Requests use one extension, "ignore_eos": true (vLLM's; pdserve and SGLang take it too), so
a run is exactly max_tokens long; --no-ignore-eos leaves it out for servers that refuse it.
pdserve's local cluster: `pdserve up --log-dir DIR` writes DIR/<server>.pid (e.g.
DIR/decode-0.pid) for --kill-cmd; pass a decode's /metrics with --metrics-url to see a
cancellation reach it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .runner import AREAS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("endpoints")
    g.add_argument("--url", required=True,
                   help="base URL of the endpoint under test (http://host:port; a /v1 suffix is "
                                                "dropped)")
    g.add_argument("--reference-url", default=None,
                   help="an endpoint serving the same model whose greedy answers are the truth (e.g. a colocated "
                        "server); without it the endpoint must agree with itself (repeated, streamed vs not)")
    g.add_argument("--model", default=None, help="model name to send (default: the first of --url's /v1/models)")
    g.add_argument("--reference-model", default=None,
                   help="model name at --reference-url (default: the first of its /v1/models)")
    g.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", ""),
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY, else none)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="the model's context length, when /v1/models does not list max_model_len")
    g.add_argument("--metrics-url", action="append", default=None, metavar="URL",
                   help="a Prometheus page with in-flight counters for the cancellation checks (repeatable; "
                        "default: --url's /metrics)")
    g = parser.add_argument_group("what to run")
    g.add_argument("--areas", default=",".join(AREAS),
                   help=f"comma-separated areas among {','.join(AREAS)} (default: all; faults needs --kill-cmd)")
    g.add_argument("--lengths", default="1,16,64",
                   help="max_tokens values of the greedy cases, comma-separated (default: %(default)s)")
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="leave the ignore_eos extension out of every request")
    g.add_argument("--cancel-max-tokens", type=int, default=1024,
                   help="max_tokens of the requests the client cancels (capped by the context; default: %(default)s)")
    g = parser.add_argument_group("faults (only with --kill-cmd)")
    g.add_argument("--kill-cmd", action="append", default=[], metavar="ROLE=CMD",
                   help="a shell command that kills a server of ROLE (a name for the report: decode, prefill, "
                        "router, ...); repeatable, one kill round per command, in order")
    g.add_argument("--fault-streams", type=int, default=4, help="concurrent greedy streams in a kill round")
    g.add_argument("--fault-max-tokens", type=int, default=256, help="max_tokens of each of those streams")
    g.add_argument("--fault-after-tokens", type=int, default=8,
                   help="the kill runs once every open stream has produced this many tokens")
    g.add_argument("--kill-timeout", type=float, default=60.0, help="seconds a kill command may take")
    g.add_argument("--recover-timeout", type=float, default=180.0,
                   help="seconds for the endpoint to serve again after a kill round (0: do not check)")
    g = parser.add_argument_group("hang guards and output")
    g.add_argument("--hang-s", type=float, default=60.0, help="a request with no byte for this long is hung")
    g.add_argument("--request-timeout", type=float, default=300.0, help="a request not done after this long is hung")
    g.add_argument("--check-timeout", type=float, default=900.0, help="a check not done after this long fails")
    g.add_argument("--json", type=Path, default=None, metavar="PATH",
                   help="write every check's name, area, verdict, detail, time and data to PATH")
    g.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    g.add_argument("--quiet", action="store_true", help="no line per check while running (only the table)")


def parse_kill_cmds(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        role, sep, cmd = item.partition("=")
        if not sep or not role.strip() or not cmd.strip():
            raise ValueError(f"--kill-cmd wants ROLE=CMD, got {item!r}")
        if not role.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"--kill-cmd: the role {role!r} must be a word (letters, digits, - and _)")
        if role in (r for r, _ in out):
            raise ValueError(f"--kill-cmd: role {role!r} given twice")
        out.append((role.strip(), cmd.strip()))
    return out


def validate(args: argparse.Namespace) -> tuple[tuple[str, ...], tuple[int, ...], list[tuple[str, str]]]:
    areas = tuple(a.strip() for a in args.areas.split(",") if a.strip())
    unknown = set(areas) - set(AREAS)
    if unknown or not areas:
        raise ValueError(f"--areas: unknown {sorted(unknown)}; choose among {','.join(AREAS)}")
    try:
        lengths = tuple(int(x) for x in args.lengths.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if not lengths or min(lengths) < 1:
        raise ValueError("--lengths must be integers >= 1")
    for name in ("hang_s", "request_timeout", "check_timeout", "kill_timeout"):
        if getattr(args, name) <= 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")
    for name in ("fault_streams", "fault_max_tokens", "fault_after_tokens", "cancel_max_tokens"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.recover_timeout < 0:
        raise ValueError("--recover-timeout must be >= 0")
    if args.fault_after_tokens >= args.fault_max_tokens:
        raise ValueError("--fault-after-tokens must be below --fault-max-tokens (the kill must land mid-stream)")
    return areas, lengths, parse_kill_cmds(args.kill_cmd)


def run(args: argparse.Namespace) -> int:
    try:
        areas, lengths, kills = validate(args)
    except ValueError as e:
        print(f"pdserve bench conformance: error: {e}", file=sys.stderr)
        return 2
    from .cli import run_suite

    return run_suite(args, areas, lengths, kills)
