"""The simulated engine (engine/sim/): its profile format, the fit, the runner's time and tokens, and
the engine over the real scheduler (prefix cache, P/D primitives), without sleeping."""

import json

import pytest

from pdserve.engine import EngineConfig, SamplingParams
from pdserve.engine.sim.engine import SimEngine
from pdserve.engine.sim.fit import Sample, fit_step_time
from pdserve.engine.sim.profile import FORMAT, ProfileError, StepTime, load_profile, parse_profile
from pdserve.engine.tokenizer import ByteTokenizer

STEP = {"base_s": 0.002, "prefill_token_s": 1e-5, "prefill_pair_s": 1e-8, "decode_seq_s": 2e-4,
        "decode_context_token_s": 1e-7}
MODEL = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32", "vocab_size": 258,
         "context_length": 2048, "eos_token_ids": [257]}


def profile_doc(**changes):
    doc = {"format": FORMAT, "name": "test", "model": dict(MODEL), "step": dict(STEP)}
    doc.update(changes)
    return doc


def engine(sleeps=None, **config):
    slept = sleeps if sleeps is not None else []
    return SimEngine(parse_profile(profile_doc()), ByteTokenizer(), EngineConfig(block_size=16, **config),
                     sleep=slept.append)


def run_all(e):
    out = {}
    while e.has_unfinished():
        for o in e.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_step_time_is_the_documented_sum():
    step = StepTime(**STEP)
    assert step.prefill_s(100, 50) == pytest.approx(0.002 + 1e-5 * 100 + 1e-8 * 100 * (50 + 101 / 2))
    assert step.decode_s(4, 1000) == pytest.approx(0.002 + 4 * 2e-4 + 4 * 1000 * 1e-7)
    mixed = step.step_s([(100, 50)], [1000] * 4)
    assert mixed == pytest.approx(step.prefill_s(100, 50) + step.decode_s(4, 1000) - 0.002)


def test_the_shipped_profiles_load_and_give_kv_bytes_per_token():
    small, h200 = load_profile("cpu-small"), load_profile("h200-llama3-8b")
    assert small.model.kv_bytes_per_token == 2 * 8 * 4 * 32 * 4
    assert h200.model.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB: Llama-3-8B in bfloat16
    assert 0.004 < h200.step.decode_s(1, 1024) < 0.008  # the GPU check measured 5.3 ms (CUDA graphs)


@pytest.mark.parametrize("change, named", [
    ({"format": "other/1"}, '"format"'),
    ({"model": {**MODEL, "num_layers": 0}}, "model.num_layers"),
    ({"model": {**MODEL, "dtype": "int4"}}, "model.dtype"),
    ({"model": {**MODEL, "eos_token_ids": [999]}}, "model.eos_token_ids"),
    ({"step": {**STEP, "base_s": -1}}, "step.base_s"),
    ({"step": {k: v for k, v in STEP.items() if k != "decode_seq_s"}}, "step.decode_seq_s"),
])
def test_a_bad_profile_is_refused_naming_the_field(change, named):
    with pytest.raises(ProfileError, match=named.replace(".", r"\.")):
        parse_profile(profile_doc(**change), "p.json")


def test_a_missing_profile_names_the_shipped_ones(tmp_path):
    with pytest.raises(ProfileError, match="cpu-small"):
        load_profile(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    with pytest.raises(ProfileError, match="not JSON"):
        load_profile(bad)


def test_a_profile_round_trips_through_json(tmp_path):
    profile = parse_profile(profile_doc())
    path = tmp_path / "p.json"
    path.write_text(profile.to_json())
    assert load_profile(path) == profile
    assert json.loads(path.read_text())["format"] == FORMAT


def test_the_fit_recovers_the_terms_of_exact_samples():
    truth = StepTime(**STEP)
    shapes = [([(n, c)], []) for n in (16, 128, 512, 2048) for c in (0, 256, 1024)]
    shapes += [([], [ctx] * b) for b in (1, 4, 16, 64) for ctx in (64, 1024)]
    shapes += [([(64, 0)], [512] * 8)]
    samples = [Sample(p, d, truth.step_s(p, d)) for p, d in shapes]
    step, report = fit_step_time(samples)
    for name, value in STEP.items():
        assert getattr(step, name) == pytest.approx(value, rel=1e-4), name
    assert report["samples"] == len(samples) and report["max_relative_error"] < 1e-4


def test_the_fit_keeps_every_term_non_negative_and_holds_fixed_ones():
    # decode only, with a step time that falls with context: its slope would be negative, so it is 0
    samples = [Sample([], [ctx], 0.01 - ctx * 1e-7) for ctx in (100, 1000, 5000)]
    step, report = fit_step_time(samples, fixed={"prefill_pair_s": 3e-9})
    assert step.decode_context_token_s == 0 and step.prefill_pair_s == 3e-9
    assert "decode_context_token_s" in report["zeroed_or_fixed"]
    with pytest.raises(ValueError, match="not step terms"):
        fit_step_time(samples, fixed={"nonsense": 1.0})


def test_tokens_depend_on_the_context_only():
    a, b = engine(), engine(max_num_seqs=1)
    prompts = {"x": [256, *b"the same prompt"], "y": [256, *b"another"]}
    for e in (a, b):
        for rid, ids in prompts.items():
            e.add_request(rid, ids, SamplingParams(max_tokens=12, temperature=0.7, seed=3))
    got_a, got_b = run_all(a), run_all(b)
    assert got_a == got_b and len(got_a["x"]) == 12 and got_a["x"] != got_a["y"]
    assert all(t == 10 or 32 <= t < 127 for t in got_a["x"])  # printable, never EOS
    resumed = engine()  # the prompt plus 5 generated tokens, sent again: the next 7 are the same
    resumed.add_request("r", prompts["x"] + got_a["x"][:5], SamplingParams(max_tokens=7, temperature=0))
    assert run_all(resumed)["r"] == got_a["x"][5:]


def test_steps_sleep_the_modelled_time_layer_by_layer():
    slept = []
    e = engine(slept)
    layers = []
    first = e.pd.prefill_only("p", [256] + [65] * 39, SamplingParams(max_tokens=4, temperature=0),
                              on_layer=lambda layer, blocks, start: layers.append((layer, blocks, start)))
    assert isinstance(first, int)
    assert len(slept) == 4 and sum(slept) == pytest.approx(StepTime(**STEP).prefill_s(40, 0))
    held = e.pd.prefill_block_ids("p")
    assert layers == [(layer, held, 0) for layer in range(4)]  # every block of every layer once
    e.pd.release("p")
    assert e.num_free_blocks() == e.num_blocks and e.num_requests() == 0


def test_a_prefix_hit_is_modelled_as_cached_tokens():
    slept = []
    e = engine(slept)
    ids = [256] + [66] * 63
    for rid in ("a", "b"):
        e.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0))
        run_all(e)
    step = StepTime(**STEP)
    assert sum(slept[:1]) == pytest.approx(step.prefill_s(64, 0))
    assert slept[1] == pytest.approx(step.prefill_s(16, 48))  # 3 of 4 blocks from the prefix cache
    assert e.prefix_hit_tokens() == 48


def test_a_grammar_and_kv_tiers_are_refused_naming_the_sim():
    from pdserve.engine.grammar import GrammarSpec

    with pytest.raises(ValueError, match="--engine sim does not do constrained output"):
        engine().add_request("g", [256, 65], SamplingParams(grammar=GrammarSpec("json_object")))
    with pytest.raises(ValueError, match="no KV tiers"):
        engine(kv_host_tier_bytes=1 << 20)


def test_the_sim_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys; import pdserve.engine.sim.engine, pdserve.engine.async_engine, pdserve.sim_server; "
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "[]\n"
