"""deliver_ab.py's runs with the engine's step times and the gaps between steps recorded (LLMEngine.step wrapped);
argv[1]: sys.setswitchinterval (CPython's default 0.005). Run from the repository root."""
import asyncio, time, sys, statistics
import torch
sys.path.insert(0, "docs/bench_raw/2026-12-06-seam3/tools")
import deliver_ab as d
from pdserve.engine.engine_thread import EngineThread
from pdserve.engine import LLMEngine, load_model
torch.set_num_threads(1); sys.setswitchinterval(float(sys.argv[1]))
loaded = load_model("tiny")
after = EngineThread._deliver_all
orig_step = LLMEngine.step
for variant in ("before", "after", "before", "after"):
    EngineThread._deliver_all = d.per_output if variant == "before" else after
    durs, gaps, last = [], [], [None]
    def step(self):
        t0 = time.perf_counter()
        if last[0] is not None: gaps.append(t0 - last[0])
        r = orig_step(self)
        last[0] = time.perf_counter(); durs.append(last[0] - t0)
        return r
    LLMEngine.step = step
    res = asyncio.run(d.one_run(loaded, 16, 200))
    LLMEngine.step = orig_step
    print(variant, res, "steps", len(durs), "step ms med %.2f" % (1000*statistics.median(durs)),
          "gap ms med %.2f max %.1f sum %.2fs" % (1000*statistics.median(gaps), 1000*max(gaps), sum(gaps)),
          flush=True)
