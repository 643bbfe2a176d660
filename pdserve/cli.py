"""The ``pdserve`` command.

Each subcommand lives in the package that owns it, in a module exposing two functions::

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def run(args: argparse.Namespace) -> int: ...

and the module's docstring first line is the help text. Modules are imported only when
their subcommand is used (or its --help is asked for), so ``pdserve --help`` stays fast
and a missing optional dependency only matters for the command that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# name -> (module, one-line help). Keep in the order a new user meets them.
COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("pdserve.localcluster.up", "start a local prefill + decode cluster and serve the OpenAI API"),
    "generate": ("pdserve.engine.cli", "run the colocated engine on a prompt and stream the completion"),
    "batch": ("pdserve.batch.pipeline.cli",
              "run an OpenAI batch file offline for throughput (TD-Pipe pipeline stages)"),
    "batch-server": ("pdserve.batch.serve", "serve the OpenAI Batch API, lines run on pipeline stages (TD-Pipe)"),
    "prefill": ("pdserve.prefill_server.cli", "run a prefill server (OpenAI HTTP + gRPC front door)"),
    "decode": ("pdserve.decode_server.cli", "run a decode server (Session stream + load reports)"),
    "router": ("pdserve.router.cli", "run a KV-aware router in front of several prefills (OpenAI HTTP)"),
    "kvpool": ("pdserve.kvpool.cli", "run a KV pool's gManager or one of its decodes (DistKV-LLM)"),
    "fetch-model": ("pdserve.model_fetch", "download a Hugging Face model (hf://org/name[@rev]) into a folder"),
    "operator": ("pdserve.operator.cli", "run the Kubernetes operator (kopf)"),
    "bench": ("pdserve.bench", "benchmarks: engine, cachestore, serving load generator, experiments"),
}


def _top_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="LLM serving with prefill/decode disaggregation. "
        "Run 'pdserve COMMAND --help' for the options of one command.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="commands:\n" + "\n".join(f"  {n:<12} {h}" for n, (_, h) in COMMANDS.items()),
    )
    parser.add_argument("--version", action="version", version=_version())
    parser.add_argument("command", choices=list(COMMANDS), metavar="COMMAND", help="one of: " + ", ".join(COMMANDS))
    return parser


def _version() -> str:
    from pdserve import __version__

    return f"pdserve {__version__}"


def build_parser(command: str) -> tuple[argparse.ArgumentParser, object]:
    """The parser of one subcommand and the module that runs it."""
    module_name, help_text = COMMANDS[command]
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(
        prog=f"pdserve {command}",
        description=(module.__doc__ or help_text).strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    return parser, module


def run_module(module_name: str, prog: str, argv: list[str]) -> int:
    """Parse argv with a command module's own parser (its docstring as description) and run it.

    For commands with sub-choices (``pdserve bench NAME``, ``pdserve bench experiment NAME``).
    """
    module = importlib.import_module(module_name)
    parser = argparse.ArgumentParser(
        prog=prog, description=(module.__doc__ or "").strip(), formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    return int(module.run(parser.parse_args(argv)) or 0)


class Dispatcher:
    """A command whose first argument picks one module of ``table`` (``pdserve bench NAME``,
    ``pdserve bench experiment NAME``); the rest of the line goes to that module's own parser.
    Give a package ``add_arguments, run = Dispatcher(...).functions()``."""

    def __init__(self, prog: str, table: dict[str, str], what: str):
        self.prog, self.table, self.what = prog, table, what

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        parser.add_argument("name", choices=list(self.table), help=f"which {self.what}")
        parser.add_argument("rest", nargs=argparse.REMAINDER, help=f"options of that {self.what} (see its --help)")

    def run(self, args: argparse.Namespace) -> int:
        return run_module(self.table[args.name], f"{self.prog} {args.name}", args.rest)

    def functions(self):
        return self.add_arguments, self.run


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if os.environ.get("PDSERVE_CACHE"):  # where the engine's C++ kernels are built (engine/native.py)
        from pdserve.engine import native

        native.set_cache_root(os.environ["PDSERVE_CACHE"])
    if not argv or argv[0] not in COMMANDS:
        _top_parser().parse_args(argv or ["--help"])
        return 2
    parser, module = build_parser(argv[0])
    args = parser.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
