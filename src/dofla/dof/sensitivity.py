"""Each menu option's measured value at each KV head: what switching that one head to it buys.

The two signals are what a user loses when heads stop being exact: the model's KL(teacher ‖ student) per
predicted token on calibration sequences (from the training split: the caller hands them in, never the
held-out text), and a retrieval signal, the nats the student spends on the answers of passkey prompts
(:func:`dofla.dof.softmax_layers.passkey_prompts`, the eval probe's format with other keys and depths)
or, without a tokenizer, on a span copied from far back (:func:`copy_prompts`).

Design, for an affordable measurement: every head starts at the baseline, the cheapest option that needs
no fitting (a window with sinks, no state); option o at head h is measured as the student with that head
alone switched to o, and its value is the drop in each signal from the baseline student. That is one
student and (batches + prompts) forwards per head and non-baseline option, and the baseline once. A
linear state is measured after brief layerwise fitting of its features on the teacher's own activations
of the same calibration sequences (``fit_steps``; the layerwise stage's output loss): an unfitted state
measures its random start, not what training reaches, so it would be undervalued against windows and exact
heads that need no training. By default (``fit_target="full"``) a head's state of one M is fitted once,
against the teacher's full attention (no window, no sinks), and serves every window it is paired with: a
quarter of the default menu's fits; ``"own"`` fits each option with its own window and sinks. DoF does not size the states here:
the trained quality per M is what the knapsack must trade against bytes, and the fit measures it directly
(the ``dof_head`` allocation remains the training-free alternative). Heads measured one at a time need not
add up; :mod:`dofla.dof.allocator` re-measures the chosen plan and reports the gap.

The teacher's logits are computed once per calibration batch and kept for every student; the students
share the teacher's weights (only their attention modules are new), so measuring costs no model copies.
:class:`Cost` counts the forwards, the decoder layers they ran, the students, the fitting steps and the seconds.

Prefix reuse (``reuse_prefix``, the default): a student that differs from the baseline from layer l on
computes layers 0..l-1 exactly as the baseline student does, so the baseline student's forward records every
decoder layer's output on every calibration batch and prompt (:meth:`Probe.baseline`) and each later student
runs layers l.. alone from them (:mod:`dofla.dof.replay`): a head of layer l costs L - l layers a forward
instead of L, about half the measurement's layer forwards on a deep model. The record takes layers ×
(S × L + the prompts' tokens) × hidden numbers of the model's dtype on the probe's device (SmolLM2-135M with
8 calibration sequences and 8 prompts of 2,048 tokens: 30 × 32,768 × 576 float32, 2.3 GB) and lives as long
as the probe. ``reuse_prefix=False`` runs every student whole: the plain reference.

Options measured before (``known``): a menu that extends one measured on the same teacher, calibration, fits
and baseline measures its new options alone and takes the others' signals from the earlier measurement, as
they would measure again (each is the baseline student with one head switched, its state fitted the same way
from the same seed). The baseline is measured every time and must match the earlier one's, or nothing is
taken over.
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass

import torch

from dofla.dof.menu import reusable
from dofla.dof.replay import decoder_layers, recording, replaying, timing
from dofla.dof.softmax_layers import copy_probe, copying_scores
from dofla.eval.longctx import answer_nll
from dofla.models.adapters.support import get_adapter
from dofla.models.capture import capture_qkv
from dofla.models.mixed_attention import MixedAttention
from dofla.models.plan import StudentPlan
from dofla.models.student import convert
from dofla.train.distill import kl_to_teacher
from dofla.train.layerwise import LayerTrainConfig, train_layer


@dataclass
class Cost:
    """What a measurement spent: forwards of the teacher and of the students (one batch or prompt each, whole
    or from a replayed prefix), the decoder layers the students' forwards ran, students built, layerwise
    fitting steps, and wall-clock seconds (the forwards' share, of it the decoder layers', and the fits' apart)."""

    seconds: float = 0.0
    teacher_forwards: int = 0
    student_forwards: int = 0
    layer_forwards: int = 0  # decoder layers run by the students' forwards (a replayed layer does not run)
    forward_seconds: float = 0.0  # of ``seconds``: the students' forwards
    # of ``forward_seconds``: inside the decoder layers that ran (the rest: embeddings, head, loss); timed with
    # ``reuse_prefix`` alone (0 otherwise: every forward runs all the layers, so the forward is the unit)
    layer_seconds: float = 0.0
    students: int = 0
    reused: int = 0  # (unit, option) signals taken from a measurement made before (``known``), not measured
    fit_steps: int = 0
    fit_seconds: float = 0.0  # of ``seconds``: the layerwise fits of linear states

    def to_dict(self) -> dict:
        return asdict(self)


def copy_prompts(tokens: torch.Tensor, start: int = 8, span: int = 16) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(prompt (1, P), answer (1, A)) per row of ``tokens``: the row with its span [start, start + span)
    repeated at the end, the repeat as the answer (:func:`dofla.dof.softmax_layers.copy_probe`)."""
    probe, span = copy_probe(tokens, start, span)
    return [(row[None, :-span], row[None, -span:]) for row in probe]


class Probe:
    """A teacher, calibration ``tokens`` (S, L) and retrieval ``prompts``: builds, fits and measures students
    of any plan, and counts what that costs (``cost``)."""

    def __init__(self, teacher, tokens: torch.Tensor, prompts: list, cfg):
        self.teacher, self.prompts, self.cfg = teacher.eval(), prompts, cfg
        self.geometry = get_adapter(teacher).geometry(teacher.config)
        self.device = next(teacher.parameters()).device
        self.cost = Cost()
        self.base_plan, self.recorded = None, None  # the baseline's plan and its layers' outputs (per input)
        self._fits: dict[tuple, dict] = {}  # fitted features by (layer, KV heads, state, M, gate[, window])
        start = time.perf_counter()
        with torch.no_grad():
            self.batches = [b.to(self.device) for b in tokens.split(cfg.batch_size)]
            self.targets = [teacher(input_ids=b, use_cache=False).logits for b in self.batches]
            self.cost.teacher_forwards += len(self.batches)
            self.captured = capture_qkv(teacher, tokens.to(self.device)) if cfg.fit_steps else None
            self.cost.teacher_forwards += int(cfg.fit_steps > 0)
        self.cost.seconds += time.perf_counter() - start

    def student(self, plan: StudentPlan):
        """The student of ``plan`` on the teacher's weights (shared, not copied), its linear states fitted."""
        shared = {id(p): p for p in self.teacher.parameters()}  # deepcopy keeps these: no weight copies
        model = convert(copy.deepcopy(self.teacher, memo=shared), feature_map=self.cfg.feature_map,
                        seed=self.cfg.seed, plan=plan)
        self.cost.students += 1
        if self.cfg.fit_steps:
            for i, layer in enumerate(model.student_attentions()):
                for part, heads, kv in _trainable_parts(layer):
                    self._fit(part, i, heads, kv, plan.layers[i][kv[0]])
        return model.eval()

    def _fit(self, part, layer: int, heads: list[int], kv: list[int], head) -> None:
        """Fit ``part`` (KV heads ``kv`` of ``layer``, of plan ``head``), or load the same fit made before
        (module docstring: ``fit_target``)."""
        full = self.cfg.fit_target == "full"
        key = (layer, tuple(kv), head.state, head.M, head.gate, None if full else (part.window, part.sinks))
        if key in self._fits:
            part.feature_map.load_state_dict(self._fits[key])
            return
        q, k, v = self.captured[layer]
        cfg = LayerTrainConfig(steps=self.cfg.fit_steps, batch_size=self.cfg.fit_batch_size, loss="output",
                               eval_every=self.cfg.fit_steps, warmup_steps=min(5, self.cfg.fit_steps),
                               window=0 if full else part.window, sinks=0 if full else part.sinks,
                               seed=self.cfg.seed, heldout_fraction=0.25, log_every=10 ** 9,
                               checkpoint_every=10 ** 9)
        start = time.perf_counter()
        with torch.enable_grad():
            train_layer(part.feature_map, q[:, heads], k[:, kv], cfg, v=v[:, kv], desc=f"fit layer {layer}",
                        layer=layer)
        self._fits[key] = {n: t.detach().clone() for n, t in part.feature_map.state_dict().items()}
        self.cost.fit_steps += self.cfg.fit_steps
        self.cost.fit_seconds += time.perf_counter() - start

    @torch.no_grad()
    def baseline(self, plan: StudentPlan) -> dict:
        """:meth:`signals` of the baseline ``plan``; with ``reuse_prefix`` its layers' outputs are recorded
        for the students measured after it (module docstring)."""
        if not self.cfg.reuse_prefix:
            return self.signals(plan)
        self.base_plan, self.recorded = None, None
        return self.signals(plan, record=True)

    @torch.no_grad()
    def signals(self, plan: StudentPlan, record: bool = False) -> dict:
        """{"kl": KL per predicted token on the calibration batches, "nll": mean answer nats per prompt}."""
        start = time.perf_counter()
        model = self.student(plan)
        first = self._first_change(plan)
        layers = decoder_layers(model) if self.cfg.reuse_prefix else []  # the plain path needs no layer list
        inputs = [(b, t) for b, t in zip(self.batches, self.targets)] + list(self.prompts)
        forward_start = time.perf_counter()
        with recording(layers if record else []) as records, timing(layers[first:]) as spent:
            results = [self._forward(model, layers, first, n, *pair) for n, pair in enumerate(inputs)]
        if record:
            self._keep(plan, records, len(inputs))
        self.cost.forward_seconds += time.perf_counter() - forward_start
        self.cost.layer_seconds += spent[0]
        self.cost.student_forwards += len(inputs)
        self.cost.layer_forwards += len(inputs) * (self.geometry.num_layers - first)
        self.cost.seconds += time.perf_counter() - start
        kl = sum(results[:len(self.batches)]) / sum(b.numel() for b in self.batches)
        return {"kl": kl, "nll": sum(results[len(self.batches):]) / max(len(self.prompts), 1)}

    def _forward(self, model, layers, first: int, n: int, tokens, other) -> float:
        """Input ``n``'s summed KL (a calibration batch, ``other`` its teacher logits) or answer nats (a
        prompt, ``other`` its answer), layers 0..``first``-1 replayed from the baseline's record."""
        with replaying(layers, self.recorded[n] if first else [], first):
            if n < len(self.batches):
                return kl_to_teacher(model(input_ids=tokens, use_cache=False).logits, other).item() * tokens.numel()
            return answer_nll(model, tokens.to(self.device), other.to(self.device))

    def _first_change(self, plan: StudentPlan) -> int:
        """The first layer where ``plan`` leaves the recorded baseline (0 without a record; L: none)."""
        if self.recorded is None:
            return 0
        return next((i for i, (a, b) in enumerate(zip(plan.layers, self.base_plan.layers)) if tuple(a) != tuple(b)),
                    self.geometry.num_layers)

    def _keep(self, plan: StudentPlan, records: list, inputs: int) -> None:
        if any(len(r) != inputs for r in records):
            raise ValueError("the model ran a decoder layer other than once per forward, so its layers cannot be "
                             "replayed; set budget.reuse_prefix=false")
        self.base_plan, self.recorded = plan, [[r[n] for r in records] for n in range(inputs)]


def _trainable_parts(layer) -> list:
    """(part, query heads, KV heads) of each part of a layer with features to fit."""
    if isinstance(layer, MixedAttention):
        return layer.trainable_parts()
    if layer.feature_map is None:
        return []
    return [(layer, list(range(layer.num_heads)), list(range(layer.num_kv_heads)))]


def switched(layers: int, kv_heads: int, base, at: tuple[int, int], option, width: int = 1) -> StudentPlan:
    """Every head at ``base`` but ``width`` heads from ``at`` = (layer, KV head) on at ``option``."""
    plan = [[base] * kv_heads for _ in range(layers)]
    plan[at[0]][at[1]:at[1] + width] = [option] * width
    return StudentPlan([tuple(layer) for layer in plan])


def units(geometry, width: int) -> list[tuple[int, int]]:
    """The (layer, first KV head) of each unit that chooses one option, in order: every KV head (``width``
    1) or every layer (``width`` = its KV heads)."""
    return [(i, j) for i in range(geometry.num_layers) for j in range(0, geometry.num_kv_heads, width)]


def check_calibration(menu: list, length: int) -> None:
    """One sentence when calibration sequences of ``length`` tokens cannot tell a window of the menu from exact."""
    longest = max((o.window + o.sinks for o in menu if not o.exact), default=0)
    if length <= longest:
        raise ValueError(f"calibration sequences of {length} tokens cannot tell a window of {longest} tokens "
                         "(with sinks) from exact; give longer sequences or drop that window from the menu")


def measure_menu(probe: Probe, menu: list, base: int, heads: list | None = None, width: int = 1,
                 known: dict | None = None) -> dict:
    """Each option's signals at each unit (a KV head, or with ``width`` = the KV heads per layer a whole
    layer), one unit switched from the baseline option ``menu[base]``.

    Returns {"base": signals of the all-baseline student, "signals": [[{"kl", "nll"} per option] per unit]}
    with units in order (:func:`units`); the baseline option's entry is the base student's, not remeasured.
    ``heads`` (layer, first KV head) pairs measures those alone (the others' entries are None): a sample to time.
    ``known``: a measurement made before with the same probe settings, {"menu": [option labels], "base",
    "signals"} (module docstring): the options it holds are taken from it where its baseline matches.
    """
    g = probe.geometry
    check_calibration(menu, probe.batches[0].shape[1])
    layers = switched(g.num_layers, g.num_kv_heads, menu[base], (0, 0), menu[base])
    reference = probe.baseline(layers)
    before = reusable(known, menu, reference)
    signals = []
    for n, unit in enumerate(units(g, width)):
        if heads is not None and unit not in heads:
            signals.append(None)
            continue
        row = known["signals"][n] if before else None  # None: the earlier measurement sampled other units
        signals.append([reference if o == base else _known(probe, row[before[o]]) if row and o in before else
                        probe.signals(switched(g.num_layers, g.num_kv_heads, menu[base], unit, option, width))
                        for o, option in enumerate(menu)])
    return {"base": reference, "signals": signals}


def _known(probe: Probe, signals: dict) -> dict:
    """An option's signals from the earlier measurement, counted as reused."""
    probe.cost.reused += 1
    return signals


def measure_copying(probe: Probe, menu: list, width: int = 1) -> dict:
    """The third signal, read off the teacher alone (one forward of the calibration sequences, no student):
    each unit's copying (:func:`dofla.dof.softmax_layers.copying_scores`, summed over the query heads of its
    KV heads), and per option whether it keeps that copy, a key about L tokens back, exact (an exact head,
    or a window as long as the calibration sequences). The teacher's copying heads are the ones a student
    must keep exact to recall a fact from far back; the passkey-answer NLL measures one head switched at a
    time on a few prompts, the copying score every query head on every calibration sequence.

    Returns {"heads": [float per KV head], "scores": [float per unit] (order :func:`units`), "keeps": [bool
    per option], "length": L}."""
    start = time.perf_counter()
    tokens = torch.cat(probe.batches)
    per_layer = copying_scores(probe.teacher, tokens, probe.cfg.batch_size)
    probe.cost.teacher_forwards += len(probe.batches)
    g = probe.geometry
    group = g.num_heads // g.num_kv_heads
    heads = [float(per_layer[i][j * group:(j + 1) * group].sum()) for i, j in units(g, 1)]
    scores = [sum(heads[u * width:(u + 1) * width]) for u in range(len(heads) // width)]
    length = tokens.shape[1]
    keeps = [bool(o.exact or (o.window and o.window >= length)) for o in menu]
    probe.cost.seconds += time.perf_counter() - start
    return {"heads": heads, "scores": scores, "keeps": keeps, "length": int(length)}


def head_values(measured: dict, kl_weight: float, retrieval_weight: float, copying: dict | None = None,
                copy_weight: float = 0.0) -> list[list[float]]:
    """Each option's value at each head: the weighted drop of both measured signals from the baseline student,
    plus ``copy_weight`` × the head's copying where the option keeps it (:func:`measure_copying`)."""
    base = measured["base"]
    values = [[kl_weight * (base["kl"] - s["kl"]) + retrieval_weight * (base["nll"] - s["nll"]) for s in head]
              for head in measured["signals"]]
    if copy_weight:
        values = [[v + copy_weight * copying["scores"][u] * keeps for v, keeps in zip(head, copying["keeps"])]
                  for u, head in enumerate(values)]
    return values
