"""pdserve/model_fetch_progress.py: progress measured from what is on disk, the completion marker and the wait
for it, and a reporter that cannot reach the API server letting the download go on."""

from __future__ import annotations

import json

from pdserve import model_fetch_progress as mfp


def test_measure_counts_finished_files_of_the_right_size_and_partial_downloads(tmp_path):
    planned = {"config.json": 10, "model-00001.safetensors": 1000, "model-00002.safetensors": 1000}
    assert mfp.measure(tmp_path, planned) == {"bytesDone": 0, "bytesTotal": 2010, "filesDone": 0, "filesTotal": 3}
    (tmp_path / "config.json").write_bytes(b"x" * 10)
    (tmp_path / "model-00001.safetensors").write_bytes(b"x" * 400)  # not its size yet: not done
    partial = tmp_path / ".cache" / "huggingface" / "download"
    partial.mkdir(parents=True)
    (partial / "abc.etag.incomplete").write_bytes(b"x" * 300)
    (tmp_path / "README.md").write_bytes(b"x" * 5000)  # not planned: not counted
    assert mfp.measure(tmp_path, planned) == {"bytesDone": 310, "bytesTotal": 2010, "filesDone": 1, "filesTotal": 3}
    (partial / "abc.etag.incomplete").unlink()
    for name in ("model-00001.safetensors", "model-00002.safetensors"):
        (tmp_path / name).write_bytes(b"x" * 1000)
    assert mfp.measure(tmp_path, planned) == {"bytesDone": 2010, "bytesTotal": 2010, "filesDone": 3, "filesTotal": 3}


def test_the_wait_ends_at_the_marker_and_says_what_it_waits_for(tmp_path, capsys):
    ticks = iter(range(0, 1000, 10))
    polls = []

    def sleep(_s):  # the Job writes the marker while the pod waits (third poll)
        polls.append(1)
        if len(polls) == 3:
            mfp.write_marker(tmp_path, "c0ffee", {"bytesDone": 1, "bytesTotal": 1, "filesDone": 1, "filesTotal": 1})

    assert mfp.wait_for_marker(tmp_path, "the download Job of hf://a/b", clock=lambda: next(ticks),
                               sleep=sleep) == tmp_path
    assert len(polls) == 3
    assert json.loads((tmp_path / mfp.MARKER).read_text())["commit"] == "c0ffee"
    assert not (tmp_path / f"{mfp.MARKER}.tmp").exists()
    assert "waiting for the download Job of hf://a/b" in capsys.readouterr().err


def test_a_reporter_without_an_api_server_says_so_once_and_never_raises(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "missing-kubeconfig"))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    reporter = mfp.JobReporter("chat-model-x", "ns1")
    reporter.report({"phase": "Downloading", "bytesDone": 1})
    reporter.failed("TokenRefused", "token refused (401)")
    err = capsys.readouterr().err
    assert err.count("cannot write progress to Job ns1/chat-model-x") == 1 and "downloading on" in err
