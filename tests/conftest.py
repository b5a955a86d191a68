import importlib
import os

import pytest
import torch

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture
def import_benchmark(monkeypatch):
    """`import_benchmark(name)`: benchmarks/<name>.py as a module, its folder first on the path as when it runs as a
    script (it imports its sibling modules)."""
    def load(name: str):
        monkeypatch.syspath_prepend(BENCHMARKS)
        return importlib.import_module(name)
    return load


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                            reason="no CUDA device"))])
def device(request):
    """Where an optimized path is checked against eager: the CPU always, and a GPU where there is one (on CUDA the
    optimized path is compile + CUDA graphs, the one a GPU run takes)."""
    return torch.device(request.param)
