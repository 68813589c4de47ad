"""The profile's whole prefill and mixed steps (issue 26 item 3, profiler 11): the default grid replays steps
at full depth holding prefill chunks -- whole prompts, chunks over cached context, several prompts, chunks
beside decode rows -- whose compute becomes ``PrefillStepSample`` s (``laser.profiler.pipeline``)."""

from types import SimpleNamespace

from laser.latency import DecodeStepSample, PrefillStepSample, StepOverheadSample
from laser.profiler.grid import ProfileGrid
from laser.profiler.pipeline import samples_from_cases
from laser.profiler.timing import Bench, Case


def test_default_grid_replays_prefill_and_mixed_steps_at_full_depth():
    grid = ProfileGrid.default(max_tokens=2048, max_context=4096, max_batch=64)
    full = [s for s in grid.step_shapes if all(a == 0.0 and b == 1.0 for _, _, a, b in s)]
    pf = [s for s in full if any(q > 1 for q, _, _, _ in s)]
    assert len(pf) >= 12
    whole = {s[0][0] for s in pf if len(s) == 1 and s[0][0] == s[0][1]}
    assert {48, 256, 512, 1024} <= whole  # whole prompts (the flash kernel on AMX)
    assert any(len(s) == 1 and s[0][0] < s[0][1] for s in pf)  # a chunk over cached context
    assert any(len(s) >= 2 and all(q > 1 for q, _, _, _ in s) for s in pf)  # several prompts in one step
    assert any(any(q == 1 for q, _, _, _ in s) for s in pf)  # decode rows beside a chunk
    few = [s for s in pf if sum(q for q, _, _, _ in s if q > 1) < 32]  # a few prompt tokens (session 27)
    assert len(few) >= 3 and sum(any(q == 1 for q, _, _, _ in s) for s in few) >= 2
    assert all(1 <= q <= c <= 4096 for s in pf for q, c, _, _ in s)
    small = ProfileGrid.default(max_tokens=256, max_context=512, max_batch=8)  # clipped to a small model
    assert all(q <= c <= 512 and q <= 256 for s in small.step_shapes for q, c, _, _ in s)


def test_step_replays_give_prefill_and_decode_step_samples():
    def case(index, works, t):
        run = SimpleNamespace(overheads=[1e-3, 1e-3], decode_contexts=None, prefill_batch=None)
        if all(q == 1 for q, _ in works):
            run.decode_contexts = tuple(c for _, c in works)
        else:
            run.prefill_batch = (tuple(q for q, _ in works), tuple(c for _, c in works))
        return Case(("step_overhead", index, 1, len(works)), run, times=[t, t, t], clean=[t, t, t])

    cases = [case(0, [(1, 40), (1, 90)], 0.02), case(1, [(1, 40), (64, 64)], 0.05), case(2, [(128, 256)], 0.08)]
    out = samples_from_cases(cases, 0.03, Bench(), None, warn=False)
    assert sorted(type(s).__name__ for s in out) == sorted(["StepOverheadSample"] * 3
                                                           + ["DecodeStepSample", "PrefillStepSample", "PrefillStepSample"])
    pf = {s.query_lens: s for s in out if isinstance(s, PrefillStepSample)}
    assert pf[(1, 64)].context_lens == (40, 64) and abs(pf[(1, 64)].seconds - 0.049) < 1e-12  # compute: less the overhead
    assert pf[(128,)].context_lens == (256,)
    assert [s.context_lens for s in out if isinstance(s, DecodeStepSample)] == [(40, 90)]
    assert all(s.seconds == 1e-3 for s in out if isinstance(s, StepOverheadSample))
