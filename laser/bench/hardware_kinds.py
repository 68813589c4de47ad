"""The hardware kinds of the robustness grid (``benchmarks/robustness.py``, issue 16 item 3) and
the real-engine spot checks (``benchmarks/robustness_engine.py``): the CPU kinds whose measured
profile the project ships, and the analytic A100 model."""

from __future__ import annotations

from pathlib import Path


#: The CPU kinds whose measured profile the project ships (benchmarks/profiles/<kind>-smollm2-135m.json,
#: ``laser profile --threads 1 --kv-cache-gib 1``): kind -> (dtype, KV blocks of 16 tokens in 1 GiB for
#: SmolLM2-135M: 30 layers x 3 KV heads x 64 x 2 (K, V) x the dtype's bytes).
SHIPPED_CPU_KINDS = {"avx2-fp32": ("float32", 1456), "amx-bf16": ("bfloat16", 2912)}


def profile_path(kind: str, profiles_dir: Path) -> Path:
    """Where the measured profile of CPU kind ``kind`` is shipped in ``profiles_dir``
    (``benchmarks/profiles``; ``benchmarks/amx_session.sh`` makes the AMX one)."""
    return Path(profiles_dir) / f"{kind}-smollm2-135m.json"


def hardware_kinds(profiles_dir: Path) -> dict[str, dict]:
    """Kind -> {"lm": latency model or None, "why": text, "slo_base", "num_blocks", "dtype"}: the CPU
    kinds of :data:`SHIPPED_CPU_KINDS` with their profile in ``profiles_dir`` (``lm`` None and why
    when it is missing), and the A100 analytic model."""
    from laser.latency import AnalyticLatencyModel, FittedLatencyModel

    out = {}
    for kind, (dtype, blocks) in SHIPPED_CPU_KINDS.items():
        prof = profile_path(kind, profiles_dir)
        if prof.exists():
            out[kind] = {"lm": FittedLatencyModel.load(prof), "dtype": dtype, "num_blocks": blocks,
                         "why": f"measured profile {prof.name} (SmolLM2-135M, {dtype}, 1 thread)",
                         "slo_base": "measured"}
        else:
            out[kind] = {"lm": None, "why": f"missing: {prof.name} not found (no machine of this kind has "
                                            f"profiled it; benchmarks/amx_session.sh makes the AMX one)"}
    # Qwen2.5-14B on one A100-80GB: ~29.6 GB of bf16 weights leaves ~45 GiB of KV cache at
    # 192 KiB per token (48 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes): ~15,000 blocks of 16.
    out["a100-qwen2.5-14b"] = {"lm": AnalyticLatencyModel("qwen2.5-14b", "a100-80gb"),
                               "why": "analytic roofline model (an estimate), Qwen2.5-14B on A100-80GB",
                               "slo_base": "paper", "num_blocks": 15000}
    return out


def spot_check_rows(grid: dict, kind: str, kinds: dict[str, dict]) -> tuple[list, dict]:
    """The grid rows of ``kind`` in ``grid`` (the JSON ``benchmarks/robustness.py`` writes) and the
    kind's entry of ``kinds`` (:func:`hardware_kinds`), for the real-engine spot checks. Raises
    ValueError when the grid has no rows of that kind or the kind's profile is missing (saying why)."""
    rows = grid["kinds"].get(kind, {}).get("points")
    if not rows:
        raise ValueError(f"no {kind} points")
    info = kinds[kind]
    if info["lm"] is None:
        raise ValueError(f"{kind}: {info['why']}")
    return rows, info
