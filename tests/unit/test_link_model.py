"""The modelled KV link of a simulated cluster (cachestore/link_model.py) and the sim server's scaled wire shape
(pdserve/sim_server.py ``wire_compat``): slices wait bandwidth time of their real bytes in order, plus latency."""

import pytest

from pdserve.cachestore import CompatInfo
from pdserve.cachestore.link_model import LinkModel
from pdserve.sim_server import wire_compat


class Clock:
    def __init__(self):
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.now += s


def test_slices_queue_on_the_modelled_wire_at_their_real_bytes():
    c = Clock()
    link = LinkModel(1000.0, latency_s=0.5, payload_scale=10, clock=c, sleep=c.sleep)  # 1000 real bytes/s
    assert link.delivery_time(20) == pytest.approx(100.0 + 0.2 + 0.5)  # 200 real bytes
    assert link.delivery_time(30) == pytest.approx(100.0 + 0.5 + 0.5)  # queued behind the first: wire busy to 100.2
    c.now = 110.0  # the wire idle again: a slice starts now
    link.wait(100)
    assert c.slept == [pytest.approx(1.0 + 0.5)] and c.now == pytest.approx(111.5)
    assert link.modelled_bytes == 1500
    assert "8e-06 Gb/s" in link.describe() and "1/10" in link.describe()


def test_bad_link_parameters_are_refused():
    for kwargs, word in (({"bandwidth_bytes_s": 0}, "bandwidth"),
                         ({"bandwidth_bytes_s": 1, "latency_s": -1}, "latency"),
                         ({"bandwidth_bytes_s": 1, "payload_scale": 0}, "scale")):
        with pytest.raises(ValueError, match=word):
            LinkModel(**kwargs)


def test_wire_compat_carries_one_nth_of_a_block():
    real = CompatInfo(dtype="bfloat16", num_layers=32, num_kv_heads=8, head_dim=128, block_size=64)
    assert wire_compat(real, 1) is real
    scaled = wire_compat(real, 1024)
    assert real.block_nbytes // scaled.block_nbytes == 1024 and scaled.num_layers == 32
    assert scaled.compat_hash != real.compat_hash  # a scaled sim never pairs with an unscaled one
    with pytest.raises(SystemExit, match="divide"):
        wire_compat(real, 3)
