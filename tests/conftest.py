import json
from pathlib import Path

import numpy as np
import pytest
import torch

GOLDEN_DIR = Path(__file__).parent / "golden"
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def golden_cases():
    """Every golden case except RHT ones (the random Hadamard transform is not implemented yet)."""
    return [c for c in json.loads((GOLDEN_DIR / "index.json").read_text()) if not c["rht"]]


def load_golden(case):
    z = np.load(GOLDEN_DIR / f"{case['name']}.npz")
    x = torch.from_numpy(z["x_f32"]).to(DTYPES[case["dtype"]])
    return x, z


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
