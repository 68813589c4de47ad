"""Latency model: predict the wall time of a layer call, an iteration, a prefill.

Paper §5. One layer call of a batch with query lengths ``q_k`` and context lengths
``c_k`` (``n = Σq_k`` tokens) costs

    stateless(n) + attention_scale · attention(q, c) + layer_overhead

(``attention_scale`` >= 1 and ``layer_overhead`` are fitted on whole-layer samples: a layer
whose attention streams a large KV cache runs its projections a little slower.)

* ``stateless(n)``: QKV, O projection, MLP, norms, RoPE, residual adds. Piecewise
  linear in ``n`` with fixed-width segments (GEMM tile effects; 32 tokens on GPU).
  Here the width is *selected* by cross-validation among candidates, and the fit is
  monotone (non-decreasing in ``n``), so schedulers may binary-search chunk sizes.
  The smallest counts (``n = 1 .. K``, densely profiled) keep their measured values: a
  single decode token is not half the cost of two (BLAS kernel switches).
* ``attention(q, c)``: the paper's ``α·n + β·Σc + γ``, kept separately for the
  decode-like entries (``q_k == 1``) and the prefill-like entries (``q_k > 1``) of the
  batch; a mixed batch pays both parts. Terms for what the runner's kernels really
  compute (padded decode groups, the causal score matrix of an uncached prefill, the
  padded masked score matrix of other prefills) are selected by cross-validation when
  the data warrants them (see ``ATTENTION_FEATURES``). Decode entries are priced per
  group, as the runner splits them to bound the padded K/V gather
  (``max_gather_positions``; see :func:`decode_groups`).
* an iteration adds ``embed(tokens embedded)`` and ``head(rows through the LM head)``;
  the head also keeps measured values for the smallest row counts (not monotone there).
* and the step's own overhead (``step_overhead_time``): what ``ModelRunner.execute`` costs beyond
  its layer calls, embedding and head -- once per step, once per batch composition (a segment of
  layers with the same batch: attention metadata built, rows joined or parked) and once per work
  of each composition. A per-layer fit spreads it evenly over layers; it is not even (a
  layer-sliced step of ten compositions pays it ten times), so the profiler measures it on whole
  steps (``StepOverheadSample``: wall time minus the compute the runner times itself) and the
  forms with ``step`` price it apart (the default ``tiled-instep-step`` among them: see
  ``laser.latency.fitting.FORMS``; 0 in other forms and in profiles without such samples).
* a decode layer call (every entry one token) runs cheaper inside a whole step than timed alone
  (its stateless modules 0.82 of it, its attention the same, on an AVX512 EPYC at one thread):
  forms with ``instep`` (the default among them) scale its parts by ``decode_step_scale`` and
  ``decode_step_attention_scale``, fitted from whole decode steps (``DecodeStepSample``: their
  compute); 1.0 in other forms and in profiles without such samples.
* so does a layer call holding a prefill chunk (on an AMX Xeon ~0.9 of it, bf16 SmolLM2): the same
  forms price the layer calls of a step holding one at ``prefill_step_scale`` of the call timed alone,
  fitted from whole prefill and mixed steps (``PrefillStepSample``); 1.0 without them. What a layer
  call costs inside a step is :meth:`LatencyModel.step_layer_time` (plans, schedulers and the
  simulator price with it); :meth:`LatencyModel.layer_time` is the call timed alone.
* a stream of small decode steps runs faster than one such step after other work, which is how the
  profiler times every case (on an AMX Xeon a batch-1 step ran ~0.93x its price right after a prefill step
  and ~0.77x seven decode steps later; after an idle 0.2 s too, so it is not only the caches' content):
  the same forms price a decode step in a streak (``StepPlan.warm``, :func:`laser.core.pricing.warm_streak`)
  at :meth:`LatencyModel.decode_warm_factor` of its price, fitted from decode steps timed in streaks back
  to back (``WarmDecodeStepSample``); 1.0 without them.

Three implementations of one interface (:class:`LatencyModel`):

* :class:`FittedLatencyModel`: fitted from profile samples (:func:`fit`); saved to and
  loaded from a JSON profile file that keeps the raw samples, so it can be refitted.
* :class:`AnalyticLatencyModel`: a roofline *estimate* from the model shape and a
  hardware table, for hardware we cannot profile (A100/H100/H200) and for schedulers
  before a profile exists.
* :class:`SimpleLatencyModel`: a few explicit constants, for tests with a fake clock.

:class:`CalibratedLatencyModel` wraps any of them for a real instance: its predictions
scaled by how the machine runs now (measured over the last steps).

Modules: ``base`` (interface, error, profile samples), ``features`` (attention features,
the decode grouping rule and its limit, shared with the model runner), ``fitted``
(prediction), ``fitting`` (numpy/scipy; imported only to fit), ``analytic`` (roofline and
test models), ``io`` (profile files).

Torch-free on purpose (a design rule: schedulers and the simulator import this package).
Prediction is pure Python arithmetic on precomputed coefficients (microseconds); importing
this package, loading a profile and predicting import neither numpy nor scipy: ``fit``
(and ``FittedLatencyModel.fit``/``refit``) import them when called.
"""


from .analytic import HARDWARE, MODEL_SHAPES, AnalyticLatencyModel, HardwareSpec, ModelShape, SimpleLatencyModel
from .base import (
    AttentionSample,
    DecodeStepSample,
    EmbedSample,
    HeadSample,
    LatencyModel,
    LatencyProfileError,
    LayerSample,
    PrefillStepSample,
    Sample,
    StatelessSample,
    StepOverheadSample,
    WarmDecodeStepSample,
)
from .features import (
    ATTENTION_FEATURE_SETS,
    ATTENTION_FEATURES,
    DEFAULT_MAX_GATHER_BYTES,
    attention_features,
    decode_groups,
    decode_slices,
    gather_positions_from_metadata,
    max_gather_positions,
)
from .calibrated import CalibratedLatencyModel, ScaledLatencyModel
from .fitted import AttentionModel, FittedLatencyModel, PiecewiseLinear
from .io import PROFILE_FORMAT, PROFILE_VERSION, cpu_hardware_string, default_profile_path

__all__ = [
    "ATTENTION_FEATURES", "ATTENTION_FEATURE_SETS", "AnalyticLatencyModel", "AttentionModel", "AttentionSample",
    "DecodeStepSample", "PrefillStepSample", "WarmDecodeStepSample",
    "CalibratedLatencyModel", "ScaledLatencyModel",
    "DEFAULT_MAX_GATHER_BYTES", "EmbedSample", "FittedLatencyModel", "HARDWARE", "HardwareSpec", "HeadSample",
    "LatencyModel", "LatencyProfileError", "LayerSample", "MODEL_SHAPES", "ModelShape", "PROFILE_FORMAT",
    "PROFILE_VERSION", "PiecewiseLinear", "Sample", "SimpleLatencyModel", "StatelessSample", "StepOverheadSample",
    "attention_features",
    "cpu_hardware_string", "decode_groups", "decode_slices", "default_profile_path", "fit",
    "gather_positions_from_metadata", "max_gather_positions",
]


def __getattr__(name):  # lazy: fitting imports numpy and scipy, predicting must not
    if name == "fit":
        from .fitting import fit

        return fit
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
