"""Decode admission with a KV pool (--kv-pool): a request bigger than this decode's whole pool
is admitted when its peers could lend the rest and the pooled path can serve it (greedy, no
stop strings, logprobs or grammar); otherwise ``too_large`` says which limit it hit."""

from pdserve.decode_server.admission import pooled_refusal, refusal
from pdserve.engine import blocks_needed
from pdserve.protos import session_pb2 as pb
from pdserve.protos.version import PROTOCOL_VERSION

COMPAT = pb.Compat(dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16, block_size=64, model="tiny",
                   transport="tcp")


def _start(n_prompt=1300, max_tokens=12, **sampling):
    return pb.Start(request_id="r", prompt_token_ids=[1] * n_prompt, blocks_needed=blocks_needed(n_prompt, 64),
                    compat=COMPAT, protocol_version=PROTOCOL_VERSION,
                    sampling=pb.Sampling(max_tokens=max_tokens, temperature=0.0, **sampling))


def _refusal(start, pool_blocks):
    return refusal(start, COMPAT, max_model_len=4096, total_blocks=8, draining=False, has_session=False,
                   pool_blocks=pool_blocks, pooled_refusal=pooled_refusal(start))


def test_without_a_pool_a_request_bigger_than_the_pool_never_fits():
    code, reason = _refusal(_start(), pool_blocks=0)
    assert code == "too_large" and "only 8 in all" in reason


def test_with_a_pool_it_is_admitted_up_to_what_the_peers_ever_lend():
    assert _refusal(_start(), pool_blocks=14) is None  # 21 blocks <= 8 + 14
    code, reason = _refusal(_start(1500), pool_blocks=14)  # 24 blocks
    assert code == "too_large" and "lends at most 14 more" in reason


def test_what_the_pooled_path_cannot_serve_is_named():
    for sampling, word in (({"temperature": 0.7}, "greedy"), ({"stop": ["x"]}, "stop strings"),
                           ({"logprobs": 1}, "logprobs")):
        start = _start()
        for key, value in sampling.items():
            if isinstance(value, list):
                getattr(start.sampling, key).extend(value)
            else:
                setattr(start.sampling, key, value)
        code, reason = _refusal(start, pool_blocks=14)
        assert code == "too_large" and word in reason, reason
    assert pooled_refusal(_start()) is None
    # a request that fits this decode is never refused for the pool's limits
    small = _start(100)
    small.sampling.temperature = 0.7
    assert _refusal(small, pool_blocks=14) is None
