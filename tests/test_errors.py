import math

import pytest

from eaglespec.engine import Engine, Request
from eaglespec.kv_cache import ContextLengthError
from eaglespec.sampling import SamplingParams
from helpers import random_drafter, tiny_target


@pytest.fixture(scope="module")
def eng(tmp_path_factory):
    target, _, _ = tiny_target(tmp_path_factory.mktemp("t"), "llama", max_pos=64)
    return Engine(target, random_drafter(target), mode="tree", adaptive=False)


@pytest.mark.parametrize(
    "req,bs,msg",
    [
        (Request([], 4), 1, "prompt is empty"),
        (Request(list(range(64)), 4), 1, "shorten it"),
        (Request([1, 96], 4), 1, "must be in [0, 96)"),
        (Request([-1, 3], 4), 1, "must be in [0, 96)"),
        (Request([1, 2], 0), 1, "max_new_tokens"),
        (Request([1, 2], -3), 1, "max_new_tokens"),
        (Request([1, 2], 4), 0, "batch_size"),
        (Request([1, 2], 4), -1, "batch_size"),
    ],
)
def test_bad_requests(eng, req, bs, msg):
    with pytest.raises(ValueError) as e:
        eng.generate([req], batch_size=bs)
    assert msg in str(e.value)


def test_prompt_too_long_is_context_error(eng):
    with pytest.raises(ContextLengthError, match="64"):
        eng.generate([Request([1] * 100, 2)])


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.5}, "top_k"),
    ],
)
def test_bad_sampling_params(kw, msg):
    with pytest.raises(ValueError, match=msg):
        SamplingParams(**kw)


def test_valid_requests_still_work(eng):
    out = eng.generate([Request([1, 2, 3], 3)], SamplingParams(temperature=1.0, top_p=0.9, top_k=5, seed=1))
    assert len(out.results[0].output_ids) == 3


def test_bad_mode():
    with pytest.raises(ValueError, match="mode"):
        Engine(None, None, mode="beam")
