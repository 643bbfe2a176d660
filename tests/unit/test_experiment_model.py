"""An experiment's ``--model`` (bench/experiments/launcher.experiment_model): tiny, a bench size, ``peer`` (the
peer experiment's 122M checkpoint, the one file for any length up to 4096) or a checkpoint directory; anything
else is refused with its name, and the slo and trace-routing experiments say so before starting a server."""

import argparse

import pytest

from pdserve.bench.experiments import launcher, slo, trace_routing
from pdserve.bench.experiments.launcher import experiment_model


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setattr(launcher, "MODEL_CACHE", tmp_path / "bench-models")
    return tmp_path / "bench-models"


def test_names_resolve_to_the_checkpoint_written_once(cache, tmp_path):
    (cache / "bench-model-small").mkdir(parents=True)
    (cache / "bench-model-small" / "config.json").write_text("{}")
    (cache / "peer-model-peer-4096").mkdir()
    (cache / "peer-model-peer-4096" / "tokenizer_config.json").write_text("{}")  # peer_model's "written" mark
    own = tmp_path / "own"
    own.mkdir()
    (own / "config.json").write_text("{}")
    assert experiment_model("tiny") == "tiny"
    assert experiment_model("small") == str(cache / "bench-model-small")
    assert experiment_model("peer", 2144) == experiment_model("peer") == str(cache / "peer-model-peer-4096")
    assert experiment_model(str(own)) == str(own)
    assert "peer" in launcher.MODEL_HELP and "checkpoint directory" in launcher.MODEL_HELP


@pytest.mark.parametrize("name", ["huge", "no-such-dir/"])
def test_anything_else_is_refused_by_name(cache, tmp_path, name):
    with pytest.raises(ValueError, match=f"--model '{name}': neither tiny, small, medium, wire, peer"):
        experiment_model(name)
    with pytest.raises(ValueError, match="no config.json"):
        experiment_model(str(tmp_path))  # a directory, but not a checkpoint


@pytest.mark.parametrize("module,prefix", [(slo, "slo"), (trace_routing, "trace-routing")])
def test_the_experiments_refuse_a_bad_model_before_starting_anything(cache, tmp_path, module, prefix):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    assert parser.parse_args(["--model", "peer"]).model == "peer"
    args = parser.parse_args(["--model", "huge", "--out", str(tmp_path / "out")])
    with pytest.raises(SystemExit, match=f"{prefix}: --model 'huge'"):
        module.run(args)
    assert not cache.exists()  # nothing written
