"""FileDiscovery: the address file `pdserve up --autoscale` rewrites as it starts and drains servers."""

import argparse
import os

import pytest

from pdserve.discovery import FileDiscovery
from pdserve.prefill_server.cli import add_arguments as prefill_arguments
from pdserve.prefill_server.cli import make_discovery as prefill_discovery
from pdserve.router.cli import add_arguments as router_arguments
from pdserve.router.cli import make_discovery as router_discovery


def write(path, text):
    """As pdserve up does it: a temporary file renamed over the old one."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def test_it_follows_the_file_and_skips_bad_lines(tmp_path, caplog):
    path = tmp_path / "decodes.txt"
    write(path, "127.0.0.1:2\n# a comment\n\n127.0.0.1:1  # decode-0\n")
    d = FileDiscovery(path)
    assert d.addresses() == ["127.0.0.1:1", "127.0.0.1:2"]
    write(path, "127.0.0.1:1\nnot-an-address\n127.0.0.1:3\n")
    assert d.addresses() == ["127.0.0.1:1", "127.0.0.1:3"]
    assert "line 2 skipped" in caplog.text and "not-an-address" in caplog.text
    write(path, "")
    assert d.addresses() == []


def test_a_file_gone_later_keeps_the_last_list_but_a_missing_one_at_start_is_an_error(tmp_path):
    path = tmp_path / "decodes.txt"
    with pytest.raises(ValueError, match="does not exist"):
        FileDiscovery(path)
    write(path, "127.0.0.1:1\n")
    d = FileDiscovery(path)
    path.unlink()
    assert d.addresses() == ["127.0.0.1:1"]
    write(path, "127.0.0.1:5\n")
    assert d.addresses() == ["127.0.0.1:5"]


@pytest.mark.parametrize("add, make, flag", [(prefill_arguments, prefill_discovery, "--decode-file"),
                                              (router_arguments, router_discovery, "--prefill-file")])
def test_the_prefill_and_the_router_take_a_file(tmp_path, add, make, flag):
    parser = argparse.ArgumentParser()
    add(parser)
    with pytest.raises(ValueError, match=flag):
        make(parser.parse_args(["--discovery", "file"]))
    path = tmp_path / "a.txt"
    write(path, "127.0.0.1:9\n")
    assert make(parser.parse_args(["--discovery", "file", flag, str(path)])).addresses() == ["127.0.0.1:9"]
