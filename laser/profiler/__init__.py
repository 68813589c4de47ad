"""Latency profiler: time the real executor's pieces, fit the latency model, keep profile files.

What is timed is what the engine runs (``LlamaModel`` and ``ModelRunner``), on the
engine's own weights, KV pool and block manager -- the model's own layer functions, not
a replica (:mod:`.calls`): the stateless part of a layer, its attention core, whole layer
calls (whose residual over the parts is fitted as a per-call overhead plus a scale on
attention), embedding and LM head.

Modules:

* :mod:`.timing` -- :class:`Case`, :class:`Bench`: interleaved, repeated timing that
  stays right on a shared machine (CPU-pressure checks, reference re-timing; a case's
  time is the median of its undisturbed repeats);
* :mod:`.calls` -- :class:`ExecutorCalls`: the timed calls on the real runner;
* :mod:`.grid` -- :class:`ProfileGrid`: what is sampled;
* :mod:`.pipeline` -- :func:`collect_samples`, :func:`profile`, :func:`load_or_create`
  (one profile file per model shape, dtype, hardware and threads), :func:`default_path`;
* :mod:`.snapshots` -- real schedulers' plans frozen for replay;
* :mod:`.evaluation` -- the accuracy report of ``laser profile --evaluate``
  (:func:`evaluate`, :func:`profile_and_evaluate`, :func:`score`, :func:`format_report`).
  Its ground truth is measured like the profile, in the same interleaved rounds when
  measured together (:func:`profile_and_evaluate`), and records the best times and the
  spread of the two fastest repeats, to show how noisy the machine was.
"""

from .calls import GREEDY, ExecutorCalls
from .evaluation import (
    CASE_KINDS,
    EvalSet,
    accuracy,
    evaluate,
    format_report,
    profile_and_evaluate,
    random_layer_batches,
    score,
    summarize,
)
from .grid import ProfileGrid, fit_to_pool
from .pipeline import (
    PROFILE_WIDTHS,
    PROFILER_VERSION,
    collect_samples,
    default_grid,
    default_path,
    dtype_name,
    executor_path_of,
    load_or_create,
    model_name_of,
    pool_tokens,
    profile,
    profile_metadata,
    robust_fit,
    shape_signature,
)
from .snapshots import PlanReplay, PlanSnapshot, policy_snapshots, synthetic_stream
from .timing import Bench, Case, planned_calls

__all__ = [
    "CASE_KINDS", "GREEDY", "PROFILER_VERSION", "PROFILE_WIDTHS", "Bench", "Case", "EvalSet", "ExecutorCalls",
    "PlanReplay", "PlanSnapshot", "ProfileGrid", "accuracy", "collect_samples", "default_grid", "default_path",
    "dtype_name", "evaluate", "executor_path_of", "fit_to_pool", "format_report", "load_or_create", "model_name_of", "planned_calls",
    "policy_snapshots", "pool_tokens", "profile", "profile_and_evaluate", "profile_metadata", "random_layer_batches",
    "robust_fit", "score", "shape_signature", "summarize", "synthetic_stream",
]
