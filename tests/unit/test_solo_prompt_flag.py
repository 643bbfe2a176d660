"""--solo-prompt-tokens (EngineConfig.solo_prompt_tokens): chosen once by the device unless given, refused when
negative, naming the field."""

import argparse

import pytest

from pdserve import defaults
from pdserve.engine import EngineConfig
from pdserve.server_setup import add_engine_arguments, solo_prompt_tokens


def _args(*argv):
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_device_chooses_it_once_unless_given():
    assert solo_prompt_tokens(_args()) == defaults.SOLO_PROMPT_TOKENS_CPU > 0  # --device cpu
    assert solo_prompt_tokens(_args("--device", "cuda")) == 0  # a second prompt in a step costs a GPU little
    assert solo_prompt_tokens(_args("--solo-prompt-tokens", "0")) == 0
    assert solo_prompt_tokens(_args("--device", "cuda:1", "--solo-prompt-tokens", "64")) == 64


def test_a_negative_bound_is_refused():
    with pytest.raises(ValueError, match="solo_prompt_tokens must be >= 0"):
        EngineConfig(solo_prompt_tokens=-1)
