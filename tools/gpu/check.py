"""The prepared GPU check: ceilings, parity, decode/prefill speed, transformers, the P/D pair, one run.

    python3 tools/gpu/check.py --out OUTDIR                     # on the GPU machine (tools/gpu/check.sh)
    python3 tools/gpu/check.py --device cpu --smoke --out DIR   # the same code path, tiny shapes, here

Sections, in order (each its own module; tools/gpu/README.md has the formulas):
  ceilings      copy bandwidth and dense GEMM rate of this device          (ceilings.py)
  parity        engine vs transformers, one tiny model per family          (parity.py)
  decode        decode step of a random Llama-3-8B, batch x context cells  (perf.py)
  prefill       prefill_many of 1/8/32 prompts of 2048 tokens               (perf.py)
  transformers  ours vs LlamaForCausalLM on the same tensors, alternating   (hf_compare.py)
  pd            tools/pd_device_check.py, tcp (and nixl where it imports)  (pdpair.py)

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
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from checklib import Budget, Record, log, read_json, release, write_json  # noqa: E402
from summary import render_summary, summary_rows  # noqa: E402

SECTIONS = ("ceilings", "parity", "decode", "prefill", "transformers", "pd")
# seconds each later section is guaranteed before the deadline (a slow section cannot starve them)
RESERVE = {"ceilings": 5, "parity": 20, "decode": 30, "prefill": 15, "transformers": 30, "pd": 75}
FINAL = ("ok", "partial", "error", "killed", "crashed", "skipped")
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                 num_kv_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                 architecture="LlamaForCausalLM", bos_token_id=128000, eos_token_ids=[128001])
TINY = dict(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=500000.0,
            architecture="LlamaForCausalLM", bos_token_id=1, eos_token_ids=[2])


@dataclass
class Plan:
    """Every shape, repetition count and budget of a run (``FULL`` on a GPU, ``SMOKE`` for tiny)."""

    copy_bytes: int = 2 << 30
    gemm_n: int = 8192
    ceiling_reps: int = 10
    ceiling_warmup: int = 3
    parity_tokens: int = 16
    model_shape: dict = field(default_factory=lambda: dict(LLAMA3_8B))
    block_size: int = 64  # the engine's BLOCK_SIZE
    decode_batches: tuple = (1, 8, 32, 128, 256)
    decode_contexts: tuple = (1024, 4096)
    decode_steps: int = 20
    decode_warmup: int = 3
    prefill_prompts: tuple = (1, 8, 32)
    prefill_len: int = 2048
    prefill_reps: int = 3
    hf_decode_batches: tuple = (1, 8, 32)
    hf_context: int = 1024
    hf_prefill_prompts: tuple = (1, 8, 32)
    hf_reps: int = 3
    hf_steps: int = 10
    pd_requests: int = 4
    budgets: dict = field(default_factory=lambda: {"ceilings": 30, "parity": 75, "decode": 150, "prefill": 45,
                                                   "transformers": 110, "pd": 120})
    deadline: float = 450.0  # seconds after the start; the device command's limit is 600
    smoke: bool = False


FULL = Plan()
SMOKE = Plan(copy_bytes=16 << 20, gemm_n=256, ceiling_reps=3, ceiling_warmup=1, model_shape=dict(TINY),
             block_size=16, decode_batches=(1, 2), decode_contexts=(64, 128), decode_steps=3, decode_warmup=1,
             prefill_prompts=(1, 2), prefill_len=64, prefill_reps=2, hf_decode_batches=(1, 2), hf_context=64,
             hf_prefill_prompts=(1, 2), hf_reps=2, hf_steps=3, pd_requests=1,
             budgets={"ceilings": 20, "parity": 60, "decode": 30, "prefill": 30, "transformers": 45, "pd": 90},
             deadline=280.0, smoke=True)


# ---- arguments ---------------------------------------------------------------------------------
def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tools/gpu/check.py", description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT") or "gpu-check-out",
                   help="folder for check.json, sections/ (default: $OUT, else ./gpu-check-out)")
    p.add_argument("--device", default="auto", help="cuda, cuda:N or cpu (default: cuda where torch sees one)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes and 1-3 repetitions (the whole path in well under a minute on a CPU)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="dtype of sections 1 and 3-6 (auto: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--parity-dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="dtype of the parity section (auto: bfloat16 on CUDA, float32 on CPU, where bf16 "
                        "greedy tokens of transformers itself flip against its float32 ones)")
    p.add_argument("--deadline", type=float, default=None,
                   help="seconds after the start when everything stops (default 450; smoke 280)")
    p.add_argument("--budget-scale", type=float, default=1.0, help="multiply every section's budget")
    p.add_argument("--grace", type=float, default=30.0,
                   help="seconds a section may run past its budget before its worker is killed (default 30)")
    p.add_argument("--pd", default="auto", choices=["auto", "on", "off"],
                   help="the P/D pair section (auto: on, except in a --smoke run without --device cuda[:N], "
                        "where its two servers would take most of the run)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker-sections", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [s for s in args.sections.split(",") if s not in SECTIONS]
    if bad:
        p.error(f"unknown section(s) {bad}; choose from {','.join(SECTIONS)}")
    return args


def make_plan(args: argparse.Namespace) -> Plan:
    plan = SMOKE if args.smoke else FULL
    plan = replace(plan, budgets={k: v * args.budget_scale for k, v in plan.budgets.items()})
    return replace(plan, deadline=args.deadline) if args.deadline is not None else plan


def wanted_sections(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """(sections to run, {section: why skipped})."""
    chosen = [s for s in SECTIONS if s in args.sections.split(",")]
    skipped = {s: "not in --sections" for s in SECTIONS if s not in chosen}
    smoke_off_gpu = args.smoke and not args.device.startswith("cuda")  # the supervisor imports no torch
    if "pd" in chosen and (args.pd == "off" or args.pd == "auto" and smoke_off_gpu):
        chosen.remove("pd")
        skipped["pd"] = ("--pd off" if args.pd == "off"
                         else "skipped in a smoke run without --device cuda (--pd on runs it)")
    return chosen, skipped


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
    import hf_compare
    import parity
    import pdpair
    import perf

    return {"ceilings": ceilings.run, "parity": parity.run, "decode": perf.run_decode, "prefill": perf.run_prefill,
            "transformers": hf_compare.run_transformers, "pd": pdpair.run}[name]


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
        self.meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.start)), "commit": git_commit(),
                     "source_sha256": source_hash(), "argv": argv, "plan": asdict(plan), "host": os.uname().nodename}
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


def git_commit() -> str | None:
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        return None
    return proc.stdout.strip() or None


def source_hash() -> str:
    """sha256 over the Python sources the check runs (paths and contents): the code's identity where
    the copy on the GPU machine has no .git to ask for the commit."""
    import hashlib

    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for folder in ("pdserve", "engine", "cachestore", "protos", "prefill_server", "decode_server", "tools"):
        for path in sorted((root / folder).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


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
