import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))  # 2 cores on CI


@pytest.fixture(autouse=True, scope="session")
def _private_cache(tmp_path_factory):
    """Calibration and precision caches of the test run stay out of the user's ~/.cache."""
    old = os.environ.get("EAGLESPEC_CACHE_DIR")
    os.environ["EAGLESPEC_CACHE_DIR"] = str(tmp_path_factory.mktemp("eaglespec-cache"))
    yield
    if old is None:
        os.environ.pop("EAGLESPEC_CACHE_DIR", None)
    else:
        os.environ["EAGLESPEC_CACHE_DIR"] = old


@pytest.fixture(autouse=True)
def _quiet_hf(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
