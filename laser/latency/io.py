"""Latency profile files: the JSON document, its version, reading and writing it, where it lives.

A profile file holds a fitted model's coefficients *and* the raw samples it was fitted
from (so it can be refitted), plus the setup it was measured on (model shape, dtype,
hardware, threads). :meth:`FittedLatencyModel.save` / :meth:`~FittedLatencyModel.load`
use the functions here. Torch-free, numpy-free.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from .base import (KIND_TYPE, TYPE_KIND, AttentionSample, DecodeStepSample, LatencyProfileError, LayerSample,
                   PrefillStepSample, Sample, StepOverheadSample, WarmDecodeStepSample, check_batch, check_seconds)

PROFILE_FORMAT = "laser-latency-profile"
# Bump when the document's layout or the meaning of a coefficient changes: older files are
# then refused with a message to re-run the profiler.
PROFILE_VERSION = 2


def laser_version() -> str:
    """The installed laser version (for profile metadata); ``"0.0.0"`` if unknown."""
    try:
        from importlib.metadata import version

        return version("laser")
    except Exception:
        pass
    try:
        import laser

        return str(getattr(laser, "__version__", "0.0.0"))
    except Exception:
        return "0.0.0"


# --------------------------------------------------------------------------------------
# The document


def check_document(d: object) -> None:
    """Raise :class:`LatencyProfileError` unless ``d`` is a profile document of this version."""
    if not isinstance(d, dict) or d.get("format") != PROFILE_FORMAT:
        raise LatencyProfileError(f"not a {PROFILE_FORMAT} document")
    if d.get("version") != PROFILE_VERSION:
        raise LatencyProfileError(
            f"profile format version {d.get('version')!r} is not supported (expected {PROFILE_VERSION}); re-run the profiler")


def encode_samples(samples) -> dict[str, list]:
    """Samples as JSON lists, by kind: ``{"attention": [[q_lens, c_lens, seconds], ...],
    "stateless": [[n, seconds], ...], "step_overhead": [[compositions, composed_works, seconds], ...],
    "decode_step": [[c_lens, seconds], ...], "prefill_step": [[q_lens, c_lens, seconds], ...],
    "decode_step_warm": [[c_lens, streak, seconds], ...], ...}`` (every kind present, maybe empty; ``decode_step_warm`` only when
    there are some)."""
    by_kind: dict[str, list] = {k: [] for k in KIND_TYPE}
    for s in samples:
        if isinstance(s, (AttentionSample, LayerSample, PrefillStepSample)):
            enc = [list(s.query_lens), list(s.context_lens), s.seconds]
        elif isinstance(s, StepOverheadSample):
            enc = [s.compositions, s.composed_works, s.seconds]
        elif isinstance(s, DecodeStepSample):
            enc = [list(s.context_lens), s.seconds]
        elif isinstance(s, WarmDecodeStepSample):
            enc = [list(s.context_lens), s.streak, s.seconds]
        else:
            enc = [s.n_tokens if hasattr(s, "n_tokens") else s.n_rows, s.seconds]
        by_kind[TYPE_KIND[type(s)]].append(enc)
    if not by_kind["decode_step_warm"]:  # (a profile without them stays readable by a Laser before them)
        del by_kind["decode_step_warm"]
    return by_kind


def decode_samples(by_kind: dict[str, list]) -> list[Sample]:
    """Inverse of :func:`encode_samples`. Raises :class:`LatencyProfileError` for an unknown
    kind, ``ValueError``/``TypeError`` for a malformed or invalid sample."""
    return [_decode_sample(kind, enc) for kind, encs in by_kind.items() for enc in encs]


def _decode_sample(kind: str, enc: list) -> Sample:
    t = KIND_TYPE.get(kind)
    if t is None:
        raise LatencyProfileError(f"unknown sample kind {kind!r}")
    if t in (AttentionSample, LayerSample, PrefillStepSample):
        q, c, sec = enc
        s = t(tuple(int(v) for v in q), tuple(int(v) for v in c), float(sec))
        check_batch(s.query_lens, s.context_lens)
    elif t is StepOverheadSample:
        k, w, sec = enc
        s = t(int(k), int(w), float(sec))
        if s.compositions < 1 or s.composed_works < s.compositions:
            raise ValueError(f"need 1 <= compositions <= composed_works: {s!r}")
    elif t is WarmDecodeStepSample:
        c, k, sec = enc
        if not isinstance(k, int) or isinstance(k, bool):
            raise ValueError(f"a warm decode step sample's streak must be a whole number, got {k!r}")
        s = t(tuple(int(v) for v in c), k, float(sec))
        check_batch((1,) * len(s.context_lens), s.context_lens)
        if s.streak < 1:
            raise ValueError(f"a warm decode step sample needs streak >= 1: {s!r}")
    elif t is DecodeStepSample:
        c, sec = enc
        s = t(tuple(int(v) for v in c), float(sec))
        check_batch((1,) * len(s.context_lens), s.context_lens)
    else:
        n, sec = enc
        s = t(int(n), float(sec))
    check_seconds(s.seconds)
    return s


# --------------------------------------------------------------------------------------
# The file


def write_document(doc: dict, path: str | os.PathLike) -> Path:
    """Write ``doc`` as JSON to ``path`` atomically (temp file + rename). Returns the path.
    Raises ``IsADirectoryError`` / ``OSError``."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_document(path: str | os.PathLike) -> object:
    """The parsed JSON of a profile file. Raises :class:`LatencyProfileError` when the file is
    missing, unreadable or not JSON (the message says what to do)."""
    path = Path(path)
    try:
        text = path.read_bytes()
    except FileNotFoundError:
        raise LatencyProfileError(
            f"no latency profile at {path}; run the profiler to create one") from None
    except OSError as e:
        raise LatencyProfileError(f"cannot read latency profile {path}: {e}") from e
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError, absurd nesting
        raise LatencyProfileError(f"corrupt latency profile {path}: invalid JSON ({type(e).__name__}: "
                                  f"{str(e)[:200]}); delete it or run `laser profile`") from e


def check_setup(path: str | os.PathLike, have: dict, expect: dict) -> None:
    """Raise :class:`LatencyProfileError` unless every non-None ``expect[k]`` equals ``have[k]``
    (the profile's metadata: the setup it was measured on)."""
    bad = [f"{k}: profile has {have.get(k)!r}, expected {v!r}" for k, v in expect.items()
           if v is not None and have.get(k) != v]
    if bad:
        raise LatencyProfileError(f"latency profile {path} is for another setup ({'; '.join(bad)})")


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", str(s)).strip("_") or "x"


def default_profile_path(model_id: str, dtype: str, hardware: str, threads: int, executor: str = "eager") -> Path:
    """``$LASER_CACHE_DIR/profiles/<model>__<dtype>__<hardware>__t<threads>[__<executor>].json``
    (default cache dir ``~/.cache/laser``; the executor-path label is left out for ``"eager"``).
    Long hardware strings are shortened with a hash."""
    root = os.environ.get("LASER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "laser")
    hw = _slug(hardware)
    if len(hw) > 40:
        hw = hw[:32] + "-" + hashlib.sha1(hardware.encode()).hexdigest()[:7]
    path = "" if executor in (None, "", "eager") else f"__{_slug(executor)}"
    name = f"{_slug(model_id)}__{_slug(dtype)}__{hw}__t{int(threads)}{path}.json"
    return Path(root) / "profiles" / name


def cpu_hardware_string() -> str:
    """A short description of this CPU for profile metadata (best effort, torch-free)."""
    import platform

    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name or platform.processor() or platform.machine()} ({os.cpu_count()} cpus)"
