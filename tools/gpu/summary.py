"""The GPU check's summary: one row per figure (section, cell, figure, target, verdict), and the table.

``summary_rows(doc, plan)`` reads check.json's sections (in the run's order) and gives every
figure a row: a section that did not end "ok"/"partial" first gets a ``(section)`` row with its
status and error; a cell without figures says why (its error, "does not fit", or cut off while
it ran). ``render_summary(doc)`` is the table the supervisor prints once at the end.

Targets are the issue's, for the 8B shape (see ``decode_target`` & co.). A verdict is "ok" or
"MISS" against the target, "n/a (smoke)" in a smoke run (its shapes are not the issue's), and
"ERROR"/"FAIL" for a cell or check that failed.
"""

from __future__ import annotations


# The issue's targets are for the 8B shape: decode at 1k context >= 70% of the copy bandwidth at
# batch 1-32 and >= 50% at 128-256; prefill of 8 x 2k >= 50% of the GEMM rate; against transformers,
# decode >= 2x at batch 32 and prefill >= 1x at every batch. A smoke plan shows them on its own
# first context / largest batch, never judged (its shapes are not the issue's).
def decode_target(plan, batch: int, context: int) -> float | None:
    """Fraction of copy bandwidth a captured decode step should reach (at the first context only)."""
    if context != plan.decode_contexts[0]:
        return None
    return 0.70 if batch <= 32 else 0.50


def prefill_target(plan, prompts: int) -> float | None:
    judged = 8 if 8 in plan.prefill_prompts else plan.prefill_prompts[-1]
    return 0.50 if prompts == judged else None


def hf_target(plan, row: dict) -> float | None:
    if row["kind"] == "prefill":
        return 1.0
    judged = 32 if 32 in plan.hf_decode_batches else plan.hf_decode_batches[-1]
    return 2.0 if row["batch"] == judged else None


def pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def verdict(value: float | None, target: float | None, plan) -> str:
    if target is None:
        return ""
    if plan.smoke:
        return "n/a (smoke)"
    return "?" if value is None else ("ok" if value >= target else "MISS")


def summary_rows(doc: dict, plan) -> list[tuple[str, str, str, str, str]]:
    rows: list[tuple[str, str, str, str, str]] = []
    for name, data in doc["sections"].items():  # in the run's order
        status = data.get("status")
        if status not in ("ok", "partial"):
            why = data.get("error") or data.get("reason") or ""
            rows.append((name, "(section)", f"{status}: {why}"[:110], "", "" if status == "skipped" else "ERROR"))
        res = data.get("results") or {}
        rows += ROWS[name](res, plan)
        for item in data.get("skipped") or []:
            rows.append((name, item.split(":")[0], "skipped: " + item.split(":", 1)[-1].strip(), "", ""))
    return rows


def failed(row: dict) -> str:
    """A cell without figures: its error, or that it was cut off while it ran."""
    if "error" in row:
        return f"ERROR {row['error']}"[:110]
    return "no result: the section was killed or its worker died while this cell ran"


def ceilings_rows(res: dict, plan) -> list:
    out = []
    if "copy" in res:
        c = res["copy"]
        out.append(("ceilings", f"copy {c['buffer_bytes'] / 2**20:.0f} MiB", f"{c['gb_per_s']:.4g} GB/s (read + write)",
                    "", ""))
    if "gemm" in res:
        g = res["gemm"]
        out.append(("ceilings", f"gemm {g['n']}^3 {g['dtype']}", f"{g['tflop_per_s']:.4g} TFLOP/s", "", ""))
    return out


def parity_rows(res: dict, plan) -> list:
    out = []
    for r in res.get("rows", []):
        if "tokens_equal" not in r:
            out.append(("parity", r["family"], failed(r), "tokens equal or a near-tie, diff <= tol", "ERROR"))
            continue
        first = "" if r["tokens_equal"] else f" (from token {r['first_difference']})"
        if r.get("near_ties"):
            first = (f" (from token {r['first_difference']}: ours = the fp32 model's)" if not r["tie_gaps"] else
                     f" (from token {r['first_difference']}: near-tie, fp32 gap {max(r['tie_gaps']):.3g})")
        fig = (f"{res.get('dtype')}: tokens equal {'y' if r['tokens_equal'] else 'n'}{first}, "
               f"max|diff| {r['max_diff']:.3g} (tol {r['tol']:.3g})")
        ok = (r["tokens_equal"] or r.get("near_ties")) and r["within_tol"]
        out.append(("parity", r["family"], fig, "tokens equal or a near-tie, diff <= tol",
                    "ok" if ok else "MISS"))
    return out


def decode_rows(res: dict, plan) -> list:
    out = []
    exact = res.get("fused_exactness") or {}
    if exact:
        worst = min(exact.items(), key=lambda kv: kv[1].get("equal", 0)) if "error" not in exact else None
        fig = failed(exact) if worst is None else (
            f"{len(exact)} cases; least bitwise-equal: {worst[0]} {100 * worst[1]['equal']:.2f}%, "
            f"max |diff| {worst[1]['max_diff']:.3g}")
        out.append(("decode", "fused vs torch ops", fig, "", ""))
    for c in res.get("cells", []):
        cell = f"B{c['batch']} ctx {c['context']}"
        target = decode_target(plan, c["batch"], c["context"])
        ttext = "" if target is None else f">= {pct(target)} of copy"
        if "error" in c or "fits" not in c:
            out.append(("decode", cell, failed(c), ttext, "ERROR"))
        if not c.get("fits", True):
            out.append(("decode", cell, c.get("note", "does not fit"), ttext, "n/a" if target else ""))
            continue
        for variant in ("graphs", "eager"):
            r = c.get(variant)
            if not r:
                continue
            if "ms" not in r:
                out.append(("decode", f"{cell} {variant}", r.get("status", "?"), "", ""))
                continue
            fig = f"{r['ms']:.3f} ms, {r['gb_per_s']:.4g} GB/s = {pct(r.get('fraction_of_copy'))} of copy"
            judged = variant == "graphs" or c.get("graphs", {}).get("status") == "n/a on cpu"
            out.append(("decode", f"{cell} {variant}", fig, ttext if judged else "",
                        verdict(r.get("fraction_of_copy"), target, plan) if judged else ""))
        for key, name, off, on in (("fused_ab", "norm+rope A/B", "torch ops", "Triton"),
                                   ("merged_ab", "merged qkv A/B", "separate", "merged"),
                                   ("splits_ab", "attn programs A/B", "256", "1024")):
            ab = c.get(key)
            if ab:
                out.append(("decode", f"{cell} {name}", f"{off} {ab['off']['ms']:.3f} ms, {on} {ab['on']['ms']:.3f} ms "
                            f"({pct(ab['on'].get('fraction_of_copy'))} of copy): {ab['speedup']:.3g}x", "", ""))
        sweep = c.get("decode_splits")
        if sweep:
            out.append(("decode", f"{cell} attn partitions", ", ".join(f"{k}: {v:.3g}" for k, v in sweep["ms"].items())
                        + f" ms; picked {sweep['picked']}, best {sweep['best']}", "", ""))
        prof = (c.get("profile") or {}).get("graphs") or (c.get("profile") or {}).get("eager")
        if prof:
            out.append(("decode", f"{cell} profile", f"{prof['kernels_per_step']:.0f} kernels, "
                        f"{prof['kernel_us_per_step'] / 1e3:.3f} ms kernel time per step", "", ""))
    return out


def prefill_rows(res: dict, plan) -> list:
    out = []
    ab = res.get("attention_ab") or {}
    if "error" in ab:
        out.append(("prefill", "attention A/B", failed(ab), "", "ERROR"))
    for name, r in (ab.get("variants") or {}).items():
        out.append(("prefill", f"attention {ab['prompts']} x {ab['length']} {name}",
                    f"{r['ms']:.3f} ms, {r['tflop_per_s']:.4g} TFLOP/s, max|diff| from sdpa {r['max_diff']:.3g}",
                    "", ""))
    for c in res.get("cells", []):
        target = prefill_target(plan, c["prompts"])
        if "s" not in c:
            out.append(("prefill", f"{c['prompts']} x {c['length']}", failed(c), "", "ERROR"))
            continue
        fig = f"{c['s'] * 1e3:.1f} ms, {c['tflop_per_s']:.4g} TFLOP/s = {pct(c.get('fraction_of_gemm'))} of GEMM"
        ttext = "" if target is None else f">= {pct(target)} of GEMM"
        out.append(("prefill", f"{c['prompts']} x {c['length']}", fig, ttext,
                    verdict(c.get("fraction_of_gemm"), target, plan)))
    return out


def transformers_rows(res: dict, plan) -> list:
    out = []
    if "same_weights_max_logit_diff" in res:
        out.append(("transformers", "same tensors", f"max|logit diff| {res['same_weights_max_logit_diff']:.3g} "
                    f"(transformers {res.get('transformers')}, {res.get('attn_implementation')})", "", ""))
    for r in res.get("rows", []):
        target = hf_target(plan, r)
        ttext = "" if target is None else f">= {target:g}x"
        if r["kind"] == "decode":
            variant = f" ({r['ours_variant']})" if "ours_variant" in r else ""
            cell = f"decode B{r['batch']} ctx {r['context']}{variant}"
        else:
            cell = f"prefill {r['prompts']} x {r['length']}"
        if "speedup" not in r:
            note = "note" in r and "error" not in r
            out.append(("transformers", cell, r["note"] if note else failed(r), ttext, "n/a" if note else "ERROR"))
        elif r["kind"] == "decode":
            fig = f"ours {r['ours_ms']:.3f} ms, theirs {r['theirs_ms']:.3f} ms: {r['speedup']:.2f}x"
            out.append(("transformers", cell, fig, ttext, verdict(r["speedup"], target, plan)))
        else:
            fig = f"ours {r['ours_s'] * 1e3:.1f} ms, theirs {r['theirs_s'] * 1e3:.1f} ms: {r['speedup']:.2f}x"
            out.append(("transformers", cell, fig, ttext, verdict(r["speedup"], target, plan)))
    return out


def pd_rows(res: dict, plan) -> list:
    out = []
    if "nixl_importable" in res:
        out.append(("pd", "nixl package", res.get("nixl", ""), "", ""))
    for r in res.get("runs", []):
        times = [q["s"] for q in r.get("requests", [])]
        mean = f"; {sum(times) / len(times):.2f} s per request" if times else ""
        fig = (r.get("verdict") or r.get("error") or f"rc {r['rc']}, no verdict line") + mean
        out.append(("pd", r["transfer"], fig[:110], "all equal, nothing held", "ok" if r.get("ok") else "FAIL"))
    for r in res.get("long", []):
        out.append(("pd", r["transfer"], (r.get("verdict") or r.get("error") or f"rc {r['rc']}")[:110],
                    "all equal, nothing held", "ok" if r.get("ok") else "FAIL"))
        for q in r.get("requests", []):
            if "ttft_ratio" not in q:
                continue
            rate = q["kv_mib"] / 1024 / (q["kv_layer_sends_ms"] / 1e3) if q["kv_layer_sends_ms"] else float("nan")
            fig = (f"ttft {q['ttft_ms']:.1f} ms = {q['ttft_ratio']:.2f}x alone; kv {q['kv_mib']:.1f} MiB, sends "
                   f"{q['kv_layer_sends_ms']:.1f} ms ({rate:.2f} GiB/s), span {q['kv_span_ms']:.1f} ms")
            target = "<= 1.1x at 2k" if q["prompt_tokens"] == 2048 else ""
            ok = "" if not target else ("ok" if q["ttft_ratio"] <= 1.1 else "MISS")
            out.append(("pd", f"{r['transfer']} {q['prompt_tokens']} tokens", fig[:110], target, ok))
    return out


def fp8_rows(res: dict, plan) -> list:
    """Issue 45's GPU targets: FP8 decode step <= 0.6x at batch 1, prefill of 8 x 2k >= 1.5x, FP8 KV >= 1.9x tokens."""
    out = [("fp8", "matmuls", str(res.get("path", "?"))[:110], "", "")] if "path" in res else []
    kv = res.get("kv") or {}
    if "tokens_ratio" in kv:
        out.append(("fp8", "KV tokens per byte", f"{kv['tokens_ratio']:.3g}x ({kv['fp8_block_bytes']} / "
                    f"{kv['dtype_block_bytes']} bytes a block)", ">= 1.9x", verdict(kv["tokens_ratio"], 1.9, plan)))
    elif kv:
        out.append(("fp8", "KV tokens per byte", kv.get("note") or failed(kv), "", ""))
    for c in res.get("decode", []):
        cell = f"decode B{c['batch']} ctx {c['context']}"
        judged = c["batch"] == 1
        if "ratio" not in c:
            out.append(("fp8", cell, c.get("note") or failed(c), "", "ERROR" if "error" in c else ""))
            continue
        fig = (f"FP8 / {res.get('dtype')} step: median {c['ratio']:.3f} (worst {c['worst_ratio']:.3f}); "
               + ", ".join(f"{x['fp8_ms']:.3f}/{x['dtype_ms']:.3f} ms" for x in c["rounds"][:2]))
        ok = "" if not judged else ("n/a (smoke)" if plan.smoke else "ok" if c["worst_ratio"] <= 0.6 else "MISS")
        out.append(("fp8", cell, fig[:110], "<= 0.6 every round" if judged else "", ok))
    for c in res.get("prefill", []):
        cell = f"prefill {c['prompts']} x {c['length']}"
        if "speedup" not in c:
            out.append(("fp8", cell, failed(c), "", "ERROR"))
            continue
        judged = c["prompts"] == 8
        fig = f"{res.get('dtype')} / FP8 time: median {c['speedup']:.3f} (worst {c['worst_speedup']:.3f})"
        ok = "" if not judged else ("n/a (smoke)" if plan.smoke else "ok" if c["worst_speedup"] >= 1.5 else "MISS")
        out.append(("fp8", cell, fig, ">= 1.5 every round" if judged else "", ok))
    acc = res.get("accuracy") or {}
    if "first_token_agreement" in acc:
        out.append(("fp8", "accuracy", f"first tokens equal {pct(acc['first_token_agreement'])} of "
                    f"{acc['prompts']}; max|logit diff| {acc['max_logit_diff_over_std']:.3g} x std", "", ""))
    elif acc:
        out.append(("fp8", "accuracy", failed(acc), "", "ERROR"))
    return out


def tp_rows(res: dict, plan) -> list:
    """Issue 47: TP n against TP 1 (tokens equal; speed reported, not judged: multi-GPU figures are unmeasured
    until a machine with several GPUs runs this)."""
    out = [("tp", "sizes", f"{res.get('sizes')} ({res.get('layers')} layers, {res.get('dtype')})", "", "")]
    if res.get("unmeasured"):
        out.append(("tp", "TP > 1", res["unmeasured"][:110], "", "n/a"))
    for r in res.get("runs", []):
        cell = f"TP {r['size']}"
        if "prefill_ms" not in r:
            out.append(("tp", cell, failed(r), "", "ERROR"))
            continue
        fig = f"prefill {r['prefill_ms']:.1f} ms, decode b1 {r['decode_b1_ms']:.2f} ms, b{plan.tp_decode_batch} " \
              f"{r['decode_bn_ms']:.2f} ms"
        if r["size"] == 1:
            out.append(("tp", cell, fig, "", ""))
            continue
        fig += f" (x{r['prefill_speedup']}, x{r['decode_b1_speedup']}, x{r['decode_bn_speedup']} of TP 1)"
        out.append(("tp", cell, fig[:110], "tokens equal TP 1", "ok" if r.get("tokens_equal") else "FAIL"))
    return out


ROWS = {"ceilings": ceilings_rows, "parity": parity_rows, "decode": decode_rows, "prefill": prefill_rows,
        "transformers": transformers_rows, "fp8": fp8_rows, "pd": pd_rows, "tp": tp_rows}


def render_summary(doc: dict) -> str:
    meta = doc["meta"]
    head = (f"GPU check summary: {meta.get('gpu_name') or meta.get('device', '?')}, {meta.get('dtype', '?')}, "
            f"torch {meta.get('torch')}, triton {meta.get('triton')}, commit {(meta.get('commit') or 'unknown')[:12]} "
            f"(tree: {meta.get('tree', '?')}) "
            f"(sources sha256 {(meta.get('source_sha256') or '?')[:12]}), "
            f"{meta.get('date')}, {meta.get('elapsed_s')} s")
    rows = [("section", "cell", "figure", "target", "verdict")] + [tuple(r.values()) for r in doc["summary"]]
    widths = [max(len(str(r[i])) for r in rows) for i in range(5)]
    lines = ["=" * len(head), head, "=" * len(head)]
    for i, r in enumerate(rows):
        lines.append("  ".join(str(v).ljust(w) for v, w in zip(r, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)
