"""The KV tier flags of both servers: byte sizes with units, clear errors for bad ones."""

import argparse

import pytest

from pdserve.server_setup import add_engine_arguments, byte_size


def test_byte_sizes_with_units():
    assert byte_size("4096") == 4096
    assert byte_size("512MiB") == 512 << 20
    assert byte_size("2G") == 2 * 10**9
    assert byte_size("1.5gb") == 1_500_000_000
    for bad in ("lots", "12XB", "-1MiB"):
        with pytest.raises(argparse.ArgumentTypeError, match="byte size"):
            byte_size(bad)


def test_server_flags_default_off_and_parse():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args([])
    assert (args.kv_host_tier_bytes, args.kv_disk_tier_dir, args.kv_disk_tier_bytes) == (0, None, 0)
    args = parser.parse_args(["--kv-host-tier-bytes", "1GiB", "--kv-disk-tier-dir", "/tmp/x",
                              "--kv-disk-tier-bytes", "8G"])
    assert (args.kv_host_tier_bytes, args.kv_disk_tier_dir, args.kv_disk_tier_bytes) == (1 << 30, "/tmp/x", 8 * 10**9)
