"""One picture of an instance's queue (issue 27 item 4): admission places a newcomer where the
scheduler will queue it -- boosted, demoted, batch-deadline and best-effort requests included --
and the TTFT it predicts from the scheduler's report is the one the simulator then gives."""

from __future__ import annotations

import pytest

from laser.core.request import SLO, Request, SamplingParams
from laser.latency import SimpleLatencyModel
from laser.sim.instance import SimInstance

N = 4
LM = SimpleLatencyModel(num_layers=N, per_layer=1e-3, per_token=2e-5, per_context=1e-8)
HOT = SLO(0.5, 0.05, "chat", tier="hot")
WARM = SLO(2.0, 0.2, "chat-warm", tier="warm")
BE = SLO(None, None, "best_effort", tier="best_effort")


def batch(deadline: float) -> SLO:
    """A cold request of a batch job that must start by ``deadline`` (its own EDF key)."""
    return SLO(None, None, "batch", tier="cold", deadline=deadline)


def _req(rid: str, slo: SLO, arrival: float, tokens: int = 64, demoted: bool = False,
         boosted: bool = False) -> Request:
    r = Request([5] * tokens, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), slo, arrival,
                req_id=rid)
    r.demoted, r.boosted = demoted, boosted
    return r


def _queued() -> list[Request]:
    """A waiting queue with every case of the scheduler's rule: a request room was made for
    (boosted), a demoted hot request, batch requests far from and near their start-by deadline,
    hot, warm and best-effort ones."""
    return [_req("boosted", BE, 0.0, boosted=True), _req("hot", HOT, 0.1), _req("warm", WARM, 0.2),
            _req("be", BE, 0.3), _req("demoted", HOT, 0.4, demoted=True), _req("batch-late", batch(100.0), 0.5),
            _req("batch-soon", batch(0.7), 0.6), _req("hot2", HOT, 1.0)]


NEWCOMERS = [("n-hot", HOT, False), ("n-warm", WARM, False), ("n-be", BE, False), ("n-demoted", HOT, True),
             ("n-batch-soon", batch(1.05), False), ("n-batch-late", batch(50.0), False),
             ("n-batch-now", batch(0.0), False)]


@pytest.mark.parametrize("order", ["edf", "fcfs"])
@pytest.mark.parametrize("rid,slo,demoted", NEWCOMERS)
def test_admission_places_a_newcomer_where_the_scheduler_queues_it(order, rid, slo, demoted):
    from laser.core.config import SchedulerConfig

    arrival = 1.1
    sim = SimInstance("laser", N, LM, SchedulerConfig(queue_order=order))
    for r in _queued():
        sim.scheduler.add_request(r)
    rep = sim.scheduler.report(arrival)
    entry = rep.entry(64, arrival, slo, demoted=demoted)
    predicted = [e.req_id for e in rep.with_entries([entry]).queue]
    predicted[predicted.index("")] = rid
    sim.scheduler.add_request(_req(rid, slo, arrival, demoted=demoted))
    actual = [e.req_id for e in sim.scheduler.report(arrival).queue]
    assert predicted == actual
    assert actual[0] == "boosted"  # room was made for it: nothing is placed before it


def _first_token_of_newcomer(policy: str, role: str, slo: SLO, demoted: bool = False):
    """(predicted, simulated) TTFT of a 400-token newcomer arriving at an instance whose queue
    holds a warm 700-token, a hot 300-token and a best-effort 900-token prompt (one output token
    each: nothing decodes), predicted from the scheduler's report before it is added."""
    from laser.core.config import SchedulerConfig
    from laser.scheduler.ttft import predict_ttft

    sim = SimInstance(policy, N, LM, SchedulerConfig(role=role, max_num_batched_tokens=512))
    queue = [_req("a", WARM, 0.0, 700), _req("b", HOT, 0.0, 300), _req("c", BE, 0.0, 900)]
    for r in queue:
        r.sampling_params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        sim.scheduler.add_request(r)
    rep = sim.scheduler.report(0.0)
    predicted = predict_ttft(rep, rep.entry(400, 0.0, slo, demoted=demoted), LM, 0.0, 0.0)
    new = _req("new", slo, 0.0, 400, demoted=demoted)
    new.sampling_params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    sim.scheduler.add_request(new)
    sim.run()
    return predicted, new.first_token_time


CLASSES = [(HOT, False), (WARM, False), (BE, False), (HOT, True), (batch(0.0), False), (batch(1.0), False)]


@pytest.mark.parametrize("slo,demoted", CLASSES)
def test_predicted_ttft_is_the_simulated_one_for_whole_prompt_prefill(slo, demoted):
    """vLLM on a mixed instance prefills whole prompts in queue order, the chunked model's
    schedule: the prediction from the report is the simulated TTFT, wherever the newcomer queues."""
    predicted, simulated = _first_token_of_newcomer("vllm", "mixed", slo, demoted)
    assert predicted == pytest.approx(simulated, rel=1e-9)


@pytest.mark.parametrize("policy", ["laser", "sarathi"])
@pytest.mark.parametrize("role", ["mixed", "prefill"])
@pytest.mark.parametrize("slo,demoted", CLASSES)
def test_predicted_ttft_tracks_the_simulated_one(policy, role, slo, demoted):
    """Chunked and layer-level prefill (each instance kind's model, laser.scheduler.ttft.model_for):
    within a third of the simulated TTFT (the models do not pack a newcomer's last chunk with its
    neighbours' tokens)."""
    predicted, simulated = _first_token_of_newcomer(policy, role, slo, demoted)
    assert predicted == pytest.approx(simulated, rel=0.35)


@pytest.mark.parametrize("policy", ["laser", "sarathi", "vllm"])
@pytest.mark.parametrize("role", ["mixed", "prefill"])
def test_the_later_a_newcomer_queues_the_later_both_say_its_first_token_comes(policy, role):
    runs = [_first_token_of_newcomer(policy, role, slo, demoted) for slo, demoted in CLASSES]
    by_prediction = sorted(range(len(runs)), key=lambda i: (runs[i][0], i))
    assert all(runs[i][1] <= runs[j][1] + 1e-12 for i, j in zip(by_prediction, by_prediction[1:]))


@pytest.mark.parametrize("role", ["mixed", "prefill"])
def test_an_aged_best_effort_prompt_is_predicted_behind_a_new_chat_under_laser_only(role):
    """Issue 28 item 3: past its aging deadline a best-effort prompt's EDF key is earlier than a
    new chat's, but Laser's triage prefills it behind every prompt with a deadline of its own
    (report.yields_prefill). Admission predicts from the same order: the chat's predicted TTFT is
    the one it has with no best-effort prompt queued. Iteration-level EDF (Sarathi) does run the
    aged prompt first, and its prediction says so."""
    from laser.core.config import SchedulerConfig
    from laser.scheduler.ttft import predict_ttft

    now = 30.2  # the best-effort prompt queued at 0.0 ages to key 30.0; the chat's key is 30.7
    ttft = {}
    for policy in ("laser", "sarathi"):
        for with_be in (True, False):
            sim = SimInstance(policy, N, LM, SchedulerConfig(role=role, max_num_batched_tokens=512))
            if with_be:
                sim.scheduler.add_request(_req("be", BE, 0.0, 900))
            rep = sim.scheduler.report(now)
            entry = rep.entry(200, now, HOT)
            assert not entry.best_effort and all(e.best_effort for e in rep.queue)
            ttft[policy, with_be] = predict_ttft(rep, entry, LM, now, now)
    assert ttft["laser", True] == pytest.approx(ttft["laser", False], rel=1e-12)
    assert ttft["sarathi", True] > 2 * ttft["sarathi", False]
