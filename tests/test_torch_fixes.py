"""leanrl.torch_fixes: each workaround does what torch would without it, until the torch version that makes it
removable."""

import torch

from leanrl import torch_fixes


def test_vec_isa_check_runs_once_per_inductor_cache(tmp_path, monkeypatch):
    """The first compiled run in a cache checks the CPU's vector ISAs as inductor would, and records the answer;
    later runs trust it without the check, and check again when the record no longer matches the CPU's claim."""
    from torch._inductor import config, cpu_vec_isa
    real = cpu_vec_isa.valid_vec_isa_list
    checks = []

    def valid_vec_isa_list():  # inductor's check, counted
        checks.append(1)
        return real()

    valid_vec_isa_list.__wrapped__ = real.__wrapped__
    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", valid_vec_isa_list)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    passed = [str(isa) for isa in real()]
    with config.patch({"cpp.vec_isa_ok": True}):
        claimed = [str(isa) for isa in real.__wrapped__()]
    record = tmp_path / f"leanrl-vec-isa-ok-{torch.__version__}"
    for expect_check in (True, False, "tampered"):
        if expect_check == "tampered":
            record.write_text("not-an-isa")  # not "avx2": an AVX2-only CPU's real record (it failed on one)
        # config.patch, not monkeypatch: on torch 2.11 monkeypatch's undo deletes the entry, failing later compiles
        with config.patch({"cpp.vec_isa_ok": None}):
            checks.clear()
            torch_fixes.trust_vec_isa_probed_before.__wrapped__()
            assert bool(checks) == (expect_check is not False)
            assert config.cpp.vec_isa_ok is (True if passed == claimed else None)
        assert record.exists() == (passed == claimed)
    with config.patch({"cpp.vec_isa_ok": False}):  # TORCHINDUCTOR_VEC_ISA_OK=0: the user decides
        torch_fixes.trust_vec_isa_probed_before.__wrapped__()
        assert config.cpp.vec_isa_ok is False


def test_a_process_started_after_building_twin_critics_can_stack_tensordicts():
    """tensordict's from_modules (TD3's and SAC's twin critics) left LAZY_LEGACY_OP="None" in the environment, and
    every process started afterwards failed its first TensorDict stack."""
    import subprocess
    import sys

    from tensordict import from_modules

    from_modules(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    code = "import torch, tensordict as td; torch.stack([td.TensorDict(a=torch.ones(2)), td.TensorDict(a=torch.ones(2))])"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
