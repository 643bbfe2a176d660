"""The prepared GPU check: ceilings, parity, decode/prefill speed, transformers, the P/D pair, one run.

    python3 tools/gpu/check.py --out OUTDIR                     # on the GPU machine (tools/gpu/check.sh)
    python3 tools/gpu/check.py --device cpu --smoke --out DIR   # the same code path, tiny shapes, here

Sections, in order (each its own module; tools/gpu/README.md has the formulas):
  ceilings      copy bandwidth and dense GEMM rate of this device          (ceilings.py)
  parity        engine vs transformers, one tiny model per family          (parity.py)
  decode        decode step of a random Llama-3-8B, batch x context cells  (perf.py)
  prefill       prefill_many of 1/8/32 prompts of 2048 tokens               (perf.py)
  transformers  ours vs LlamaForCausalLM on the same tensors, alternating   (hf_compare.py)
  fp8           FP8 weights vs the dtype's: decode, prefill, tokens; KV    (fp8cells.py)
  pd            tools/pd_device_check.py, tcp (and nixl where it imports)  (pdpair.py)

The shapes, repetitions, budgets and this command line are in ``plan.py``.

How it runs: this process (the supervisor) imports no torch; it starts a worker process
(this script with ``--worker``) that runs the sections in order and writes each one's result
to ``OUT/sections/NAME.json`` after every cell. The supervisor rewrites ``OUT/check.json``
whenever a section file changes, so a run killed from outside still leaves what was done.
Each section has a budget (seconds): it skips its remaining cells, with a note, once spent.
A section still running at its budget plus a grace is killed with its worker (its Python
stacks are dumped into the log first); an exception is printed with its traceback and
recorded, and the next section runs; after a CUDA error that poisons the context (illegal
address, device-side assert), or a killed or crashed worker, a fresh worker runs the
remaining sections. Nothing runs past ``--deadline`` seconds after the start. At the end the
supervisor prints ONE summary table (summary.py: figures, targets, verdicts) and writes
check.json with every figure, the device, the versions, the commit and the date. Exit status 0
when every section ran without error (targets missed or not), 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checklib import Budget, Record, log, read_json, release, write_json  # noqa: E402
from plan import FINAL, RESERVE, SECTIONS, Plan, make_plan, wanted_sections  # noqa: E402
from plan import parse_args as _parse_args  # noqa: E402
import tree_stamp  # noqa: E402
from summary import render_summary, summary_rows  # noqa: E402


def parse_args(argv: list[str]):
    return _parse_args(argv, __doc__)

# ---- the worker --------------------------------------------------------------------------------
@dataclass
class Context:
    device: object
    dtype: object
    parity_dtype: object
    plan: Plan
    out: Path
    deadline: float
    state: dict = field(default_factory=dict)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).split(".")[-1]

    @property
    def pd_dtype_name(self) -> str:
        return self.dtype_name


def section_function(name: str):
    import ceilings
    import fp8cells
    import hf_compare
    import parity
    import pdpair
    import perf
    import tpcell

    return {"ceilings": ceilings.run, "parity": parity.run, "decode": perf.run_decode, "prefill": perf.run_prefill,
            "transformers": hf_compare.run_transformers, "fp8": fp8cells.run_fp8, "pd": pdpair.run,
            "tp": tpcell.run_tp}[name]


def effective_budget(plan: Plan, name: str, later: list[str], deadline: float) -> float:
    """The section's budget, cut so that the sections after it keep their reserve before the deadline."""
    reserve = sum(RESERVE[s] for s in later)
    return max(5.0, min(plan.budgets[name], deadline - time.time() - reserve))


def run_section(ctx: Context, name: str, later: list[str]) -> bool:
    """Run one section into its Record; False when the CUDA context is no longer usable."""
    from checklib import fatal_cuda

    seconds = effective_budget(ctx.plan, name, later, ctx.deadline)
    rec = Record(ctx.out, name)
    rec.data["budget_s"] = round(seconds, 1)
    rec.save()
    write_json(ctx.out / "sections" / "_current.json", {"name": name, "started": time.time(), "budget": seconds,
                                                       "pid": os.getpid()})
    log(name, f"--- section {name} (budget {seconds:.0f} s) ---")
    usable = True
    try:
        section_function(name)(ctx, rec, Budget(seconds, ctx.deadline))
        errors = rec.data.get("cell_errors") or []
        rec.data["status"] = "error" if errors else "partial" if rec.data["skipped"] else "ok"
        if errors:
            rec.data["error"] = f"{len(errors)} cell(s) failed, the first: {errors[0]}"
    except BaseException as exc:  # noqa: BLE001 - one section's failure must not end the run
        tb = traceback.format_exc()
        print(tb, flush=True)
        rec.data.update(status="error", error=f"{type(exc).__name__}: {exc}", traceback=tb)
        usable = not fatal_cuda(exc)
        if isinstance(exc, KeyboardInterrupt):
            usable = False
    rec.save()
    if name == "ceilings":
        ctx.state["ceilings"] = rec.data
    log(name, f"--- {name}: {rec.data['status']} in {rec.data['seconds']:.1f} s ---")
    write_json(ctx.out / "sections" / "_current.json", {"name": None})
    try:
        release(ctx.device)
    except Exception as exc:  # the context may be gone; the supervisor starts a fresh worker
        log(name, f"releasing memory failed: {exc}")
        usable = False
    return usable


def watch_parent() -> None:
    """End this worker (and its process group) when the supervisor is gone."""
    parent = os.getppid()

    def loop():
        while True:
            time.sleep(2)
            if os.getppid() != parent:
                os.killpg(0, signal.SIGKILL)

    threading.Thread(target=loop, daemon=True, name="watch-parent").start()


def resolve_device(args):
    """The device, with its index on CUDA ("cuda" alone is refused by torch.cuda.set_device)."""
    import torch

    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def pick_dtype(choice: str, device):
    import torch

    if choice == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, choice)


def versions() -> dict:
    from importlib import metadata

    out = {}
    for pkg in ("torch", "triton", "transformers", "numpy", "safetensors", "tokenizers", "grpcio", "protobuf",
                "aiohttp", "prometheus-client", "crc32c", "huggingface-hub", "nixl", "nixl-cu12", "pdserve"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def worker_meta(ctx: Context) -> dict:
    import platform

    import torch

    import pdserve

    meta = {"device": str(ctx.device), "dtype": ctx.dtype_name, "parity_dtype": str(ctx.parity_dtype).split(".")[-1],
            "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "versions": versions(), "pdserve_path": str(Path(pdserve.__file__).parent),
            "cpu_threads": torch.get_num_threads()}
    try:
        import triton

        meta["triton"] = triton.__version__
    except Exception as exc:
        meta["triton"] = f"not importable: {exc}"
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        meta.update(gpu_name=torch.cuda.get_device_name(ctx.device),
                    gpu_memory_gib=round(props.total_memory / 2**30, 1),
                    gpu_capability=f"{props.major}.{props.minor}", gpu_sms=props.multi_processor_count,
                    cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    else:
        meta["gpu_name"] = None
    return meta


def worker_main(args: argparse.Namespace) -> int:
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the supervisor asks for stacks before a kill
    watch_parent()
    plan = make_plan(args)
    import torch

    device = resolve_device(args)
    ctx = Context(device, pick_dtype(args.dtype, device), pick_dtype(args.parity_dtype, device), plan,
                  Path(args.out), float(os.environ.get("CHECK_DEADLINE", time.time() + plan.deadline)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # one thread: a shared CPU box's timings swing less, and a smoke run wants no more
        torch.set_num_threads(1)
    write_json(ctx.out / "sections" / "_meta.json", worker_meta(ctx))
    names = [s for s in args.worker_sections.split(",") if s]
    log("worker", f"pid {os.getpid()} on {device} ({ctx.dtype_name}): sections {','.join(names)}")
    for i, name in enumerate(names):
        if not run_section(ctx, name, names[i + 1:]):
            log("worker", "the device context is no longer usable: this worker stops, a fresh one goes on")
            return 3
    return 0


# ---- the supervisor ----------------------------------------------------------------------------
class Supervisor:
    """Runs workers over the pending sections, enforces the hard limits, keeps check.json current."""

    def __init__(self, args: argparse.Namespace, plan: Plan, argv: list[str]):
        self.args, self.plan, self.argv = args, plan, argv
        self.grace = args.grace  # seconds past a section's budget before it is killed
        self.out = Path(args.out)
        self.sections_dir = self.out / "sections"
        self.start = float(os.environ.get("CHECK_START", time.time()))
        self.deadline = self.start + plan.deadline
        self.proc: subprocess.Popen | None = None
        self.meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.start)), **tree_stamp.identity(),
                     "argv": argv, "plan": asdict(plan), "host": os.uname().nodename}
        self.stamps: dict[str, float] = {}
        self.killed_why = ""

    # -- files
    def prepare(self) -> None:
        self.sections_dir.mkdir(parents=True, exist_ok=True)
        for old in self.sections_dir.glob("*.json"):
            old.unlink()

    def section(self, name: str) -> dict | None:
        return read_json(self.sections_dir / f"{name}.json")

    def set_status(self, name: str, status: str, why: str) -> None:
        data = self.section(name) or {"name": name, "notes": [], "skipped": [], "results": {}}
        data["status"] = status
        data["error" if status in ("killed", "crashed") else "reason"] = why
        write_json(self.sections_dir / f"{name}.json", data)
        log("check", f"{name}: {status} ({why})")

    def document(self) -> dict:
        meta = {**self.meta, **(read_json(self.sections_dir / "_meta.json") or {})}
        meta["elapsed_s"] = round(time.time() - self.start, 1)
        sections = {name: self.section(name) for name in SECTIONS if self.section(name) is not None}
        return {"meta": meta, "sections": sections}

    def write(self) -> dict:
        doc = self.document()
        doc["summary"] = [dict(zip(("section", "cell", "figure", "target", "verdict"), r))
                          for r in summary_rows(doc, self.plan)]
        write_json(self.out / "check.json", doc)
        return doc

    def refresh_if_changed(self) -> None:
        stamps = {p.name: p.stat().st_mtime for p in self.sections_dir.glob("*.json")}
        if stamps != self.stamps:
            self.stamps = stamps
            self.write()

    # -- workers
    def spawn(self, names: list[str]) -> subprocess.Popen:
        cmd = [sys.executable, str(Path(__file__).resolve()), *self.argv, "--worker",
               "--worker-sections", ",".join(names)]
        env = {**os.environ, "CHECK_START": str(self.start), "CHECK_DEADLINE": str(self.deadline),
               "PYTHONUNBUFFERED": "1"}
        log("check", f"starting a worker for: {', '.join(names)}")
        return subprocess.Popen(cmd, env=env, start_new_session=True)

    def kill(self, why: str) -> None:
        """Stacks into the log (SIGUSR1: faulthandler), then SIGKILL to the worker's whole group."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        log("check", f"killing the worker: {why}")
        try:
            os.kill(proc.pid, signal.SIGUSR1)
            proc.wait(timeout=2)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def watch(self) -> str | None:
        """Wait for the worker; kill it when its section overruns. The name of a section it killed."""
        while self.proc.poll() is None:
            time.sleep(1.0)
            self.refresh_if_changed()
            current = read_json(self.sections_dir / "_current.json") or {}
            name = current.get("name")
            if name:
                limit = min(current["started"] + current["budget"] + self.grace, self.deadline + self.grace)
                if time.time() > limit:
                    self.killed_why = (f"ran past its budget ({current['budget']:.0f} s) + {self.grace:.0f} s, "
                                       f"or past the run's deadline + {self.grace:.0f} s: killed")
                    self.kill(f"section {name} {self.killed_why}")
                    return name
            elif time.time() > self.deadline + self.grace:
                self.kill("the run's deadline")
        return None

    def run(self, names: list[str]) -> None:
        pending = list(names)
        while pending:
            if self.deadline - time.time() < 5:
                for name in pending:
                    self.set_status(name, "skipped", "the run's deadline came first")
                return
            self.proc = self.spawn(pending)
            killed = self.watch()
            rc = self.proc.returncode
            self.proc = None
            current = (read_json(self.sections_dir / "_current.json") or {}).get("name")
            if killed:
                self.set_status(killed, "killed", self.killed_why)
            elif current and (self.section(current) or {}).get("status") not in FINAL:
                self.set_status(current, "crashed", f"its worker exited with status {rc}")
            write_json(self.sections_dir / "_current.json", {"name": None})
            done = [n for n in pending if (self.section(n) or {}).get("status") in FINAL]
            if not done:
                for name in pending:
                    self.set_status(name, "crashed", f"the worker exited with status {rc} before running it")
                return
            pending = [n for n in pending if n not in done]

    def finish(self, skipped: dict[str, str]) -> int:
        for name, why in skipped.items():
            if self.section(name) is None:
                self.set_status(name, "skipped", why)
        doc = self.write()
        print(render_summary(doc), flush=True)
        log("check", f"wrote {self.out / 'check.json'}")
        bad = [n for n, s in doc["sections"].items() if s.get("status") in ("error", "killed", "crashed")]
        return 1 if bad else 0


def supervise(args: argparse.Namespace, argv: list[str]) -> int:
    plan = make_plan(args)
    names, skipped = wanted_sections(args)
    sup = Supervisor(args, plan, argv)
    sup.prepare()
    log("check", f"out {sup.out}; sections {','.join(names)}; deadline {plan.deadline:.0f} s; "
                 f"{'smoke' if plan.smoke else 'full'} plan")

    def on_term(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    try:
        sup.run(names)
    except KeyboardInterrupt as exc:
        log("check", f"interrupted ({exc}): writing what was done")
        sup.kill("the check was interrupted")
        current = (read_json(sup.sections_dir / "_current.json") or {}).get("name")
        if current:
            sup.set_status(current, "killed", "the check was interrupted")
    return sup.finish(skipped)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.worker:
        rc = worker_main(args)
        sys.stdout.flush()
        os._exit(rc)  # every result is on disk; skip tearing down torch and CUDA (seconds)
    os.environ.setdefault("CHECK_START", str(time.time()))
    return supervise(args, [a for a in argv])


if __name__ == "__main__":
    raise SystemExit(main())
