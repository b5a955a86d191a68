import pytest
import torch


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                            reason="no CUDA device"))])
def device(request):
    """Where an optimized path is checked against eager: the CPU always, and a GPU where there is one (on CUDA the
    optimized path is compile + CUDA graphs, the one a GPU run takes)."""
    return torch.device(request.param)
