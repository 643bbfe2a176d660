import time, torch
torch.set_num_threads(1)
from pdserve.engine.attention import prefix_attend
fl = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
def tt(f, n=5):
    f(); s = time.thread_time()
    for _ in range(n): f()
    return (time.thread_time() - s) / n * 1e3
for nc, nn in ((64, 3900), (512, 3452), (1024, 1024), (2048, 2048), (3072, 1024)):
    L = nc + nn
    q = torch.randn(1, 4, nn, 64); k = torch.randn(1, 2, L, 64); v = torch.randn(1, 2, L, 64)
    a = tt(lambda: prefix_attend(q, k, v, nc))
    qp = torch.cat([torch.zeros(1, 4, nc, 64), q], 2)
    def padded():
        return fl(torch.cat([q.new_zeros(1, 4, nc, 64), q], 2), k, v, 0.0, True)[0][:, :, nc:]
    b = tt(padded)
    c = tt(lambda: fl(qp, k, v, 0.0, True))
    ref = prefix_attend(q, k, v, nc); err = (padded() - ref).abs().max().item()
    print(f"cached {nc} new {nn}: prefix_attend {a:.1f} ms, padded causal {b:.1f} ms (flash alone {c:.1f}), "
          f"maxdiff {err:.1e}")
x = torch.randn(3964, 688)
print("silu random", tt(lambda: torch.nn.functional.silu(x)), "ms")
