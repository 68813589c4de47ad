"""The server process's heap (issue 26 item 4, served stalls): every cyclic garbage collection is
timed by generation, and ``laser serve`` freezes its startup heap so that a full collection no
longer walks the engine's, torch's and the libraries' objects (one took 340-380 ms on the issue's
CPU kind, stopping the engine thread and the event loop)."""

from __future__ import annotations

import gc

import pytest

from laser.server.heap import GC_PAUSES, GcPauses, freeze_heap, gc_freeze_enabled


def test_collections_are_timed_by_generation():
    ticks = iter([1.0, 1.25, 2.0, 2.5, 3.0, 3.125])
    p = GcPauses(clock=lambda: next(ticks))
    p("stop", {"generation": 2})  # installed mid-collection: its start was not seen, nothing counted
    for g in (2, 0, 2):
        p("start", {"generation": g})
        p("stop", {"generation": g})
    assert p.counts == [1, 0, 2]
    assert p.seconds == [0.5, 0.0, 0.375] and p.longest == [0.5, 0.0, 0.25]
    d = p.to_json()
    assert d["counts"] == [1, 0, 2] and d["longest"] == [0.5, 0.0, 0.25] and d["frozen"] >= 0


def test_installed_timer_sees_a_real_collection_once():
    p = GcPauses()
    try:
        p.install()
        p.install()  # once only
        assert sum(cb is p for cb in gc.callbacks) == 1
        gc.collect(1)
        assert p.counts[1] == 1 and p.seconds[1] > 0.0
    finally:
        p.remove()
    gc.collect(1)
    assert p.counts[1] == 1  # removed: no longer counting


def test_freezing_moves_the_live_heap_out_of_the_collectors_reach():
    alive = [[i] for i in range(1000)]  # tracked containers alive at "startup"
    try:
        assert gc.get_freeze_count() == 0
        frozen = freeze_heap()
        # frozen objects freed later (by this thread or a library's) leave the permanent generation,
        # so the count can only shrink after the freeze; our live containers stay in it
        assert frozen >= gc.get_freeze_count() >= len(alive)
        # a full collection now walks only what was allocated since: none of the frozen objects
        assert not any(x in gc.get_objects(generation=2) for x in alive[:3])
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0


def test_the_switch(monkeypatch):
    monkeypatch.delenv("LASER_GC_FREEZE", raising=False)
    assert gc_freeze_enabled()
    monkeypatch.setenv("LASER_GC_FREEZE", "0")
    assert not gc_freeze_enabled()
    monkeypatch.setenv("LASER_GC_FREEZE", "yes")
    with pytest.raises(ValueError, match="LASER_GC_FREEZE"):
        gc_freeze_enabled()


def test_the_servers_metrics_install_the_process_timer():
    from laser.server.metrics import ServerMetrics

    GC_PAUSES.remove()
    ServerMetrics("m", None)
    assert GC_PAUSES in gc.callbacks


def test_laser_serve_freezes_its_heap_before_serving(monkeypatch):
    from laser.server.cli import run_server

    seen = []

    class Server:
        def run(self):
            seen.append(gc.get_freeze_count())

    try:
        for mode in ("0", "1"):
            monkeypatch.setenv("LASER_GC_FREEZE", mode)
            run_server(Server())
    finally:
        gc.unfreeze()
    assert seen[0] == 0 and seen[1] > 0  # off: nothing frozen; on: the heap frozen before run()
