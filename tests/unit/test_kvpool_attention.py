"""DistAttention's merge equals attention over the whole sequence (random shapes, GQA, float32)."""

import random

import pytest
import torch
import torch.nn.functional as F

from pdserve.kvpool.attention import from_bytes, merge, micro_attention, to_bytes


def _full(q, k, v):
    return F.scaled_dot_product_attention(q[None, :, None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                          enable_gqa=True)[0, :, 0]


@pytest.mark.parametrize("seed", range(12))
def test_merge_of_random_splits_equals_full_attention(seed):
    rnd = random.Random(seed)
    torch.manual_seed(seed)
    kv_heads = rnd.choice([1, 2, 4])
    heads = kv_heads * rnd.choice([1, 2, 4])        # MHA and GQA
    dim, n = rnd.choice([8, 16, 64]), rnd.randint(1, 600)
    q = torch.randn(heads, dim) * rnd.choice([0.1, 1.0, 5.0])   # also peaked softmaxes
    k, v = torch.randn(n, kv_heads, dim), torch.randn(n, kv_heads, dim)
    cuts = sorted(rnd.sample(range(1, n), min(n - 1, rnd.randint(0, 5)))) if n > 1 else []
    bounds = list(zip([0] + cuts, cuts + [n]))
    parts = [micro_attention(q, k[a:b], v[a:b]) for a, b in bounds]
    rnd.shuffle(parts)  # the order the lenders answer in does not matter
    # through the wire format too
    parts = [from_bytes(*to_bytes(p), heads) for p in parts]
    assert torch.allclose(merge(parts), _full(q, k, v), atol=1e-5, rtol=0)


def test_one_part_is_plain_attention_and_errors_are_clear():
    q, k, v = torch.randn(4, 8), torch.randn(10, 2, 8), torch.randn(10, 2, 8)
    assert torch.allclose(merge([micro_attention(q, k, v)]), _full(q, k, v), atol=1e-6)
    with pytest.raises(ValueError, match="not a multiple of KV heads 3"):
        micro_attention(torch.randn(4, 8), torch.randn(5, 3, 8), torch.randn(5, 3, 8))
    with pytest.raises(ValueError, match="at least one key"):
        micro_attention(q, k[:0], v[:0])
    with pytest.raises(ValueError, match="at least one partial"):
        merge([])
