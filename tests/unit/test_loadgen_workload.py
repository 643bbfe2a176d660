"""pdserve.bench.loadgen_workload and loadgen_report: lengths, prompts, arrivals, percentiles, goodput."""

import json
import random
import statistics

import pytest

from pdserve.bench.loadgen_report import RequestResult, format_summary, percentile, plot, summarize
from pdserve.bench.loadgen_workload import (LengthDistribution, RequestSpec, arrival_times, build_requests,
                                            jsonl_lengths,
                                      make_prompt, sharegpt_requests, synthetic_lengths)


def test_synthetic_lengths_are_long_tailed_and_clipped():
    rng = random.Random(1)
    d = LengthDistribution(median=200, sigma=1.0, minimum=4, maximum=4000)
    xs = [d.sample(rng) for _ in range(5000)]
    assert min(xs) >= 4 and max(xs) <= 4000
    assert 170 < statistics.median(xs) < 230
    assert statistics.mean(xs) > 1.3 * statistics.median(xs)  # long right tail
    assert percentile(xs, 99) > 5 * statistics.median(xs)
    pairs = synthetic_lengths(10, d, LengthDistribution(16, 0.5, 1, 64), random.Random(2))
    assert len(pairs) == 10 and all(1 <= o <= 64 for _, o in pairs)


def test_bad_distributions_are_refused():
    with pytest.raises(ValueError, match="median"):
        LengthDistribution(median=10, sigma=1, minimum=20, maximum=30)
    with pytest.raises(ValueError, match="sigma"):
        LengthDistribution(median=10, sigma=-1, minimum=1, maximum=30)
    with pytest.raises(ValueError, match="output_tokens"):
        RequestSpec(prompt_tokens=3, output_tokens=0)


def test_prompts_have_the_length_and_unique_prefixes():
    rng = random.Random(0)
    specs = build_requests([(50, 4), (50, 4)], rng)
    assert len(specs[0].prompt.split()) == 50
    assert specs[0].prompt.split()[0] != specs[1].prompt.split()[0]
    ids = build_requests([(30, 2)], rng, vocab_size=100)[0].prompt_ids
    assert len(ids) == 30 and all(1 <= t < 100 for t in ids)
    assert len(make_prompt(1, rng, 7).split()) == 1


def test_arrivals_poisson_fixed_and_burst():
    rng = random.Random(3)
    xs = arrival_times(4000, 10.0, "poisson", rng)
    gaps = [b - a for a, b in zip(xs, xs[1:])]
    assert xs[0] == 0.0 and all(g >= 0 for g in gaps)
    assert 0.09 < statistics.mean(gaps) < 0.11
    assert statistics.pstdev(gaps) > 0.08  # exponential: stdev ~ mean
    fixed = arrival_times(5, 4.0, "fixed", rng)
    assert fixed == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])
    assert arrival_times(3, float("inf"), "poisson", rng) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="rate"):
        arrival_times(3, 0, "fixed", rng)
    with pytest.raises(ValueError, match="arrival process"):
        arrival_times(3, 1, "gamma", rng)


def test_jsonl_lengths_and_errors(tmp_path):
    p = tmp_path / "l.jsonl"
    p.write_text('{"prompt_tokens": 10, "output_tokens": 3}\n\n{"prompt_tokens": 7, "output_tokens": 1}\n')
    assert jsonl_lengths(p) == [(10, 3), (7, 1)]
    p.write_text('{"prompt_tokens": 10, "output_tokens": 3}\n{"prompt": 1}\n')
    with pytest.raises(ValueError, match=r"l.jsonl:2"):
        jsonl_lengths(p)
    p.write_text('{"prompt_tokens": -1, "output_tokens": 3}\n')
    with pytest.raises(ValueError, match=">= 1"):
        jsonl_lengths(p)


def test_sharegpt_reads_first_human_turn(tmp_path):
    p = tmp_path / "sg.json"
    p.write_text(json.dumps([
        {"conversations": [{"from": "human", "value": "x" * 400}, {"from": "gpt", "value": "y" * 80}]},
        {"conversations": [{"from": "gpt", "value": "hello"}]},
        {"conversations": [{"from": "human", "value": "z" * 100000}, {"from": "gpt", "value": "w"}]},
    ]))
    reqs = sharegpt_requests(p, max_prompt_tokens=1000, max_output_tokens=10)
    assert len(reqs) == 1
    assert reqs[0].prompt_tokens == 100 and reqs[0].output_tokens == 10 and reqs[0].prompt == "x" * 400
    p.write_text("{}")
    with pytest.raises(ValueError, match="list"):
        sharegpt_requests(p, 10, 10)


def _result(i, ok=True, ttft=0.1, gaps=(0.01, 0.02), sent=0.0):
    r = RequestResult(i, 10, len(gaps) + 1, sent_at=sent, ok=ok, ttft=ttft if ok else None,
                      e2e=(ttft + sum(gaps)) if ok else None, gaps=list(gaps) if ok else [],
                      chunks=len(gaps) + 1 if ok else 0, error="" if ok else "HTTP 503: no decode")
    return r


def test_summary_percentiles_and_goodput(tmp_path):
    results = [_result(0, ttft=0.1), _result(1, ttft=0.3), _result(2, ttft=0.2, gaps=(0.2, 0.2)),
               _result(3, ok=False)]
    s = summarize(results, duration=2.0, slo_ttft=0.25, slo_tbt=0.05)
    assert s["succeeded"] == 3 and s["failed"] == 1
    assert s["errors"] == {"HTTP 503": 1}
    assert s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert s["ttft_s"]["p99"] == pytest.approx(0.298)
    assert s["tbt_s"]["count"] == 6
    # only request 0 meets both SLOs: 1 request / 2 s
    assert s["goodput"] == pytest.approx(0.5)
    assert s["slo_attained"] == pytest.approx(0.25)
    assert s["output_tokens"] == 9 and s["output_token_throughput"] == pytest.approx(4.5)
    assert "TTFT" in format_summary(s)
    with pytest.raises(ValueError):
        summarize(results, duration=0)
    png = plot(results, tmp_path / "p.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_percentile_matches_linear_interpolation():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile(list(range(101)), 90) == pytest.approx(90)


def test_random_requests_have_exact_lengths_from_the_tokenizer_without_special_tokens(tmp_path):
    from pdserve.bench.experiments.peer_model import write_tokenizer
    from pdserve.bench.loadgen_workload import random_requests, tokenizer_prompt_ids

    write_tokenizer(tmp_path, 40, 128)  # ids 0..37 words, 38 <unk> and 39 EOS special
    pool = tokenizer_prompt_ids(tmp_path)
    assert pool == list(range(38)) and tokenizer_prompt_ids(tmp_path / "tokenizer.json") == pool
    specs = random_requests(5, 300, 7, random.Random(0), pool)
    assert [(s.prompt_tokens, s.output_tokens, len(s.prompt_ids)) for s in specs] == [(300, 7, 300)] * 5
    seen = {t for s in specs for t in s.prompt_ids}
    assert seen == set(range(38))  # 1500 draws over 38 ids reach every one, and never a special token
    assert specs[0].prompt_ids != specs[1].prompt_ids
    assert random_requests(2, 10, 1, random.Random(4), pool) == random_requests(2, 10, 1, random.Random(4), pool)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        tokenizer_prompt_ids(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="no token ids"):
        random_requests(1, 3, 1, random.Random(0), [])


def test_tpot_per_request_and_in_the_summary():
    a = _result(0, ttft=0.1, gaps=(0.02, 0.04))        # 3 tokens: (0.16 - 0.1) / 2
    b = _result(1, ttft=0.2, gaps=())                   # 1 token: no TPOT
    c = _result(2, ttft=0.1, gaps=(0.01,) * 5)          # 6 tokens, but the server counted 11 (clumped events)
    c.usage_completion_tokens = 11
    assert a.tpot == pytest.approx(0.03) and b.tpot is None and c.tpot == pytest.approx(0.005)
    s = summarize([a, b, c, _result(3, ok=False)], duration=1.0)
    assert s["tpot_s"]["count"] == 2 and s["tpot_s"]["mean"] == pytest.approx(0.0175)
    text = format_summary(s)
    assert "TPOT" in text and "ITL" in text


def test_payload_asks_for_exact_lengths():
    from pdserve.bench.loadgen import LoadConfig

    body = LoadConfig(url="http://x").payload(RequestSpec(3, 9, prompt_ids=(1, 2, 3)))
    assert body["ignore_eos"] is True and body["min_tokens"] == 9 and body["max_tokens"] == 9
    assert "min_tokens" not in LoadConfig(url="http://x", ignore_eos=False).payload(RequestSpec(3, 9, prompt="a"))
