"""engine/attention.py decode_attend: the grouped-head CPU path gives SDPA's result."""

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.attention import decode_attend, decode_window_mask, mask_bias


@pytest.mark.parametrize("heads,kv_heads", [(16, 2), (4, 4), (6, 1)])
@pytest.mark.parametrize("window", [None, 5])
def test_decode_attend_matches_sdpa_with_ragged_contexts(heads, kv_heads, window):
    torch.manual_seed(0)
    b, length, d = 4, 23, 8
    q = torch.randn(b, heads, d)
    k, v = torch.randn(b, length, kv_heads, d), torch.randn(b, length, kv_heads, d)
    ctx = torch.tensor([23, 1, 9, 17])  # each row sees only its first ctx slots (the rest is padding)
    mask = (torch.arange(length) < ctx.unsqueeze(1)).view(b, 1, 1, length)
    if window is not None:
        mask = decode_window_mask(mask, ctx - 1, window)
    want = F.scaled_dot_product_attention(q.unsqueeze(2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          scale=0.3, enable_gqa=True).squeeze(2)
    got = decode_attend(q, k, v, mask_bias(mask, q.dtype), scale=0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # padding slots do not count: garbage there changes nothing
    k2, v2 = k.clone(), v.clone()
    k2[1, 1:], v2[1, 1:] = 1e4, -1e4
    torch.testing.assert_close(decode_attend(q, k2, v2, mask_bias(mask, q.dtype), scale=0.3), got)


def test_mask_bias_is_zero_inside_and_minus_inf_outside():
    mask = torch.tensor([[True, False, True]]).view(1, 1, 1, 3)
    assert mask_bias(mask, torch.float32).tolist() == [[[0.0, float("-inf"), 0.0]]]
