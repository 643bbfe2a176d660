"""pdserve.tokenizer_files: what a prefill sends a router that mounts no model (GET /tokenizer), and what the
router accepts (the real processes: tests/e2e/test_router_tokenizer_from_prefill.py)."""

import json

import pytest

from pdserve import model_fetch, tokenizer_files


def model_dir(tmp_path):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"vocab_size": 64}))
    (folder / "tokenizer.json").write_text('{"model": {}}')
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"\0" * 128)  # weights: never sent
    (folder / "README.md").write_text("# not a tokenizer file\n")
    return folder


def test_the_files_are_fetch_models_tokenizer_only_set():
    assert list(tokenizer_files.FILES) == model_fetch.CONFIG_FILES + model_fetch.TOKENIZER_FILES
    assert not any("*" in name or "/" in name for name in tokenizer_files.FILES)


def test_a_directory_model_round_trips_its_config_and_tokenizer_files_only(tmp_path):
    folder = model_dir(tmp_path)
    doc = tokenizer_files.pack(str(folder))
    assert doc["version"] == tokenizer_files.VERSION and doc["model"] == str(folder)
    assert sorted(doc["files"]) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    dest = tmp_path / "dest"
    dest.mkdir()
    assert tokenizer_files.unpack(json.loads(json.dumps(doc)), dest) == sorted(doc["files"])
    for name in doc["files"]:
        assert (dest / name).read_bytes() == (folder / name).read_bytes()


def test_a_built_in_model_sends_no_files(tmp_path):
    doc = tokenizer_files.pack("tiny")
    assert doc["files"] == {}
    assert tokenizer_files.unpack(doc, tmp_path) == [] and not list(tmp_path.iterdir())


def test_too_many_bytes_are_refused_on_both_ends(tmp_path, monkeypatch):
    folder = model_dir(tmp_path)
    doc = tokenizer_files.pack(str(folder))
    monkeypatch.setattr(tokenizer_files, "MAX_BYTES", 20)
    with pytest.raises(tokenizer_files.TokenizerFilesError, match="exceed .* MiB: start the router with --model"):
        tokenizer_files.pack(str(folder))
    with pytest.raises(tokenizer_files.TokenizerFilesError, match="exceed"):
        tokenizer_files.unpack(doc, tmp_path)


@pytest.mark.parametrize("doc, message", [
    ({"version": 1, "files": {"../evil.json": ""}}, "outside"),
    ({"version": 1, "files": {"model.safetensors": ""}}, "outside"),
    ({"version": 2, "files": {}}, "format version 2, this router reads 1"),
    ({"version": 1, "files": {"config.json": "not base64!"}}, "not base64"),
    ({"version": 1, "files": ["config.json"]}, "the answer is not"),
    ([], "the answer is not"),
])
def test_an_answer_that_is_not_ours_writes_nothing(tmp_path, doc, message):
    with pytest.raises(tokenizer_files.TokenizerFilesError, match=message):
        tokenizer_files.unpack(doc, tmp_path)
    assert not list(tmp_path.iterdir())

