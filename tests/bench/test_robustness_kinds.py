"""benchmarks/robustness.py and robustness_engine.py: the CPU kinds whose measured profile the
project ships. The AMX-bf16 one is picked up as soon as an AMX machine has written it
(benchmarks/amx_session.sh); until then it is reported missing, and the real-engine spot checks
refuse it with the reason."""

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # robustness_engine imports robustness
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_shipped_amx_profile_becomes_a_grid_kind(tmp_path, monkeypatch):
    rob = _load("robustness")
    monkeypatch.setattr(rob, "HERE", tmp_path)
    (tmp_path / "profiles").mkdir()
    kinds = rob.hardware_kinds()
    assert kinds["amx-bf16"]["lm"] is None and "amx_session.sh" in kinds["amx-bf16"]["why"]
    assert kinds["avx2-fp32"]["lm"] is None  # nothing shipped in this folder
    # any valid profile file stands in for the one an AMX machine writes
    shutil.copy(BENCH / "profiles" / "avx2-fp32-smollm2-135m.json", rob.profile_path("amx-bf16"))
    amx = rob.hardware_kinds()["amx-bf16"]
    assert amx["lm"] is not None and amx["lm"].num_layers == 30
    assert (amx["dtype"], amx["num_blocks"], amx["slo_base"]) == ("bfloat16", 2912, "measured")
    assert rob.hardware_kinds()["a100-qwen2.5-14b"]["lm"] is not None


def test_spot_checks_refuse_a_kind_without_its_profile(tmp_path, monkeypatch):
    eng = _load("robustness_engine")
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"kinds": {"amx-bf16": {"points": [{"mix": "1:1:1"}]}}}))
    monkeypatch.setattr(eng, "hardware_kinds", lambda: {"amx-bf16": {"lm": None, "why": "missing: no profile"}})
    with pytest.raises(SystemExit, match="amx-bf16: missing: no profile"):
        eng.main([str(grid), "--kind", "amx-bf16"])
    with pytest.raises(SystemExit, match="no avx2-fp32 points"):
        eng.main([str(grid)])
