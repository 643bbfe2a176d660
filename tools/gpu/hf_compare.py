"""Section 5, transformers: ours against transformers' LlamaForCausalLM on the same GPU and the same tensors.

The 8B-shape model of the decode and prefill sections (perf.py) and a LlamaForCausalLM twin that
shares its weight tensors (``hf_twin``; a same-weights logit check first), timed A B A B
(``alternate``): the decode step at batch 1, 8, 32 over a 1k context (transformers from its own
prefill into a DynamicCache) and prefill of 1, 8, 32 prompts of 2k tokens. Each row is the ratio
ours / theirs of the medians; the targets are decode >= 2x at batch 32 and prefill >= 1x.
"""

from __future__ import annotations

import statistics
import time

from checklib import Budget, Record, guarded, log, release, sig, sync, time_median
from perf import PrefillRunner, capture, get_model, open_cell, prefill_engine


def hf_names(cfg) -> dict[str, str]:
    """Our parameter name -> the transformers parameter holding the same tensor (Llama: one each)."""
    from pdserve.engine.models import layer_class

    out = {"embed_tokens.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    for i in range(cfg.num_layers):
        for ours, sources in layer_class(cfg).checkpoint_tensors(cfg, i).items():
            if len(sources) != 1:
                raise ValueError(f"layer {i} {ours} is made of {len(sources)} tensors; the twin needs one each")
            out[f"layers.{i}.{ours}"] = f"model.layers.{i}.{sources[0][0]}"
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = "lm_head.weight"
    return out


def hf_twin(model, dtype, device):
    """transformers' LlamaForCausalLM whose parameters are ``model``'s tensors (shared, not copied)."""
    import torch
    import transformers

    cfg = model.cfg
    hf_cfg = transformers.LlamaConfig.from_dict(cfg.to_hf_dict())
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    theirs, ours = dict(hf.named_parameters()), dict(model.named_parameters())
    for name, hf_name in hf_names(cfg).items():
        if theirs[hf_name].shape != ours[name].shape:
            raise ValueError(f"{hf_name} {tuple(theirs[hf_name].shape)} vs ours {tuple(ours[name].shape)}")
        theirs[hf_name].data = ours[name].data
    release(device)
    return hf.eval().requires_grad_(False)


def twin_diff(model, hf, device, n: int = 16) -> float:
    """Max |logit diff| of the last position of one prompt, ours (forward_dense) vs theirs."""
    import torch

    ids = torch.randint(0, model.cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(9)).to(device)
    with torch.inference_mode():
        a = model.forward_dense(ids)[-1].float()
        b = hf(ids.unsqueeze(0)).logits[0, -1].float()
    return (a - b).abs().max().item()


class HFDecode:
    """Their decode at batch B, context C: the cache from their own forward, then one-token steps."""

    def __init__(self, hf, batch: int, context: int, vocab: int, device):
        import torch

        gen = torch.Generator().manual_seed(11)
        self.hf = hf
        self.ids = torch.randint(0, vocab, (batch, context), generator=gen).to(device)
        self.token = torch.randint(0, vocab, (batch, 1), generator=gen).to(device)
        self.cache = None

    def reset(self) -> None:
        """A fresh cache of exactly C tokens (the steps of a repetition grow it by one each)."""
        import torch

        self.cache = None
        with torch.inference_mode():
            self.cache = self.hf(self.ids, use_cache=True, logits_to_keep=1).past_key_values

    def step(self):
        return self.hf(input_ids=self.token, past_key_values=self.cache, use_cache=True)


def alternate(reps: int, ours, theirs) -> tuple[list[float], list[float]]:
    """Run ``ours()`` and ``theirs()`` (each returns a time) ``reps`` times, A B then B A, ..."""
    a, b = [], []
    for rep in range(reps):
        for who in ("ours", "theirs") if rep % 2 == 0 else ("theirs", "ours"):
            (a if who == "ours" else b).append(ours() if who == "ours" else theirs())
    return a, b


def compared(ours: list[float], theirs: list[float], unit: str) -> dict:
    """Medians of both sides, the speedup (their time / ours) and every sample."""
    o, t = statistics.median(ours), statistics.median(theirs)
    return {f"ours_{unit}": sig(o), f"theirs_{unit}": sig(t), "speedup": sig(t / o),
            f"ours_samples_{unit}": [sig(x) for x in ours], f"theirs_samples_{unit}": [sig(x) for x in theirs]}


def run_transformers(ctx, rec: Record, budget: Budget) -> None:
    import transformers

    transformers.utils.logging.set_verbosity_error()
    model = get_model(ctx)
    log("transformers", "building LlamaForCausalLM on the same tensors")
    hf = hf_twin(model, ctx.dtype, ctx.device)
    rec.results.update(transformers=transformers.__version__, attn_implementation=hf.config._attn_implementation,
                       weights="shared with ours (the same tensors)", rows=[])
    rec.results["same_weights_max_logit_diff"] = sig(twin_diff(model, hf, ctx.device))
    rec.save()
    log("transformers", f"same-weights check: max |logit diff| {rec.results['same_weights_max_logit_diff']}")
    plan = ctx.plan
    cells = [("decode", b, f"decode batch {b} x context {plan.hf_context}") for b in plan.hf_decode_batches]
    cells += [("prefill", n, f"prefill {n} x {plan.prefill_len}") for n in plan.hf_prefill_prompts]
    engine = None
    for kind, n, label in cells:
        if budget.left() <= 0:
            rec.skip(label, "budget spent")
            continue
        row = {"kind": kind, **({"batch": n, "context": plan.hf_context} if kind == "decode"
                                else {"prompts": n, "length": plan.prefill_len})}
        rec.results["rows"].append(row)
        rec.save()  # a cell killed mid-way still shows in the file
        with guarded(rec, label, row, ctx.device):
            if kind == "decode":
                hf_decode_cell(ctx, rec, model, hf, row, label)
            else:
                engine = engine or prefill_engine(ctx, model, max(plan.hf_prefill_prompts), plan.prefill_len)
                hf_prefill_cell(ctx, model, hf, engine, row)
            if "speedup" in row:
                log("transformers", f"{label}: {fmt_compared(row)}")
        rec.save()
        release(ctx.device)
    if engine is not None:
        engine.close()
    del hf, engine
    release(ctx.device)


def fmt_compared(row: dict) -> str:
    unit = "ms" if "ours_ms" in row else "s"
    scale = 1.0 if unit == "ms" else 1e3
    return (f"ours {row[f'ours_{unit}'] * scale:.3f} ms, theirs {row[f'theirs_{unit}'] * scale:.3f} ms, "
            f"speedup {row['speedup']:.2f}x")


def hf_decode_cell(ctx, rec: Record, model, hf, row: dict, label: str) -> None:
    import torch

    plan = ctx.plan
    steps, warm = plan.hf_steps, plan.decode_warmup
    log("transformers", f"{label}: one warm-up each, then {plan.hf_reps} alternating repetitions of {steps} steps "
                        "each side")
    cell = open_cell(ctx, model, row["batch"], row["context"])
    if isinstance(cell, str):
        row["note"] = cell
        rec.note(f"{label}: {cell}")
        return
    row["ours_variant"] = "graphs" if capture(ctx, cell, rec, label) is not None else "eager"
    theirs = HFDecode(hf, row["batch"], row["context"], model.cfg.vocab_size, ctx.device)

    def ours_once():
        with torch.inference_mode():
            return time_median(cell.step, ctx.device, steps, warm)[0]

    def theirs_once():
        theirs.reset()
        with torch.inference_mode():
            return time_median(theirs.step, ctx.device, steps, warm)[0]

    ours_once(), theirs_once()  # one warm-up each (the first replay, their first cache build), not counted
    row.update(compared(*alternate(plan.hf_reps, ours_once, theirs_once), "ms"))


def hf_prefill_cell(ctx, model, hf, engine, row: dict) -> None:
    import torch

    plan, prompts, length = ctx.plan, row["prompts"], row["length"]
    log("transformers", f"prefill {prompts} x {length}: one warm-up each, then {plan.hf_reps} alternating repetitions")
    runner = PrefillRunner(ctx, engine, length)
    ids = torch.randint(0, model.cfg.vocab_size, (prompts, length), generator=torch.Generator().manual_seed(13))
    ids = ids.to(ctx.device)

    def theirs_once() -> float:
        sync(ctx.device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            hf(ids, use_cache=True, logits_to_keep=1)  # the output (and its cache) is dropped at once
        sync(ctx.device)
        return time.perf_counter() - t0

    runner.time_once(prompts)
    theirs_once()
    row.update(compared(*alternate(plan.hf_reps, lambda: runner.time_once(prompts), theirs_once), "s"))
