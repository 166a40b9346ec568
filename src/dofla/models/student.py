"""Convert a teacher into a linear-attention student that is still a Hugging Face model.

``convert`` attaches a :class:`StudentAttention` to every attention module, routes attention
through ``dofla_linear`` and records the conversion in ``config.dofla``. ``save_pretrained`` then
writes the teacher weights, the feature parameters and the dims; :func:`load_student` rebuilds the
same model; ``generate()`` decodes with a :class:`RecurrentStateCache` (fixed size, except for the
softmax reference, which keeps its keys/values like the teacher's own cache).

What each layer becomes:

- the requested ``attention`` ("linear", "hybrid", "sliding_window" or "gated_delta"), or the exact softmax
  reference for ``feature_map="softmax"``;
- except teacher layers that already use a sliding window (``geometry.layer_windows[i]`` = W,
  e.g. Gemma 2's local layers, Mistral): they become exact sliding-window softmax with window W,
  no sinks and no features, whatever was requested. Such a layer never sees beyond W tokens and
  is already O(W) in memory, so there is nothing to linearize, and an exact copy costs nothing in
  quality. Their ``dims`` entries are ignored. (The softmax reference keeps them as the teacher
  has them, through the teacher's own mask.)
- the teacher's logit ``softcap`` (``geometry.softcap``, Gemma 2) is applied wherever scores
  are exact (softmax and sliding modes); linear features cannot express it.
"""
from __future__ import annotations

import functools
import inspect
import tempfile
from dataclasses import asdict
from pathlib import Path

import huggingface_hub
from transformers import AutoModelForCausalLM, PreTrainedModel

from dofla.models.adapters import get_adapter
from dofla.models.decoding import cache_keyword, take_cache
from dofla.models.export_format import export_student, student_config
from dofla.models.layers import given_plan, install_linear_attention
from dofla.models.plan import expand
from dofla.models.spec import ConversionSpec
from dofla.models.recurrent_cache import RecurrentStateCache
from dofla.models.student_attention import ATTN_IMPLEMENTATION, StudentAttention

class StudentMixin:
    """Mixed into the teacher's own class: installs linear attention and its decoding cache."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        spec = getattr(config, "dofla", None)
        if spec is not None:
            install_linear_attention(self, ConversionSpec(**spec))

    def student_attentions(self) -> list[StudentAttention]:
        return [module.dofla for module in get_adapter(self).attention_modules(self)]

    def forward(self, *args, **kwargs):
        name = cache_keyword(_forward_signature(type(self)))
        cache = take_cache(kwargs)
        use_cache = kwargs.get("use_cache")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if cache is None and use_cache:
            cache = RecurrentStateCache(len(self.student_attentions()))
        if cache is not None and not isinstance(cache, RecurrentStateCache):
            raise TypeError(
                f"a dofla student decodes with RecurrentStateCache, got {type(cache).__name__}; "
                f"pass {name}=None and let the model create its cache"
            )
        if cache is not None:
            kwargs[name] = cache
        students = self.student_attentions()
        key_valid = self._new_tokens_valid(args, kwargs, cache, students)
        for i, student in enumerate(students):
            student.cache_layer = None if cache is None else cache.layers[i]
            student.key_valid = key_valid
            if cache is not None:
                cache.layers[i].keep_kv = student.keeps_kv_cache
        try:
            return super().forward(*args, **kwargs)
        finally:
            for student in students:
                student.cache_layer = student.key_valid = None

    def _new_tokens_valid(self, args, kwargs, cache, students):
        """(B, T_new) bool from the 2D ``attention_mask`` (B, seen + T_new): False at padded new
        tokens; None when nothing is padded (or only the softmax reference, which uses HF's mask)."""
        given = kwargs if not args else _bind_forward(type(self), self, args, kwargs)
        mask = given.get("attention_mask")
        if mask is None or all(s.keeps_kv_cache for s in students):
            return None
        if mask.ndim != 2:
            raise ValueError(f"a dofla student reads padding from a 2D (batch, tokens) attention_mask, got "
                             f"{mask.ndim}D; pass the 2D padding mask instead")
        tokens = given.get("input_ids")
        length = (given["inputs_embeds"] if tokens is None else tokens).shape[1]
        seen, width = (0 if cache is None else cache.get_seq_length()), mask.shape[-1]
        if width >= seen + length:
            new = mask[:, seen:seen + length]
        elif width == length:
            new = mask
        else:
            raise ValueError(f"attention_mask has {width} columns but {seen} tokens are cached and {length} are "
                             f"new; pass a (batch, {seen + length}) mask")
        new = new.bool()
        return None if bool(new.all()) else new

    def save_pretrained(self, save_directory, is_main_process: bool = True, *args, push_to_hub: bool = False,
                        **kwargs):
        """Hugging Face's save, then the export (own model type, remote code, model card): loaded
        elsewhere the directory is this student, never its teacher (see dofla.models.hub_export)."""
        repo_id = kwargs.pop("repo_id", None)
        hub = {k: kwargs.pop(k) for k in ("commit_message", "private", "token", "create_pr") if k in kwargs}
        super().save_pretrained(save_directory, is_main_process, *args, **kwargs)
        if is_main_process:
            export_student(save_directory)
        if push_to_hub:
            self.push_to_hub(repo_id or Path(save_directory).name, **hub)

    def push_to_hub(self, repo_id: str, *, commit_message: str | None = None, private: bool | None = None,
                    token=None, revision: str | None = None, create_pr: bool = False, **save_kwargs):
        """Save the exported student (with its model card) to a temporary directory and upload it.
        Hugging Face's own push would replace the model card with an empty one."""
        api = huggingface_hub.HfApi(token=token)
        repo_id = api.create_repo(repo_id, private=private, exist_ok=True).repo_id
        with tempfile.TemporaryDirectory() as folder:
            self.save_pretrained(folder, **save_kwargs)
            return api.upload_folder(repo_id=repo_id, folder_path=folder, revision=revision, create_pr=create_pr,
                                     commit_message=commit_message or "Upload dofla linear-attention student")

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        name = cache_keyword(_forward_signature(type(self)))
        cache = take_cache(model_kwargs)
        if cache is None and generation_config.use_cache is not False:
            cache = RecurrentStateCache(len(self.student_attentions()))
        if cache is not None:
            model_kwargs[name] = cache
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)


def _bind_forward(cls, model, args, kwargs) -> dict:
    """The teacher forward's arguments by name (positional order differs: GPT-2 vs Llama)."""
    arguments = _forward_signature(cls).bind_partial(model, *args, **kwargs).arguments
    return {**arguments.pop("kwargs", {}), **arguments}


@functools.cache
def _forward_signature(cls) -> inspect.Signature:
    return inspect.signature(super(StudentMixin, cls).forward)


@functools.cache
def student_class(base: type[PreTrainedModel]) -> type[PreTrainedModel]:
    """The student class for a teacher class, e.g. LlamaForCausalLM -> LinearLlamaForCausalLM.

    ``forward`` shows the teacher's signature: ``generate()`` only derives ``position_ids`` from
    the attention mask (left padding) for a forward that names them.
    """

    @functools.wraps(base.forward)
    def forward(self, *args, **kwargs):
        return StudentMixin.forward(self, *args, **kwargs)

    return type(f"Linear{base.__name__}", (StudentMixin, base), {"__module__": __name__, "forward": forward})


def convert(
    model: PreTrainedModel,
    feature_map: str = "learned_prf",
    dims: list | None = None,
    feature_map_options: dict | None = None,
    chunk_size: int = 128,
    seed: int = 0,
    window: int = 0,
    attention: str = "linear",
    sinks: int = 0,
    softmax_layers: list | None = None,
    gate: str = "none",
    linear_scale: str = "fixed",
    plan=None,
) -> PreTrainedModel:
    """Turn ``model`` (in place) into a student and return it.

    ``attention`` picks what replaces softmax in the teacher's global layers:

    - ``"linear"`` (the paper's): ``feature_map`` with ``dims``: one feature dimension per layer
      (default: the head size everywhere, the paper's ``fix`` policy), or for a layer a list of
      per-head dims (heads of equal dim share one block). A ``window`` > 0 here means hybrid
      (what it meant before ``attention`` existed).
    - ``"hybrid"``: exact softmax over the last ``window`` tokens (and the first ``sinks``),
      linear attention before.
    - ``"sliding_window"``: exact softmax over the first ``sinks`` valid tokens and the last
      ``window`` tokens, training-free; ``feature_map`` and ``dims`` are ignored.
    - ``"gated_delta"``: the gated delta rule with ``feature_map``'s features of ``dims`` (one int
      per layer: the state is dims[i]×head_dim per head) and its own gates; with a ``window`` > 0 the
      hybrid whose older tokens live in the delta state (dofla.attention.delta_hybrid).

    ``feature_map="softmax"`` swaps in the exact softmax reference instead (no window, no sinks);
    ``softmax_layers`` keeps the listed layers of a linear, hybrid or sliding-window student exact (they
    keep a KV cache; a teacher's own sliding-window layer keeps its window);
    ``gate="scalar"`` gives each linear or hybrid layer a per-head decay of its linear state, starting
    closed (no decay); ``linear_scale="learned"`` gives each hybrid layer a per-head weight e^β of its
    linear part against the exact window, starting at 1.
    ``plan`` gives every KV head of every layer its own attention instead (a
    :class:`~dofla.models.plan.StudentPlan`, its list of layers, or the path of a JSON or YAML file;
    :mod:`dofla.models.plan`); it replaces the settings above but ``feature_map``, its options, the
    chunk size and the seed. The saved config records the plan either way.
    The teacher weights are shared, not copied; deep-copy the teacher first to keep it.
    """
    if isinstance(model, StudentMixin):
        raise ValueError("model is already a dofla student; convert its teacher instead")
    geometry = get_adapter(model).geometry(model.config)
    if plan is not None:
        given = given_plan(plan, geometry, dims=dims, window=window, attention=attention, sinks=sinks,
                           softmax_layers=softmax_layers, gate=gate, linear_scale=linear_scale)
        dims = given.dims(geometry.num_heads // geometry.num_kv_heads)
    dims = [geometry.head_dim] * geometry.num_layers if dims is None else [_layer_dims(m) for m in dims]
    spec = ConversionSpec(dims, feature_map, dict(feature_map_options or {}), chunk_size, seed, window,
                          attention=attention, sinks=sinks, softmax_layers=sorted(softmax_layers or []), gate=gate,
                          linear_scale=linear_scale)
    spec.plan = (given if plan is not None else expand(spec, geometry)).to_list()
    device = next(model.parameters()).device
    install_linear_attention(model, spec)
    model.config.dofla = asdict(spec)
    model.__class__ = student_class(type(model))
    return model.to(device)


def _layer_dims(m):
    return int(m) if isinstance(m, (int, float)) else [int(x) for x in m]


def load_student(path: str | Path, **kwargs) -> PreTrainedModel:
    """Load a student saved with ``save_pretrained`` (weights, feature parameters, dims) from a
    directory or a hub repository; directories saved before the export format load too."""
    hub = {k: kwargs[k] for k in ("revision", "token", "cache_dir", "local_files_only") if k in kwargs}
    config = student_config(path, **hub)
    base = AutoModelForCausalLM._model_mapping[type(config)]
    model = student_class(base).from_pretrained(path, config=config, **kwargs)
    model.config._attn_implementation = ATTN_IMPLEMENTATION
    return model.eval()
