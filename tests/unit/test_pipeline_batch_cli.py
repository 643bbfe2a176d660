"""`pdserve batch`: OpenAI batch lines in, one output line each (bad lines get per-line errors)."""

import argparse
import json

import pytest

from pdserve.batch.pipeline import cli
from pdserve.engine.tokenizer import ByteTokenizer


def _line(cid, body, url="/v1/completions"):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": body})


def test_parse_line_errors_name_the_problem():
    tok = ByteTokenizer()
    cid, url, ids, sp = cli.parse_line(_line("a", {"prompt": "hi", "max_tokens": 3, "temperature": 0}), 1, tok, "tiny")
    assert (cid, url, sp.max_tokens, sp.greedy) == ("a", "/v1/completions", 3, True) and ids
    for line, message in [
        ("{", "line 7: not valid JSON"),
        ("[1]", "line 7: expected a JSON object"),
        (_line("", {"prompt": "x"}), "custom_id must be a non-empty string"),
        (_line("a", {"prompt": "x"}, url="/v1/embeddings"), "url must be one of"),
        (_line("a", {"prompt": ""}), "body.prompt must be a non-empty string"),
        (_line("a", {"messages": []}, url="/v1/chat/completions"), "body.messages must be a non-empty list"),
        (_line("a", {"prompt": "x", "temperature": -1}), "line 7: temperature must be >= 0, got -1"),
    ]:
        with pytest.raises(ValueError, match=message):
            cli.parse_line(line, 7, tok, "tiny")


def test_batch_file_one_process(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([
        _line("a", {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "ignore_eos": True}),
        "not json",
        _line("b", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
                    "ignore_eos": True}, url="/v1/chat/completions"),
    ]) + "\n")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([str(src), "--output", str(dst), "--pipeline-stages", "1", "--num-blocks", "16"])
    assert cli.run(args) == 0
    rows = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["custom_id"] for r in rows] == ["a", None, "b"]
    assert rows[0]["response"]["body"]["usage"]["completion_tokens"] == 4
    assert rows[0]["response"]["body"]["object"] == "text_completion"
    assert rows[1]["response"] is None and "not valid JSON" in rows[1]["error"]["message"]
    assert rows[2]["response"]["body"]["choices"][0]["message"]["role"] == "assistant"
    assert rows[2]["response"]["body"]["usage"]["completion_tokens"] == 3


def test_bad_stage_count(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args([str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "o"), "--pipeline-stages", "0"])
    assert cli.run(args) == 2 and "--pipeline-stages must be >= 1" in capsys.readouterr().err
