"""Memoised decode prices for Alg. 1 and Alg. 2 (:class:`DecodeMemo`) and the one decode
layer price they memoise (:func:`layer_price`). Torch-free."""

from __future__ import annotations

from ...latency import LatencyModel


class DecodeMemo:
    """Prices that Alg. 1 and Alg. 2 ask for again and again, memoised for one latency model
    (``lm``; deterministic, so a memoised price is the same number): one decode layer of
    ``c`` requests at mean context ``ctx`` (seconds) and :func:`tbt_infeasible` per (context,
    TBT target). A :class:`~laser.latency.ScaledLatencyModel` (a real instance's online
    calibration) changes its factor in place: its inner model's prices are memoised and
    scaled by the factor of the moment. Owned by a Laser scheduler and shared by its replans
    and its instance's ``LatencyIncrement`` answers; cleared when it holds more than
    ``MAX_ENTRIES`` prices."""

    MAX_ENTRIES = 1 << 18

    def __init__(self, lm: LatencyModel):
        from laser.latency import ScaledLatencyModel
        from laser.latency.calibrated import KindScaledLatencyModel

        self.lm = lm
        self._scaled = lm if isinstance(lm, ScaledLatencyModel) else None
        self._kinds = isinstance(lm, KindScaledLatencyModel)  # decode layer calls scaled apart
        self._base = lm.inner if self._scaled is not None else lm  # what the memo prices
        self.layers: dict[tuple[int, int], float] = {}
        self.single: dict[int, float] = {}  # decode iteration of one request at a context, unscaled

    @property
    def factor(self) -> float:
        """The scale of the memoised prices of layer calls with a prefill chunk now (1.0 unless
        ``lm`` is a scaled model)."""
        return self._scaled.factor if self._scaled is not None else 1.0

    @property
    def decode_factor(self) -> float:
        """The scale of the memoised decode-only prices now: a kind-scaled model's (its online
        calibration's) ``decode_factor``, else :attr:`factor`."""
        return self._scaled.decode_factor if self._kinds else self.factor

    def layer_time(self, c: int, ctx: int, background: int = 0) -> float:
        """One layer call of ``c`` decode tokens at context ``ctx`` each, beside a prefill
        chunk of ``background`` tokens (seconds; see :class:`_LayerLoad`)."""
        key = (c, ctx, background)
        t = self.layers.get(key)
        if t is None:
            if len(self.layers) > self.MAX_ENTRIES:
                self.layers.clear()
            t = self.layers[key] = layer_price(self._base, c, ctx, background)
        if self._scaled is None:
            return t
        return t * (self._scaled.factor if background > 0 or not self._kinds else self._scaled.decode_factor)

    def tbt_infeasible(self, num_tokens: int, tbt: float) -> bool:
        """True when one decode iteration of a request at context ``num_tokens`` alone takes
        longer than ``tbt``."""
        t = self.single.get(num_tokens)
        if t is None:
            if len(self.single) > self.MAX_ENTRIES:
                self.single.clear()
            t = self.single[num_tokens] = self._base.predict_decode_iteration((num_tokens,))
        return (t if self._scaled is None else t * self.decode_factor) > tbt


def layer_price(lm: LatencyModel, c: int, ctx: int, background: int) -> float:
    """One layer call of ``c`` decode tokens at context ``ctx`` plus one prefill chunk of
    ``background`` tokens (a fresh chunk: context = its length), seconds; 0 when empty."""
    if background > 0:
        return lm.step_layer_time((1,) * c + (background,), (ctx,) * c + (background,))
    return lm.step_layer_time((1,) * c, (ctx,) * c) if c else 0.0


def memo_for(lm: LatencyModel, memo: "DecodeMemo | None") -> "DecodeMemo | None":
    """``memo`` when it memoises ``lm``'s prices, else None (price afresh)."""
    return memo if memo is not None and memo.lm is lm else None
