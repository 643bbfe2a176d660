"""The LSO test hook ``PDSERVE_TEST_DECODE_STEP_FLOOR_S`` (decode_server/lso.py): with it set, every
step with a running batch lasts at least the floor and the controller measures the padded step;
unset, the controller measures the step as it was."""

import time
from types import SimpleNamespace

from pdserve.decode_server import lso
from pdserve.test_hooks import DECODE_STEP_FLOOR_ENV

FLOOR_S = 0.004


def _engine():
    return SimpleNamespace(running=[], swapper=SimpleNamespace(swapped_ids=lambda: []))


def test_a_step_shorter_than_the_floor_lasts_the_floor():
    controller = lso.LsoController(step_floor_s=FLOOR_S)
    began = time.monotonic()
    controller(_engine(), 0.0001, 1)
    assert time.monotonic() - began >= FLOOR_S - 0.0001  # waited out the rest of the floor
    assert controller.step_s == FLOOR_S
    controller(_engine(), 0.010, 1)  # a longer step is measured as it was
    assert controller.step_s == (1 - controller.alpha) * FLOOR_S + controller.alpha * 0.010


def test_unset_the_step_is_measured_as_it_was(monkeypatch):
    monkeypatch.delenv(DECODE_STEP_FLOOR_ENV, raising=False)
    controller = lso.LsoController()
    assert controller.step_floor_s == 0.0
    controller(_engine(), 0.0001, 1)
    assert controller.step_s == 0.0001


def test_the_floor_comes_from_the_environment_when_the_controller_is_built(monkeypatch):
    monkeypatch.setenv(DECODE_STEP_FLOOR_ENV, "0.25")
    assert lso.LsoController().step_floor_s == 0.25  # read at construction (pdserve/test_hooks.py), not import
