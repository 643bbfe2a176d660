"""Section 6, the P/D pair: ``tools/pd_device_check.py`` (a real decode and prefill server on this
device, greedy texts equal to one engine alone, nothing held after) run as a subprocess.

It runs from a temporary working directory (``python -m pdserve`` puts the working directory
first on sys.path, and the repository root's ``pdserve/`` folder is not the installed package),
in its own process group, killed as a group at ``budget`` seconds. Its lines are streamed into
this log (prefixed ``pd|``) and kept: the per-request lines (``request i: N prompt tokens, T s,
...``) give the timings, the last line the verdict. With the tcp transport first; then, when
NIXL imports here (as cachestore/nixl_backend.load_nixl looks for it: nixl, nixl_cu13, nixl_cu12), again
with ``--transfer nixl``; and with ``--transfer samenode`` (the decode's pool exported by CUDA IPC,
the prefill copying each layer into it device to device, cachestore/samenode.py). A run whose
texts differ in bf16 is repeated in float32: equal there, the bf16 difference is rounding at a
near-tie; different there too, it is a bug.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from checklib import Budget, Record, log

SCRIPT = Path(__file__).resolve().parents[1] / "pd_device_check.py"
REQUEST_LINE = re.compile(r"request (\d+): (\d+) prompt tokens, ([0-9.]+) s, (.*)")
LONG_FIGURES = re.compile(r"ttft ([0-9.]+) ms vs prefill alone ([0-9.]+) ms \(([0-9.]+)x\), kv span ([0-9.]+) ms, "
                          r"kv layer sends ([0-9.]+) ms, kv ([0-9.]+) MiB")
VERDICT_LINE = re.compile(r"(\d+) of (\d+) P/D texts equal the engine alone; held after: (.*)$")
NIXL_PROBE = "from pdserve.cachestore.nixl_backend import load_nixl\nprint(load_nixl().__name__)\n"


def nixl_importable() -> tuple[bool, str]:
    """Whether the NIXL Python package imports here (in a child, so a broken one cannot hurt us)."""
    try:  # from /tmp: with the repository root as the working directory, its operator/ folder would
        # shadow the standard library's operator module in the child (Python 3.12)
        proc = subprocess.run([sys.executable, "-c", NIXL_PROBE], capture_output=True, text=True, timeout=60,
                              cwd=tempfile.gettempdir())
    except subprocess.TimeoutExpired:
        return False, "import nixl timed out"
    tail = (proc.stderr.strip().splitlines() or [""])[-1]
    return proc.returncode == 0, f"imports ({proc.stdout.strip()})" if proc.returncode == 0 else tail


def run_check(args: list[str], timeout: float, script: Path = SCRIPT) -> dict:
    """One pd_device_check run: its rc (None: killed at ``timeout``), lines, per-request timings, verdict.
    ``ok``: the verdict line says every text was equal and nothing was held (a run killed while its
    servers shut down, after that line, still counts: the check itself was done)."""
    cmd = [sys.executable, str(script), *args]
    log("pd", "$ " + " ".join(cmd))
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="pdpair-") as cwd:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        reader = threading.Thread(target=_pump, args=(proc, lines), daemon=True)
        reader.start()
        t0 = time.time()
        try:
            rc = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        reader.join(timeout=5)
    out = {"args": args, "rc": rc, "seconds": round(time.time() - t0, 1), "lines": lines[-60:]}
    if rc is None:
        out["error"] = f"killed after {timeout:.0f} s"
    requests = [m.groups() for m in map(REQUEST_LINE.search, lines) if m]
    out["requests"] = [{"request": int(i), "prompt_tokens": int(n), "s": float(s), "verdict": v, **long_figures(v)}
                       for i, n, s, v in requests]
    verdicts = [(line, m) for line in lines for m in [VERDICT_LINE.search(line)] if m]
    out["verdict"] = verdicts[-1][0] if verdicts else None
    if verdicts:
        equal, total, held = verdicts[-1][1].groups()
        out["ok"] = equal == total and held.strip() == "nothing" and rc in (0, None)
        if rc is None:
            out["error"] += " (after its verdict line, while the servers stopped)"
    else:
        out["ok"] = False
    return out


def long_figures(rest: str) -> dict:
    """The long cell's figures on a request line (pd_device_check.py --prompt-lens), or nothing."""
    m = LONG_FIGURES.search(rest)
    if not m:
        return {}
    keys = ("ttft_ms", "alone_ttft_ms", "ttft_ratio", "kv_span_ms", "kv_layer_sends_ms", "kv_mib")
    return dict(zip(keys, map(float, m.groups())))


def long_cell(ctx, rec: Record, budget: Budget, transports: list[str]) -> None:
    """Issue 51's P/D cell: prompts of ``pd_long_prompts`` tokens on a checkpoint of the plan's widths with
    ``pd_long_layers`` layers, per transport: TTFT against the prefill alone, KV per request, texts equal."""
    from tpcell import write_checkpoint

    plan = ctx.plan
    lens = ",".join(map(str, plan.pd_long_prompts))
    with tempfile.TemporaryDirectory(prefix="pd-ckpt-") as path:
        shape = dict(plan.model_shape, max_position_embeddings=max(plan.model_shape["max_position_embeddings"],
                                                                   max(plan.pd_long_prompts) + 64))
        write_checkpoint(replace(plan, model_shape=shape, tp_layers=plan.pd_long_layers), path, ctx.dtype)
        for transport in transports:
            if budget.left() <= 20:
                rec.skip(f"long {transport}", "budget spent")
                continue
            args = ["--device", ctx.device.type, "--dtype", ctx.pd_dtype_name, "--requests", "1", "--model", path,
                    "--transfer", transport, "--prompt-lens", lens]
            result = run_check(args, budget.left())
            result["transfer"] = f"{transport} long"
            rec.results.setdefault("long", []).append(result)
            rec.save()
            log("pd", f"long {transport}: rc {result['rc']}, {result['verdict'] or result.get('error')}")


def _pump(proc: subprocess.Popen, lines: list[str]) -> None:
    for line in proc.stdout:
        line = line.rstrip("\n")
        lines.append(line)
        print(f"pd| {line}", flush=True)


def run(ctx, rec: Record, budget: Budget) -> None:
    ok, why = nixl_importable()
    rec.results.update(nixl_importable=ok, nixl=why, runs=[])
    rec.note(f"nixl: {why}")
    # (transport, KV cache dtype): issue 45's "P/D texts with FP8 KV equal to the engine alone" on tcp
    # samenode (issue 51 item 1): the decode's pool by CUDA IPC, each layer copied device to device
    runs = [("tcp", "auto"), ("samenode", "auto")] + ([("nixl", "auto")] if ok else []) + [("tcp", "fp8")]
    for transport, kv_dtype in runs:
        label = transport if kv_dtype == "auto" else f"{transport} fp8-kv"
        if budget.left() <= 5:
            rec.skip(f"transfer {label}", "budget spent")
            continue
        args = ["--device", ctx.device.type, "--dtype", ctx.pd_dtype_name, "--requests", str(ctx.plan.pd_requests),
                "--transfer", transport, "--kv-cache-dtype", kv_dtype]
        result = run_check(args, budget.left())
        result["transfer"] = label
        rec.results["runs"].append(result)
        rec.save()
        log("pd", f"{label}: rc {result['rc']}, {result['verdict'] or result.get('error') or 'no verdict line'}")
        if not result["ok"] and ctx.pd_dtype_name != "float32" and result["requests"] and budget.left() > 30:
            # texts apart in bf16: float32 tells rounding at a near-tie (equal there) from a real difference
            args[args.index("--dtype") + 1] = "float32"
            again = run_check(args, budget.left())
            again["transfer"] = f"{label} float32"
            rec.results["runs"].append(again)
            rec.save()
            log("pd", f"{label} float32: rc {again['rc']}, {again['verdict'] or again.get('error')}")
    if budget.left() > 60:
        long_cell(ctx, rec, budget, ["tcp", "samenode"] + (["nixl"] if ok else []))
    else:
        rec.skip("long prompts", "budget spent")
