"""A simulated instance behind the server's admission (issue 28): each request is decided by
:meth:`laser.frontend.admission.QueueAwareAdmission.decide` when it is released, over the report
published before the last step plus the requests admitted since -- as ``laser serve`` decides
over what its engine thread published. Torch-free (virtual time)."""

from __future__ import annotations

from ..frontend.admission import QueueAwareAdmission, SLOInfeasibleError
from ..core.request import Request
from .instance import SimInstance


class AdmittingSim(SimInstance):
    """A :class:`SimInstance` whose arrivals pass admission first.

    Args:
        policy, num_layers, latency_model, machine_model, num_blocks, config: :class:`SimInstance`'s.
        on_infeasible: ``queue`` | ``reject`` | ``demote`` (``laser serve --on-infeasible``).
        slo_classes: the :class:`~laser.core.slo.SLOClasses` admission demotes with.
        replay: decisions by request id (``admitted`` or ``rejected``) taken as given instead of
            admission's (a counterfactual replay: would a refused request have been served in
            time, every other decision kept?); an id not in it is decided by admission.
        model: the queue-time model admission predicts with (None: the report's default,
            :func:`laser.scheduler.ttft.model_for`).

    After :meth:`run` (with ``before_step=sim.publish``), ``decisions[req_id]`` is
    ``(decision, predicted TTFT)``, decision one of ``admitted``, ``demoted``, ``rejected``.
    """

    def __init__(self, policy: str, num_layers: int, latency_model, on_infeasible: str, slo_classes,
                 machine_model=None, num_blocks: int = 8192, config=None, replay: dict | None = None,
                 model: str | None = None):
        super().__init__(policy, num_layers, latency_model, config, num_blocks=num_blocks,
                         machine_model=machine_model)
        self.qa = QueueAwareAdmission(latency_model, model)
        self.on_infeasible, self.slo_classes, self.replay = on_infeasible, slo_classes, dict(replay or {})
        self.decisions: dict[str, tuple[str, float | None]] = {}
        self.num_adds = 0
        self._last = (0.0, 0.0)  # (start, end) of the last step, virtual seconds

    def add_request(self, req: Request) -> None:
        """Decide ``req`` (or take its ``replay`` decision) and queue it unless refused; a demoted
        request is served under the class admission gave it (``req.slo`` changes)."""
        now = self.clock()
        view = self.qa.view(now)
        given = self.replay.get(req.req_id)
        if given is not None:
            entry = self.qa.entry(req.num_prompt_tokens, req.arrival_time, req.slo)
            self.decisions[req.req_id] = (given, self.qa.predict(entry, now, req.arrival_time, view))
            if given == "rejected":
                return
        else:
            try:
                adm, _ = self.qa.decide(req.num_prompt_tokens, req.slo, req.arrival_time, now, view,
                                        self.on_infeasible, self.slo_classes)
            except SLOInfeasibleError as e:
                self.decisions[req.req_id] = ("rejected", e.predicted_ttft)
                return
            self.decisions[req.req_id] = ("demoted" if adm.demoted else "admitted", adm.predicted_ttft)
            req.slo, entry = adm.slo, adm.entry
        self.num_adds += 1
        self.qa.admitted(self.num_adds, entry)
        super().add_request(req)

    def publish(self) -> None:
        """The engine thread's publish before a step (the report, the adds it holds, the last step's length)."""
        self.qa.publish(self.scheduler.report(self.clock()), self.num_adds, self._last[1] - self._last[0])

    def step(self):
        """One step, its start and end remembered for :meth:`publish`."""
        t0 = self.clock()
        out = super().step()
        self._last = (t0, self.clock())
        return out
