"""Small integer helpers the schedulers and the controller share. Torch-free."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def largest(lo: int, hi: int, ok) -> int | None:
    """Largest x in [lo, hi] with ok(x), for ok monotone (True then False); None if none."""
    if hi < lo or not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo
