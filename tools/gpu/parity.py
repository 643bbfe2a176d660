"""Section 2, parity: the engine against transformers on the same weights, one tiny model per family.

Per family of ``SUPPORTED_ARCHITECTURES`` (engine/config.py): transformers builds a tiny model
(hidden 64, 3 layers, 4 heads / 2 KV heads of 16, a sliding window of 12 where the family has one,
the same family features as tests/harness/hf_checkpoints.py), seeded random weights (std 0.15,
norms around their identity), ``save_pretrained`` into a temporary folder; ``load_model`` reads
that folder. Two prompts (9 and 30 tokens, across the window) run as one batch:

- **tokens**: the engine's greedy 16 tokens (``LLMEngine``, block size 16, CUDA graphs on a GPU)
  against transformers' ``generate`` (greedy, 16 new tokens) in the same dtype. Where they differ,
  the row also says whether transformers in float32 agrees with transformers in the check's dtype
  (a bf16 near-tie flips either side).
- **logits**: the engine's logits of each prompt's last position (the first step's sampler input)
  against transformers' forward in the same dtype: max |diff| over both prompts and the vocabulary.
  Tolerance in float32: 1e-4 (the unit tests'). In bf16: ``3 x e + 2^-7 x max|ref|``, with ``e`` the
  max |diff| between transformers in bf16 and in float32 (ref) on the same weights: two bf16
  implementations as accurate as each other stay within a few times either's own error.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from checklib import Budget, Record, guarded, log, release

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))  # the tests' tiny-model builder
from harness import hf_checkpoints  # noqa: E402

PROMPT_LENS = (9, 30)
BLOCK_SIZE = 16  # a power of two >= 16: the paged Triton kernels take it
# family -> (transformers config class, its extra fields, architecture): the unit tests' four families
# (tests/harness/hf_checkpoints.py, the one home of their configs and of the tiny builder) and three more
FAMILIES = {
    "llama": ("LlamaConfig", dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 32}), "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True), "Qwen2ForCausalLM"),
    "mistral": ("MistralConfig", dict(sliding_window=hf_checkpoints.WINDOW), "MistralForCausalLM"),
    **{f: (cls, extra, hf_checkpoints.ARCHITECTURES[f]) for f, (cls, extra) in hf_checkpoints.FAMILIES.items()},
}

def run(ctx, rec: Record, budget: Budget) -> None:
    import transformers

    from pdserve.engine.config import SUPPORTED_ARCHITECTURES

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    dtype = ctx.parity_dtype
    rec.results.update(dtype=str(dtype).split(".")[-1], rows=[])
    families = [f for f in FAMILIES if FAMILIES[f][2] in SUPPORTED_ARCHITECTURES]
    extra = sorted(set(SUPPORTED_ARCHITECTURES.values()) - set(families))
    if extra:
        rec.note(f"families the engine supports but this check has no tiny config for: {extra}")
    for family in families:
        if budget.left() <= 0:
            rec.skip(family, "budget spent")
            continue
        log("parity", f"{family}: tiny transformers model, {len(PROMPT_LENS)} prompts, "
                      f"{ctx.plan.parity_tokens} greedy tokens, {rec.results['dtype']}")
        row = {"family": family}
        rec.results["rows"].append(row)
        rec.save()  # a cell killed mid-way still shows in the file
        with guarded(rec, family, row, ctx.device):
            row.update(compare_family(family, ctx.device, dtype, ctx.plan.parity_tokens))
            log("parity", f"{family}: " + describe(row))
        rec.save()
        release(ctx.device)


def describe(row: dict) -> str:
    if "error" in row:
        return f"ERROR {row['error']}"
    first = "" if row["tokens_equal"] else f" (first difference at token {row['first_difference']}{ties(row)})"
    return (f"tokens equal {'y' if row['tokens_equal'] else 'n'}{first}, max |logit diff| {row['max_diff']:.3g} "
            f"(tol {row['tol']:.3g}), attention {row['attention']}")


def ties(row: dict) -> str:
    """", near-ties: float32 gaps ..." where the float32 reference's gaps were measured."""
    if "tie_gaps" not in row:
        return ""
    if not row["tie_gaps"]:
        return "; ours equal the float32 model's tokens"
    gaps = ", ".join(f"{g:.3g}" for g in row["tie_gaps"])
    return (f"; from the float32 model's tokens at {row['first_difference_from_float32']}, its gap {gaps}: "
            f"{'near-tie' if row['near_ties'] else 'NOT a near-tie'}")


def build_hf(family: str, seed: int = 3, std: float = 0.15):
    """The transformers model (float32, CPU, eval) of ``family`` with seeded random weights."""
    config_cls, extra, arch = FAMILIES[family]
    return hf_checkpoints.build_from_config(config_cls, extra, arch, seed, std)


def compare_family(family: str, device, dtype, n_tokens: int) -> dict:
    import torch
    import transformers

    from pdserve.engine import load_model

    with tempfile.TemporaryDirectory(prefix=f"parity-{family}-") as d:
        build_hf(family).save_pretrained(d)
        ours = load_model(d, dtype=dtype, device=device)
        attn = hf_attention(ours.config)
        hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=dtype, **attn).to(device).eval()
        ref = None if dtype == torch.float32 else transformers.AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32, **attn).to(device).eval()
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, ours.config.vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    got, first_logits, attention = engine_greedy(ours, prompts, n_tokens)
    row = {"family": family, "architecture": ours.config.architecture, "attention": attention,
           "prompt_lens": list(PROMPT_LENS), "tokens": n_tokens}
    want = [hf_greedy(hf, p, n_tokens) for p in prompts]
    diffs = [first_difference(g, w) for g, w in zip(got, want)]
    row["tokens_equal"] = all(x is None for x in diffs)
    row["first_difference"] = min((x for x in diffs if x is not None), default=None)
    last = torch.stack([hf_last_logits(hf, p) for p in prompts])
    row["max_diff"] = (first_logits - last).abs().max().item()
    if ref is None:
        row["tol"] = 1e-4
    else:
        exact = torch.stack([hf_last_logits(ref, p) for p in prompts])
        own = (last - exact).abs().max().item()
        row["hf_vs_float32"] = own
        row["ours_vs_float32"] = (first_logits - exact).abs().max().item()
        row["tol"] = 3 * own + 2**-7 * exact.abs().max().item()
        if not row["tokens_equal"]:
            want32 = [hf_greedy(ref, p, n_tokens) for p in prompts]
            row["hf_equals_hf_float32"] = want == want32
            # judged against the float32 model's greedy tokens: where ours leave them, the float32 model's
            # own logits for its token and ours; a gap within the tolerance is a near-tie that bf16
            # rounding may break either way (transformers' own bf16 tokens leave them too, at times)
            firsts = [first_difference(g, w) for g, w in zip(got, want32)]
            row["first_difference_from_float32"] = min((x for x in firsts if x is not None), default=None)
            row["tie_gaps"] = [tie_gap(ref, p, g, w, i) for p, g, w, i in zip(prompts, got, want32, firsts)
                               if i is not None]
            row["near_ties"] = all(gap <= row["tol"] for gap in row["tie_gaps"])
    row["within_tol"] = row["max_diff"] <= row["tol"]
    return row


def hf_attention(config) -> dict:
    """transformers' attention for the reference: eager where the family soft-caps attention scores
    (Gemma 2: its sdpa path drops the soft-capping; transformers 5.17 picks sdpa by default)."""
    return {"attn_implementation": "eager"} if getattr(config, "attn_logit_softcapping", None) else {}


def tie_gap(ref, prompt: list[int], got: list[int], want: list[int], i: int) -> float:
    """|logit(want[i]) - logit(got[i])| of the float32 model after the common prefix prompt + want[:i]."""
    logits = hf_last_logits(ref, prompt + want[:i])
    return abs(logits[got[i]] - logits[want[i]]).item() if i < min(len(got), len(want)) else float("inf")


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def engine_greedy(loaded, prompts: list[list[int]], n_tokens: int):
    """(greedy tokens per prompt, the first step's logits [prompts, vocab], the engine's attention path)."""
    from harness.engine_runs import greedy_with_first_logits
    from pdserve.engine import EngineConfig, LLMEngine

    engine = LLMEngine(loaded, EngineConfig(num_blocks=32, block_size=BLOCK_SIZE, max_num_seqs=4, detokenize=False))
    tokens, first_logits = greedy_with_first_logits(engine, prompts, n_tokens)
    attention = getattr(engine.runner, "attention", "torch")
    if getattr(engine.runner, "graphs", None) is not None:
        attention += " + cuda graphs"
    engine.close()
    return tokens, first_logits, attention


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    import torch

    dev = next(hf.parameters()).device
    ids_t = torch.tensor([ids], device=dev)  # an explicit mask: Gemma's pad id 0 may occur in a random prompt
    with torch.no_grad():
        out = hf.generate(ids_t, attention_mask=torch.ones_like(ids_t), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def hf_last_logits(hf, ids: list[int]):
    import torch

    dev = next(hf.parameters()).device
    with torch.no_grad():
        return hf(torch.tensor([ids], device=dev)).logits[0, -1].float()
