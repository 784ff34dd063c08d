import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))  # 2 cores on CI


@pytest.fixture(autouse=True)
def _quiet_hf(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
