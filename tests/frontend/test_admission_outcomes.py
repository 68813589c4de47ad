"""What admission answers when a TTFT target is predicted missed (a fresh user's findings):
``reject`` tells a target no retry can meet (missed even on an idle instance) from one missed
only behind the current queue; ``demote`` serves the strictest looser class whose target the
prediction meets, else best effort -- never a class it also misses."""

from __future__ import annotations

import pytest

from laser.core.slo import SLOClasses
from laser.frontend.admission import QueueAwareAdmission, SLOInfeasibleError
from laser.latency import SimpleLatencyModel
from laser.scheduler.report import SchedulerReport

LM = SimpleLatencyModel(num_layers=8, per_layer=2e-3, per_token=1.2e-5)
P = 1000
ONE = LM.predict_prefill(P)  # seconds: one prompt's prefill on an idle instance


def _qa(ahead: int = 0) -> tuple[QueueAwareAdmission, SchedulerReport]:
    """Admission over an instance with ``ahead`` prompts of ``P`` tokens queued (strict targets: ahead in EDF)."""
    qa = QueueAwareAdmission(LM)
    rep = SchedulerReport(time=0.0, policy="vllm")
    qa.publish(rep.with_entries(rep.entry(P, 0.0, SLOClasses({"q": {"ttft": 1e-3}}).get("q")) for _ in range(ahead)))
    return qa, qa.view(0.0)


def _classes(**ttfts_in_ones) -> SLOClasses:
    spec = {n: {"ttft": t * ONE, "tbt": 1.0, "tier": "warm" if n.startswith("w") else "hot"}
            for n, t in ttfts_in_ones.items()}
    return SLOClasses(spec)


def test_reject_tells_a_target_no_retry_meets_from_one_the_queue_misses():
    classes = _classes(tight=0.5, ok=1.5)
    qa, view = _qa(ahead=3)
    with pytest.raises(SLOInfeasibleError) as never:
        qa.decide(P, classes.get("tight"), 0.0, 0.0, view, "reject", classes)
    assert never.value.never and never.value.alone_ttft == pytest.approx(ONE)
    assert "even on an idle instance" in str(never.value)
    with pytest.raises(SLOInfeasibleError) as queued:  # feasible alone: only the queue is to blame
        qa.decide(P, classes.get("ok"), 0.0, 0.0, view, "reject", classes)
    assert not queued.value.never and queued.value.num_ahead == 3
    assert queued.value.predicted_ttft == pytest.approx(4 * ONE)


def test_demote_serves_the_strictest_class_whose_target_the_prediction_meets():
    classes = _classes(tight=0.5, mid=0.9, wloose=1.5, wlooser=3.0)
    qa, view = _qa()
    adm, _ = qa.decide(P, classes.get("tight"), 0.0, 0.0, view, "demote", classes)
    assert adm.demoted and adm.requested.name == "tight"
    assert adm.slo.name == "wloose" and adm.demoted_to == "warm"  # not "mid": it misses that too
    assert adm.predicted_ttft == pytest.approx(ONE)


def test_demote_of_a_demotable_request_skips_a_warm_class_it_also_misses():
    """The report: a ``code`` request predicted at 8.6 s was served as ``summarization`` (2 s)."""
    spec = {"code": {"ttft": 0.125, "tbt": 0.05, "tier": "hot", "demotable": True, "demote_to": "summarization"},
            "summarization": {"ttft": 2.0, "tbt": 0.2, "tier": "warm"}}
    classes = SLOClasses(spec, scale=ONE / 8.6)  # code 8.6 s -> ~ONE/69; summarization ~ONE/4.3
    qa, view = _qa()
    adm, _ = qa.decide(P, classes.get("code"), 0.0, 0.0, view, "demote", classes)
    assert adm.slo.name == "best_effort" and adm.demoted_to == "best_effort"
    # a warm class it does meet is still where it goes
    ok = SLOClasses(spec, scale=ONE / 2.0 * 1.5)
    adm, _ = qa.decide(P, ok.get("code"), 0.0, 0.0, view, "demote", ok)
    assert adm.slo.name == "summarization" and adm.demoted_to == "warm"
