"""Cluster admission sees the queue (issue 27 item 4): the front end publishes the scheduler
report of the prefill instance a request would go to (its instances' reports after their last
step), so a request arriving behind queued prompts is predicted to wait for them -- as in
process. In-process instances (local handles), no Ray."""

from __future__ import annotations

from laser.cluster.launch import start_cluster
from laser.core.config import SchedulerConfig
from laser.core.request import SLO, SamplingParams
from laser.frontend.async_engine import AsyncEngine

SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
CHAT = SLO(ttft=10.0, tbt=1.0, name="chat")


def test_cluster_admission_predicts_behind_the_prefill_queue(tiny_llama):
    cl = start_cluster("laser", 1, 1, model=str(tiny_llama), dtype="float32", use_ray=False,
                       scheduler=SchedulerConfig(max_num_batched_tokens=16), latency_calibration=False)
    ae = AsyncEngine(cl)
    try:
        (alone,) = ae.admit([48], CHAT)
        assert alone.predicted_ttft is not None and ae.queue_admission.report is None
        for i in range(4):
            cl.add_request(list(range(3, 3 + 96)), SP, slo="chat", req_id=f"q{i}")
        cl.step(wait_s=5.0)  # one step of the prefill instance: it reports its queue
        ae._publish(0.0)
        rep = ae.queue_admission.report
        assert rep is not None and rep.role == "prefill"
        assert [e.req_id for e in rep.queue] == [f"q{i}" for i in range(4)]  # the scheduler's order
        assert sum(e.prefill_tokens for e in rep.queue) > 3 * 96  # one 16-token chunk done at most
        (behind,) = ae.admit([48], CHAT)
        assert behind.predicted_ttft > alone.predicted_ttft  # it waits for the 4 prompts ahead
        while cl.has_unfinished():
            cl.step(wait_s=1.0)
        ae._publish(0.0)
        assert ae.queue_admission.report.queue == ()
        (after,) = ae.admit([48], CHAT)
        assert after.predicted_ttft < behind.predicted_ttft  # the queue drained
    finally:
        ae.stop()
