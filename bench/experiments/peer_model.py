"""The checkpoint both systems serve in the peer experiment: a random Llama whose tokenizer covers every id.

Why its own tokenizer: with a random model whose vocabulary is larger than its tokenizer's,
most generated ids decode to empty text. pdserve sends no stream event for an empty text
delta while vLLM sends one per token, so a client would count different events and see
stalls that are not there. Here the vocabulary is exactly the tokenizer's, and every id but
the two special ones decodes to a word of its own:

- ids 0 .. V-3: the words ``t0`` .. ``t{V-3}`` (a WordLevel model split on whitespace, so the
  text ``"t5 t17"`` is exactly two tokens and each token's text delta is ``" t17"``);
- id V-2 ``<unk>`` and id V-1 ``<|endoftext|>`` (the EOS), both special.

The ``lm_head`` rows of the two special ids are zero: their logit is exactly 0 while the
largest of the thousands of random others is positive, so greedy decoding never emits them
(the benchmark also sends ``ignore_eos``). Weights are ``random_hf_weights`` (seeded); the
files are config.json, model.safetensors, tokenizer.json and tokenizer_config.json, which
pdserve's engine, transformers and vLLM all read. (Llama, not Qwen2: transformers maps the
qwen2 model type onto its own Qwen2Tokenizer whatever tokenizer_config.json says, and that
class does not read this tokenizer.json.)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

# name -> (vocab, hidden, intermediate, layers, heads, kv heads). "peer" is the issue's ~123M
# checkpoint (hidden 1024, 8 layers, fp32); "small" has the compute of the bench's small model (the
# trace-routing experiment's) with 64-wide heads, for the trace cell (peer_trace.py); "tiny" is for
# tests of the harness.
PEER_MODELS = {
    "peer": (16384, 1024, 2816, 8, 16, 2),
    "small": (16384, 256, 688, 8, 4, 2),
    "tiny": (512, 128, 256, 2, 2, 1),  # head_dim 64: vLLM-CPU's attention has no kernel for 16
}
UNK, EOS = "<unk>", "<|endoftext|>"


def peer_config(size: str, max_len: int):
    from pdserve.engine.config import ModelConfig

    if size not in PEER_MODELS:
        raise ValueError(f"peer model size must be one of {sorted(PEER_MODELS)}, got {size!r}")
    vocab, hidden, inter, layers, heads, kv_heads = PEER_MODELS[size]
    return ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                       num_heads=heads, num_kv_heads=kv_heads, max_position_embeddings=max_len,
                       architecture="LlamaForCausalLM", eos_token_ids=[vocab - 1])


def write_tokenizer(directory: Path, vocab_size: int, max_len: int) -> None:
    """tokenizer.json + tokenizer_config.json for vocab_size ids (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(vocab_size - 2)}
    vocab[UNK], vocab[EOS] = vocab_size - 2, vocab_size - 1
    tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(UNK, special=True), AddedToken(EOS, special=True)])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": UNK, "eos_token": EOS, "pad_token": EOS,
        "model_max_length": max_len, "clean_up_tokenization_spaces": False,
    }, indent=2))


def peer_model(root: Path, size: str = "peer", max_len: int = 4096, seed: int = 0) -> Path:
    """The checkpoint directory for `size`, written once under root (atomically: a half-written one is redone)."""
    from pdserve.engine.checkpoint import random_hf_weights, save_hf_checkpoint

    cfg = peer_config(size, max_len)
    path = Path(root) / f"peer-model-{size}-{max_len}"
    if (path / "tokenizer_config.json").exists():
        return path
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = random_hf_weights(cfg, seed=seed)
    weights["lm_head.weight"][cfg.vocab_size - 2:] = 0.0  # <unk> and EOS: logit 0, never the argmax
    save_hf_checkpoint(weights, cfg, tmp)
    write_tokenizer(tmp, cfg.vocab_size, max_len)
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


PEER_DTYPES = ("bfloat16", "float32")  # the dtypes the peer experiment serves both systems in (bytes: DTYPE_BYTES)


def kv_bytes_per_token(size: str, dtype_bytes: int = 4) -> int:
    """KV cache bytes one token takes in every layer (K and V), for sizing vLLM's KV in bytes."""
    cfg = peer_config(size, 16)
    return cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes
