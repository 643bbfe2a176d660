"""``echo`` with ``logprobs`` on /v1/completions (what lm-evaluation-harness's loglikelihood tasks
send) through the real ``openai`` client: over P/D (one prefill started with ``--disaggregation
never``, so every other prompt is computed on the decode, while these must be computed on the
prefill) and on a colocated prefill (``--local-fallback``, no decode). The prompt's tokens lead
each choice's logprobs (the first with null), their values equal the engine's in process, for
string and token-id prompts, ``n`` > 1, lists of prompts, streamed and not; ``max_tokens: 0`` with
echo gives the prompt only; a prefix the decode holds is not moved, but the prefill computes the
whole prompt. Afterwards nothing is held on any process.
"""

import json

import pytest

from harness.pd_cluster import (get_json, metric, nothing_held, post_json, start_decode, start_prefill,
                                wait_all_released, wait_ready)
from harness.procs import ProcessGroup

pytestmark = pytest.mark.slow

M = "tiny"
IDS = [256, *b"Once upon a time, a fox"]
OTHER = [256, *b"Lorem ipsum dolor"]
DECISIONS = "pdserve_disaggregation_decisions_total"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    group = ProcessGroup(log_dir=tmp_path_factory.mktemp("echo-logprobs") / "logs")
    try:
        decode = start_decode(group, "tcp", 64)
        prefill = start_prefill(group, [decode.grpc_address], "tcp", 64, extra=["--disaggregation", "never"])
        local = start_prefill(group, [], "tcp", 64, extra=["--local-fallback"], name="colocated")
        for server in (decode, prefill, local):
            wait_ready(server)
        yield {"prefill": prefill, "decode": decode, "local": local}
        readings = wait_all_released([prefill, decode, local])
        assert nothing_held(readings), json.dumps(readings)
    finally:
        group.close()


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def expected():
    """The engine's own prompt logprobs and greedy continuation (with its logprobs), in process."""
    import torch

    from pdserve.engine import EngineConfig, LLMEngine, SamplingParams, load_model

    torch.set_num_threads(1)
    engine = LLMEngine(load_model(M), EngineConfig(num_blocks=16, max_num_seqs=2))
    out = {}
    for name, ids in (("ids", IDS), ("other", OTHER)):
        engine.add_request(name, ids, SamplingParams(max_tokens=3, temperature=0, logprobs=2, prompt_logprobs=2))
        prompt, gen = None, []
        while engine.has_unfinished():
            for o in engine.step():
                prompt = o.prompt_logprobs if o.prompt_logprobs is not None else prompt
                gen += o.logprobs or []
        out[name] = (prompt, gen)
    return out


def _assert_matches(lp, prompt, gen=(), top=2):
    """A choice's completion logprobs: the prompt's entries, then the generated ones, as the engine's."""
    n = len(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n + len(gen)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in list(prompt[1:]) + list(gen)], abs=1e-4)
    for got, e in zip(lp.top_logprobs[1:], list(prompt[1:]) + list(gen)):
        assert len(got) == top
        assert sorted(got.values(), reverse=True) == pytest.approx([v for _, v in e.top], abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_logprobs_over_pd_match_the_engine_and_run_on_prefill(cluster, expected):
    url, client = cluster["prefill"].url, _client(cluster["prefill"])
    forced = metric(url, DECISIONS, reason="prompt_logprobs")
    never = metric(url, DECISIONS, reason="never")
    out = client.completions.create(model=M, prompt=IDS, echo=True, logprobs=2, max_tokens=3, temperature=0)
    prompt, gen = expected["ids"]
    c = out.choices[0]
    _assert_matches(c.logprobs, prompt, gen)
    plain = client.completions.create(model=M, prompt=IDS, max_tokens=3, temperature=0)
    assert c.text == "Once upon a time, a fox" + plain.choices[0].text
    assert c.logprobs.text_offset[len(IDS)] == len("Once upon a time, a fox")  # the first generated token's
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(IDS), 3)
    # this one was computed on the prefill (forced); the plain one on the decode (--disaggregation never)
    assert metric(url, DECISIONS, reason="prompt_logprobs") - forced == 1
    assert metric(url, DECISIONS, reason="never") - never == 1


def test_string_prompt_and_max_tokens_zero(cluster, expected):
    client = _client(cluster["prefill"])
    prompt, _ = expected["ids"]
    text = bytes(IDS[1:]).decode()
    out = client.completions.create(model=M, prompt=text, echo=True, logprobs=2, max_tokens=0, temperature=0)
    c = out.choices[0]
    assert (c.text, c.finish_reason) == (text, "length")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (len(IDS), 0)
    _assert_matches(c.logprobs, prompt)
    assert "".join(c.logprobs.tokens[1:]) == text
    # without echo, max_tokens 0 stays a 400 naming it
    status, body = post_json(cluster["prefill"].url + "/v1/completions", {"model": M, "prompt": text, "max_tokens": 0})
    assert status == 400 and body["error"]["param"] == "max_tokens", body


def test_streamed_echo_logprobs_equal_the_whole_answer(cluster, expected):
    client = _client(cluster["prefill"])
    prompt, gen = expected["ids"]
    for max_tokens, want_gen in ((3, gen), (0, ())):
        chunks = list(client.completions.create(model=M, prompt=IDS, echo=True, logprobs=2, max_tokens=max_tokens,
                                                temperature=0, stream=True))
        cols = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        text, finish = "", None
        for ch in chunks:
            c = ch.choices[0]
            text += c.text
            finish = c.finish_reason or finish
            if c.logprobs is not None:
                for key in cols:
                    cols[key] += getattr(c.logprobs, key)
        assert text.startswith("Once upon a time, a fox") and finish == "length"
        first = chunks[0].choices[0]  # the prompt (text and logprobs) goes with the first event
        assert first.text.startswith("Once upon a time, a fox") and first.logprobs.token_logprobs[0] is None
        assert len(first.logprobs.tokens) == len(IDS) + (1 if want_gen else 0)

        class Columns:
            pass

        lp = Columns()
        lp.__dict__.update(cols)
        _assert_matches(lp, prompt, want_gen)


def test_n_and_prompt_lists_each_lead_with_their_prompt(cluster, expected):
    url, client = cluster["prefill"].url, _client(cluster["prefill"])
    forced = metric(url, DECISIONS, reason="prompt_logprobs")
    out = client.completions.create(model=M, prompt=[IDS, OTHER], n=2, echo=True, logprobs=2, max_tokens=3,
                                    temperature=0)
    by = {c.index: c for c in out.choices}
    assert sorted(by) == [0, 1, 2, 3]
    for index, name in ((0, "ids"), (1, "ids"), (2, "other"), (3, "other")):
        _assert_matches(by[index].logprobs, *expected[name])
    assert out.usage.prompt_tokens == len(IDS) + len(OTHER)
    # only each prompt's first choice asked for the prompt's logprobs (its sibling shows the same ones)
    assert metric(url, DECISIONS, reason="prompt_logprobs") - forced == 2


def test_colocated_prefill_gives_the_same(cluster, expected):
    client = _client(cluster["local"])
    out = client.completions.create(model=M, prompt=IDS, echo=True, logprobs=2, max_tokens=3, temperature=0)
    _assert_matches(out.choices[0].logprobs, *expected["ids"])
    zero = client.completions.create(model=M, prompt=OTHER, echo=True, logprobs=2, max_tokens=0)
    assert zero.choices[0].finish_reason == "length"
    _assert_matches(zero.choices[0].logprobs, expected["other"][0])


def test_a_prefix_the_decode_holds_stays_there_and_the_prefill_computes_all(cluster):
    """The decode's cached prefix still saves the transfer (those blocks hold the same KV), but the
    prompt's logprobs come from the prefill's forward pass over the whole prompt: no prefix hit on
    the prefill, even when its own cache holds the prompt (the second time)."""
    import torch

    from pdserve.engine import load_model

    url, client = cluster["prefill"].url, _client(cluster["prefill"])
    ids = [256] + [(7 * i) % 250 + 1 for i in range(150)]  # 151 tokens: 2 full blocks of 64
    client.completions.create(model=M, prompt=ids, max_tokens=2, temperature=0)  # on the decode: it caches 2 blocks
    torch.set_num_threads(1)
    ref = torch.log_softmax(load_model(M).model.forward_dense(torch.tensor(ids)).float(), dim=-1)
    hits = metric(url, "pdserve_prefix_cache_hit_tokens_total")
    for _ in range(2):
        out = client.completions.create(model=M, prompt=ids, echo=True, logprobs=1, max_tokens=0)
        lp = out.choices[0].logprobs
        assert lp.token_logprobs[1:] == pytest.approx([ref[i - 1, ids[i]].item() for i in range(1, len(ids))], abs=1e-4)
        timings = get_json(f"{url}/debug/requests/{out.id.removeprefix('cmpl-')}")[1]
        assert timings["decode_cached_blocks"] == 2, timings
    assert metric(url, "pdserve_prefix_cache_hit_tokens_total") == hits


def test_lm_eval_loglikelihood_payload(cluster, expected):
    """The body lm-evaluation-harness's local-completions model posts for loglikelihood requests
    (token-id prompts, max_tokens 1, logprobs 1, echo), read as it reads it: the continuation's
    summed logprobs (``token_logprobs[ctxlen:-1]``) and whether each was the greedy token."""
    ctx, cont = IDS[:10], IDS[10:]
    body = {"model": M, "prompt": [ctx + cont, OTHER], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    status, out = post_json(cluster["prefill"].url + "/v1/completions", body)
    assert status == 200, out
    prompt, _ = expected["ids"]
    lp = out["choices"][0]["logprobs"]
    assert sum(lp["token_logprobs"][len(ctx):-1]) == pytest.approx(sum(e.logprob for e in prompt[len(ctx):]), abs=1e-3)
    greedy = all(tok == max(top.values()) for tok, top in zip(lp["token_logprobs"][len(ctx):-1],
                                                               lp["top_logprobs"][len(ctx):-1]))
    assert greedy == all(e.top[0][0] == e.token_id for e in prompt[len(ctx):])
    assert len(out["choices"][1]["logprobs"]["tokens"]) == len(OTHER) + 1
