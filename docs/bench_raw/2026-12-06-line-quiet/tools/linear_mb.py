"""fp32 linear, one thread: F.linear vs oneDNN prepacked (_linear_pointwise) vs MKL packed (_mkl_linear),
A B C A B C."""
import time, torch, torch.nn.functional as F
torch.set_num_threads(1); torch.manual_seed(0)
shapes = {"qkv": (1280, 1024), "o": (1024, 1024), "gate_up": (5632, 1024), "down": (1024, 2816)}
Ms = [1, 8, 64, 512, 2048]
def timeit(fn, secs):
    fn(); t = time.perf_counter(); n = 0
    while time.perf_counter() - t < secs: fn(); n += 1
    return (time.perf_counter() - t) / n
tot = {}
for M in Ms:
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K) * 0.02; x = torch.randn(M, K)
        ref = F.linear(x, w)
        pw = torch.ops.mkldnn._reorder_linear_weight(w, M)
        y1 = torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")
        mw = torch.ops.mkl._mkl_reorder_linear_weight(w, M)
        y2 = torch.ops.mkl._mkl_linear(x, mw, w, None, M)
        # dynamic M: packed for 512, used at M
        fns = {"F.linear": lambda: F.linear(x, w),
               "onednn": lambda: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], ""),
               "mkl": lambda: torch.ops.mkl._mkl_linear(x, mw, w, None, M)}
        secs = 0.4 if M >= 512 else 0.2
        t = {k: [] for k in fns}
        for _ in range(2):
            for k, f in fns.items(): t[k].append(timeit(f, secs))
        best = {k: min(v) for k, v in t.items()}
        for k in best: tot[(M, k)] = tot.get((M, k), 0) + best[k]
        print(f"M={M:5d} {name:8s} " + " ".join(f"{k} {best[k]*1e3:8.3f}ms" for k in best)
              + f"  onednn/F {best['onednn']/best['F.linear']:.3f} mkl/F {best['mkl']/best['F.linear']:.3f}"
              + f"  maxdiff {float((y1-ref).abs().max()):.2e} {float((y2-ref).abs().max()):.2e}", flush=True)
for M in Ms:
    f = tot[(M, "F.linear")]
    print(f"M={M:5d} layer total: F {f*1e3:.2f}ms onednn {tot[(M,'onednn')]/f:.3f}x "
          f"mkl {tot[(M,'mkl')]/f:.3f}x")
# onednn packed once with a hint, used at another M
w = torch.randn(5632, 1024) * 0.02; pw = torch.ops.mkldnn._reorder_linear_weight(w, 512)
for M in (1, 64, 2048):
    x = torch.randn(M, 1024)
    y = torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")
    a = timeit(lambda: F.linear(x, w), 0.3)
    b = timeit(lambda: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], ""), 0.3)
    print(f"gate_up packed@512 used at M={M}: {b/a:.3f}x F.linear, maxdiff {float((y-F.linear(x,w)).abs().max()):.2e}")
