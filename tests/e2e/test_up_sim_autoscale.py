"""`pdserve up --engine sim --autoscale`: the SLO planner drives simulated servers (the seam the scale experiment's
day arms stand on, bench/experiments/scale_day.py). Under a load of prompts whose simulated prefill keeps one prefill
busy, the planner starts a second sim prefill, which the router then sends work to; when the load stops it drains
one of them and that one exits; every request succeeds.

The profile is the shipped cpu-small one with a slow prefill (1 ms a prompt token, so a 400-token prompt is 0.4 s
of simulated compute): the prefills' busy signal is their engines' time in steps (the sim's modelled sleeps), at
most 1 per prefill however many prompts share a step.
"""

import dataclasses
import json
import random
import signal
import threading
import urllib.error
import urllib.request

import pytest

from harness.conditions import wait_until
from harness.pd_cluster import metric
from harness.procs import VENV_BIN
from pdserve.engine.sim.profile import load_profile
from pdserve.net import free_port

pytestmark = pytest.mark.slow

UP_HANG_GUARD_S = 240.0  # only a hang guard: `pdserve up` starts three sim servers and a router in ~10-20 s
HANG_GUARD_S = 120.0     # only a hang guard: a planner decision and a server start take seconds
PROMPT_TOKENS = 400      # the byte tokenizer: one token a character
WORKERS = 3              # requests in flight at once: each prefill step holds up to three prompts


def slow_prefill_profile(path):
    base = load_profile("cpu-small")
    step = dataclasses.replace(base.step, prefill_token_s=1e-3, prefill_pair_s=0.0)
    path.write_text(dataclasses.replace(base, name="cpu-small-slow-prefill", step=step).to_json())
    return path


def wait_for(what: str, check, up, log, timeout: float = HANG_GUARD_S):
    """``check()``'s first truthy value (harness.conditions.wait_until); fails at once if `up` exits."""
    def checked():
        assert up.poll() is None, f"pdserve up exited:\n{log.read_text(errors='replace')[-3000:]}"
        return check()

    return wait_until(checked, what, hang_guard_s=timeout)


class Load:
    """WORKERS threads, each sending one completion after another (fresh random prompts: no prefix hits)."""

    def __init__(self, port: int):
        self.port, self.stop, self.results = port, threading.Event(), []
        self.threads = [threading.Thread(target=self._worker, args=(i,), daemon=True) for i in range(WORKERS)]

    def _worker(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            prompt = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(PROMPT_TOKENS))
            body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=120) as resp:
                    out = json.loads(resp.read())
                    self.results.append((resp.status, out["usage"]["completion_tokens"]))
            except urllib.error.HTTPError as exc:
                self.results.append((exc.code, exc.read()[:300]))
            except OSError as exc:
                self.results.append((0, repr(exc)))

    def __enter__(self) -> "Load":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(150)  # only a hang guard: a request takes about a second
        assert not any(t.is_alive() for t in self.threads), "a request hung"


def servers(log_dir) -> dict:
    try:
        return json.loads((log_dir / "servers.json").read_text())
    except (OSError, ValueError):
        return {}


def test_the_planner_grows_and_shrinks_a_pool_of_sim_prefills(procs, tmp_path):
    profile = slow_prefill_profile(tmp_path / "profile.json")
    port, grpc_port, log_dir = free_port(), free_port(), tmp_path / "up-logs"
    up = procs.start([str(VENV_BIN / "pdserve"), "up", "--engine", "sim", "--sim-profile", str(profile), "--model",
                      "tiny", "--autoscale", "--prefill", "1", "--min-prefill", "1", "--max-prefill", "2",
                      "--decode", "1", "--min-decode", "1", "--max-decode", "1", "--plan-interval", "1",
                      "--plan-window", "2", "--scale-down-window", "3", "--cooldown", "1", "--slo-ttft-ms", "60000",
                      "--slo-tbt-ms", "5000", "--port", str(port), "--grpc-port", str(grpc_port), "--log-dir",
                      str(log_dir)], name="up")
    log = tmp_path / "logs" / "up.log"
    wait_for("pdserve up prints its banner", lambda: "pdserve is up" in log.read_text(errors="replace"), up, log,
             UP_HANG_GUARD_S)
    assert [n for n in servers(log_dir) if n.startswith("prefill")] == ["prefill-0"]
    with Load(port) as load:
        wait_for("the planner starts a second prefill and it is ready",
                 lambda: servers(log_dir).get("prefill-1", {}).get("state") == "ready", up, log)
        second = servers(log_dir)["prefill-1"]["ready_url"].removesuffix("/ready")
        wait_for("the router sends prompts to the new prefill",
                 lambda: metric(second, "pdserve_prompt_tokens_total") > 0, up, log)
        assert "simulated engine: profile cpu-small-slow-prefill" in (log_dir / "prefill-1.log").read_text()
    decisions = [json.loads(line) for line in (log_dir / "autoscale.jsonl").read_text().splitlines()]
    up_step = [d for d in decisions if d["pool"] == "prefill" and d["desired"] > d["current"]]
    assert up_step and up_step[0]["signal"] in ("busy", "queue"), decisions[-3:]
    # busy is the engines' own time in steps: at most 1 per prefill (the scrapes' own jitter aside: 1.5 leaves a
    # second of it in a 2 s window), where the requests' compute intervals, three prompts to a step, read ~3
    busy = [d["window"]["prefill_busy"] for d in decisions if d["window"]["prefill_busy"] is not None]
    assert busy and max(busy) <= 1.5, sorted(busy)[-5:]
    drained = wait_for("the planner drains a prefill once the load is gone",
                       lambda: next((n for n in ("prefill-0", "prefill-1")
                                     if f"{n} drained and stopped (exit code 0)" in log.read_text()), None), up, log)
    assert [n for n, s in servers(log_dir).items() if s["role"] == "prefill" and s["state"] == "ready"] == [
        {"prefill-0": "prefill-1", "prefill-1": "prefill-0"}[drained]]
    assert len(load.results) >= WORKERS and all(r == (200, 4) for r in load.results), \
        [r for r in load.results if r != (200, 4)][:5]
    up.send_signal(signal.SIGINT)
    assert up.wait(90) == 0
