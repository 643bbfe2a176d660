"""MKL's packed sgemm through libtorch_cpu's exported cblas_sgemm_pack/compute: packed once, used at any M?"""
import ctypes, os, sys, time, torch, torch.nn.functional as F
torch.set_num_threads(1); torch.manual_seed(0)
lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
RowMajor, NoTrans, Trans, Packed, BMatrix = 101, 111, 112, 151, 162
lib.cblas_sgemm_pack_get_size.restype = ctypes.c_size_t
lib.cblas_sgemm_pack_get_size.argtypes = [ctypes.c_int] * 4
lib.cblas_sgemm_pack.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
lib.cblas_sgemm_compute.argtypes = [ctypes.c_int] * 6 + [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                                        ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
def pack(w, m_hint):
    N, K = w.shape
    size = lib.cblas_sgemm_pack_get_size(BMatrix, m_hint, N, K)
    buf = torch.empty((size + 3) // 4, dtype=torch.float32)
    lib.cblas_sgemm_pack(RowMajor, BMatrix, Trans, m_hint, N, K, 1.0, w.data_ptr(), K, buf.data_ptr())
    return buf, size
def linear(x, buf, N, K):
    M = x.shape[0]; out = torch.empty(M, N)
    lib.cblas_sgemm_compute(RowMajor, NoTrans, Packed, M, N, K, x.data_ptr(), K, buf.data_ptr(), K, 0.0,
                            out.data_ptr(), N)
    return out
def timeit(fn, secs):
    fn(); t = time.perf_counter(); n = 0
    while time.perf_counter() - t < secs: fn(); n += 1
    return (time.perf_counter() - t) / n
timing = len(sys.argv) > 1
shapes = {"q": (1024, 1024), "k": (128, 1024), "gate": (2816, 1024), "down": (1024, 2816), "gate_up": (5632, 1024)}
for hint in (1, 8, 512, 2048):
    for name, (N, K) in shapes.items():
        w = torch.randn(N, K) * 0.02
        buf, size = pack(w, hint)
        worst = 0.0
        for M in (1, 2, 3, 4, 7, 8, 16, 33, 64, 128, 500, 512, 1000, 2048):
            x = torch.randn(M, K)
            worst = max(worst, float((linear(x, buf, N, K) - F.linear(x, w)).abs().max()))
        print(f"hint {hint:5d} {name:8s} packed bytes {size/(N*K*4):.3f}x weight; "
              f"worst maxdiff over M: {worst:.2e}", flush=True)
if timing:
    tot = {}
    for M in (1, 4, 8, 64, 512, 2048):
        for name, (N, K) in shapes.items():
            w = torch.randn(N, K) * 0.02; x = torch.randn(M, K); buf, _ = pack(w, 512)
            pw = torch.ops.mkldnn._reorder_linear_weight(w, 8)
            fns = {"F": lambda: F.linear(x, w), "mklpack": lambda: linear(x, buf, N, K),
                   "onednn8": lambda: torch.ops.mkldnn._linear_pointwise(x, pw, None, "none", [], "")}
            t = {k: min(timeit(f, 0.25 if M < 512 else 0.5) for _ in range(2)) for k, f in fns.items()}
            for k in t: tot[(M, k)] = tot.get((M, k), 0) + t[k]
            print(f"M={M:5d} {name:8s} " + " ".join(f"{k} {v*1e3:.3f}ms" for k, v in t.items()), flush=True)
        f = tot[(M, "F")]
        print(f"M={M:5d} all: F {f*1e3:.2f}ms mklpack {tot[(M,'mklpack')]/f:.3f}x "
              f"onednn8 {tot[(M,'onednn8')]/f:.3f}x", flush=True)
