"""Decode-side pure pieces: the compatibility check names every differing field with both
values; sampling crosses the Session unchanged (including an unset seed)."""

import pytest

from pdserve.decode_server.decode_engine import sampling_from_proto
from pdserve.decode_server.admission import compat_mismatch
from pdserve.engine import SamplingParams
from pdserve.prefill_server.decode_session import first_token_finishes, sampling_to_proto
from pdserve.protos import session_pb2 as pb


def _compat(**kw):
    base = dict(dtype="float32", num_layers=4, num_kv_heads=2, head_dim=16, block_size=64, model="tiny",
                transport="tcp")
    base.update(kw)
    return pb.Compat(**base)


def test_compat_mismatch_names_fields_and_both_values():
    assert compat_mismatch(_compat(), _compat()) is None
    msg = compat_mismatch(_compat(), _compat(dtype="bfloat16", block_size=16, transport="nixl"))
    assert "dtype: prefill='bfloat16' decode='float32'" in msg
    assert "block_size: prefill=16 decode=64" in msg and "transport: prefill='nixl' decode='tcp'" in msg
    assert "num_layers" not in msg


@pytest.mark.parametrize("sp", [
    SamplingParams(max_tokens=7, temperature=0),
    SamplingParams(max_tokens=3, temperature=0.7, top_p=0.9, top_k=5, seed=11, stop=["x"], stop_token_ids=[3],
                   ignore_eos=True),
    SamplingParams(max_tokens=1, seed=0),
])
def test_sampling_round_trips_over_the_session(sp):
    back = sampling_from_proto(pb.Sampling.FromString(sampling_to_proto(sp).SerializeToString()), SamplingParams)
    assert back.max_tokens == sp.max_tokens and back.seed == sp.seed and back.stop == sp.stop
    assert back.stop_token_ids == sp.stop_token_ids and back.ignore_eos == sp.ignore_eos and back.top_k == sp.top_k
    assert back.temperature == sp.temperature and back.top_p == sp.top_p  # exact: doubles on the wire


def test_first_token_can_finish_the_request():
    assert first_token_finishes(257, SamplingParams(max_tokens=5), [257]) == "stop"
    assert first_token_finishes(257, SamplingParams(max_tokens=5, ignore_eos=True), [257]) is None
    assert first_token_finishes(9, SamplingParams(max_tokens=5, stop_token_ids=[9]), [257]) == "stop"
    assert first_token_finishes(9, SamplingParams(max_tokens=1), [257]) == "length"
