import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
torch.set_num_threads(2)


@pytest.fixture(autouse=True)
def _quiet_hf(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "error")
