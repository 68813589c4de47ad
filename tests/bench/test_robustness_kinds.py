"""laser.bench.hardware_kinds (benchmarks/robustness.py and robustness_engine.py): the CPU kinds
whose measured profile the project ships. The AMX-bf16 one is picked up as soon as an AMX machine
has written it (benchmarks/amx_session.sh); until then it is reported missing, and the real-engine
spot checks refuse it with the reason."""

import shutil
from pathlib import Path

import pytest

from laser.bench.hardware_kinds import hardware_kinds, profile_path, spot_check_rows

SHIPPED = Path(__file__).resolve().parents[2] / "benchmarks" / "profiles"


def test_a_shipped_amx_profile_becomes_a_grid_kind(tmp_path):
    profiles = tmp_path / "profiles"
    profiles.mkdir()
    kinds = hardware_kinds(profiles)
    assert kinds["amx-bf16"]["lm"] is None and "amx_session.sh" in kinds["amx-bf16"]["why"]
    assert kinds["avx2-fp32"]["lm"] is None  # nothing shipped in this folder
    # any valid profile file stands in for the one an AMX machine writes
    shutil.copy(SHIPPED / "avx2-fp32-smollm2-135m.json", profile_path("amx-bf16", profiles))
    amx = hardware_kinds(profiles)["amx-bf16"]
    assert amx["lm"] is not None and amx["lm"].num_layers == 30
    assert (amx["dtype"], amx["num_blocks"], amx["slo_base"]) == ("bfloat16", 2912, "measured")
    assert hardware_kinds(profiles)["a100-qwen2.5-14b"]["lm"] is not None
    assert hardware_kinds(SHIPPED)["avx2-fp32"]["lm"] is not None  # the profile the project ships


def test_spot_checks_refuse_a_kind_without_its_profile():
    grid = {"kinds": {"amx-bf16": {"points": [{"mix": "1:1:1"}]}}}
    missing = {"amx-bf16": {"lm": None, "why": "missing: no profile"}}
    with pytest.raises(ValueError, match="amx-bf16: missing: no profile"):
        spot_check_rows(grid, "amx-bf16", missing)
    with pytest.raises(ValueError, match="no avx2-fp32 points"):
        spot_check_rows(grid, "avx2-fp32", missing)
    rows, info = spot_check_rows(grid, "amx-bf16", {"amx-bf16": {"lm": object(), "why": "measured"}})
    assert rows == [{"mix": "1:1:1"}] and info["why"] == "measured"
