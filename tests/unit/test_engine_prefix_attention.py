"""engine/attention.py prefix_attend: a prefill after a prefix-cache hit (the cached keys and the new keys by
two flash calls merged by log-sum-exp) gives the masked SDPA's result, and falls back to it where it must."""

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine import attention
from pdserve.engine.attention import causal_mask, prefix_attend


def reference(q, k, v, scale):
    mask = causal_mask(q.shape[-2], k.shape[-2], None, q.device)
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, scale=scale,
                                          enable_gqa=True)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("cached,new", [(64, 32), (7, 1), (1, 40), (96, 96), (4, 64), (16, 200)])
def test_prefix_attend_matches_masked_sdpa(heads, kv_heads, cached, new):
    torch.manual_seed(0)
    d = 16
    # q as the engine passes it: a transposed view of [tokens, heads, d]
    q = torch.randn(new, heads, d).transpose(0, 1).unsqueeze(0)
    k, v = torch.randn(1, kv_heads, cached + new, d), torch.randn(1, kv_heads, cached + new, d)
    got = prefix_attend(q, k, v, cached, scale=0.3)
    assert got.shape == (1, heads, new, d)
    torch.testing.assert_close(got, reference(q, k, v, 0.3), atol=2e-5, rtol=2e-5)


def test_prefix_attend_in_bfloat16_is_within_bfloat16_of_the_float32_reference():
    torch.manual_seed(1)
    q = torch.randn(1, 4, 48, 64).bfloat16()
    k, v = torch.randn(1, 2, 176, 64).bfloat16(), torch.randn(1, 2, 176, 64).bfloat16()
    got = prefix_attend(q, k, v, 128)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference(q, k, v, None), atol=2e-2, rtol=2e-2)


def test_later_keys_change_nothing_for_earlier_queries():
    """Causality across the seam: garbage in the last new key leaves every earlier query's output alone."""
    torch.manual_seed(2)
    q = torch.randn(1, 4, 8, 16)
    k, v = torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16)
    k2, v2 = k.clone(), v.clone()
    k2[:, :, -1], v2[:, :, -1] = 50.0, -50.0
    a, b = prefix_attend(q, k, v, 16), prefix_attend(q, k2, v2, 16)
    torch.testing.assert_close(a[:, :, :-1], b[:, :, :-1])
    assert not torch.allclose(a[:, :, -1], b[:, :, -1])


def test_without_the_flash_op_it_is_the_masked_sdpa(monkeypatch):
    monkeypatch.setattr(attention, "_FLASH_CPU", None)
    torch.manual_seed(3)
    q = torch.randn(1, 4, 8, 16)
    k, v = torch.randn(1, 2, 24, 16), torch.randn(1, 2, 24, 16)
    torch.testing.assert_close(prefix_attend(q, k, v, 16), reference(q, k, v, None), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("cached,new,calls", [(16, 128, 1), (16, 127, 2), (96, 96, 2)])
def test_a_short_prefix_takes_one_padded_call_a_long_one_two_merged(monkeypatch, cached, new, calls):
    """new >= 8 x cached: one causal flash call over zero rows + the new queries; else the two calls merged.
    Both give the masked SDPA's result."""
    seen = []
    real = attention._FLASH_CPU

    def counting(q, *rest, **kw):
        seen.append(q.shape[-2])
        return real(q, *rest, **kw)

    monkeypatch.setattr(attention, "_FLASH_CPU", counting)
    torch.manual_seed(4)
    q = torch.randn(1, 4, new, 16)
    k, v = torch.randn(1, 2, cached + new, 16), torch.randn(1, 2, cached + new, 16)
    got = prefix_attend(q, k, v, cached)
    assert len(seen) == calls and (calls == 2 or seen == [cached + new]), seen
    torch.testing.assert_close(got, reference(q, k, v, None), atol=2e-5, rtol=2e-5)
