"""How far apart are two finished runs' students on the same held-out text? Paired, per sequence.

``python -m studies.paired_heldout REFERENCE_RUN RUN [RUN ...] [--long [--long-seqs N] [--from N ...]] [--ablate] [--pairs] [--out FILE]``

Runs made from one trained student (say ``allocation.softmax_layers`` = 0, 1, 2, 3 on the same
layers) have no training seed to vary, so an interval over seeds does not exist for them. What
can be said with an interval is how their losses differ on the held-out text: every run's
evaluated student (``student_finetuned/``, ``student_distilled/`` or ``student/``, the last one the
pipeline wrote) scores each held-out sequence of the reference run's data, and each run's
difference from the reference is averaged over sequences with a two-sided 95 % Student-t
interval (sequences as the unit: tokens within a sequence are not independent). ``--long`` scores
the long-context sequences instead (``eval.long_seq_len`` × ``eval.long_context_seqs``) and
reports the difference at positions ≥ 512 as well (``--from 512 1024``: at ≥ 512 and at ≥ 1024);
``--ablate`` adds, for every hybrid run, its student with the linear part removed (window and sinks
only), paired against the same run. The interval is over text, not over training runs: it says
whether the students differ on this distribution, not whether a retrained student would.

``--pairs C1 S1 C2 S2 ...`` answers that second question when each student Sᵢ has its own
control Cᵢ trained on the same text (say, KL-distilled from the same offset): per pair the
difference Sᵢ − Cᵢ on every sequence, averaged (with its interval over sequences), then the mean
over pairs with a 95 % t interval over pairs (n − 1 degrees of freedom): training runs as the unit.
Every run's per-sequence losses are kept in ``paired_losses.json`` in its directory, keyed by the
text, the student's weights and the variant, so a second study over the same runs scores nothing
again. Prints markdown; ``--out`` writes it.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
from pathlib import Path

import torch

from dofla.report import mean_ci, run_config

FINAL = ("student_finetuned", "student_distilled", "student")


def final_student(run: Path) -> Path:
    """The student directory the run evaluated: the last stage's output."""
    for name in FINAL:
        if (run / name / "config.json").exists():
            return run / name
    raise SystemExit(f"{run} holds no student directory ({', '.join(FINAL)}); run it to the end first")


@torch.no_grad()
def sequence_losses(model, tokens: torch.Tensor, start: int = 0) -> list[float]:
    """Mean next-token loss of each sequence of ``tokens`` (S, L), over predicted positions ≥ ``start``."""
    return losses_from(model, tokens, [start])[start]


@torch.no_grad()
def losses_from(model, tokens: torch.Tensor, starts: list[int]) -> dict[int, list[float]]:
    """:func:`sequence_losses` for every start in ``starts`` from one forward per sequence."""
    out = {s: [] for s in starts}
    for row in tokens:
        logits = model(input_ids=row[None], use_cache=False).logits[0, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits, row[1:], reduction="none")
        for s in starts:
            out[s].append(nll[s:].mean().item())
    return out


def scored(run: Path, tokens: torch.Tensor, starts: list[int], ablate: bool = False, model=None):
    """:func:`losses_from` for the run's final student (``ablate``: without its linear part), read
    from ``paired_losses.json`` when these tokens were scored by these weights before. ``model``: the
    loaded student, when the caller has it. Returns (losses, the model or None when nothing was loaded)."""
    from dofla.eval import without_linear_part
    from dofla.models import load_student

    student = final_student(run)
    weights = sorted(student.glob("*.safetensors")) or sorted(student.glob("*.bin"))
    stamp = [(w.name, w.stat().st_mtime_ns, w.stat().st_size) for w in weights]
    key = hashlib.sha256(json.dumps([student.name, stamp, ablate]).encode()
                         + tokens.to(torch.int64).numpy().tobytes()).hexdigest()[:16]
    path = run / "paired_losses.json"
    store = json.loads(path.read_text()) if path.exists() else {}
    kept = store.get(key, {})
    if all(str(s) in kept for s in starts):
        return {s: kept[str(s)] for s in starts}, model
    model = model if model is not None else load_student(student)
    with without_linear_part(model) if ablate else contextlib.nullcontext():
        losses = losses_from(model, tokens, starts)
    store[key] = {**kept, **{str(s): v for s, v in losses.items()}}
    path.write_text(json.dumps(store))
    return losses, model


def is_hybrid(run: Path) -> bool:
    """Whether the run's final student has hybrid layers (window + sinks + a linear part)."""
    config = json.loads((final_student(run) / "config.json").read_text())
    return config.get("dofla", {}).get("attention") == "hybrid"


def held_out(run: Path, long: bool, long_seqs: int | None = None) -> torch.Tensor:
    """The reference run's held-out sequences (or its long-context ones: ``long_seqs`` of them, the
    run's ``eval.long_context_seqs`` by default; the first ones are the run's own)."""
    import dataclasses

    from dofla.models import load_student_tokenizer
    from dofla.pipeline import heldout_tokens, long_heldout_tokens

    cfg = run_config(run)
    if long_seqs:
        cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, long_context_seqs=long_seqs))
    tokenizer = load_student_tokenizer(final_student(run))
    return long_heldout_tokens(cfg, tokenizer) if long else heldout_tokens(cfg, tokenizer)


def starts_for(long: bool, length: int, late=(512,)) -> list[int]:
    """The positions each difference is taken from: 0, and with ``long`` every ``late`` start inside the text."""
    return [0] + sorted({s for s in late if 0 < s < length}) if long else [0]


def compare(runs: list[Path], long: bool = False, ablate: bool = False, long_seqs: int | None = None,
            late=(512,)) -> str:
    """The markdown table. With ``ablate``, every run with hybrid layers also gets a row for its
    student with the linear part removed (window and sinks only), paired against the same run:
    how much the linear part lowers the loss."""
    tokens = held_out(runs[0], long, long_seqs)
    starts = starts_for(long, tokens.shape[1], late)
    rows = []  # (label, per-start per-sequence losses, index of the row it is paired with)
    for run in runs:
        losses, model = scored(run, tokens, starts)
        rows.append((run.name, losses, 0))
        if ablate and is_hybrid(run):
            removed, model = scored(run, tokens, starts, ablate=True, model=model)
            rows.append((f"{run.name}, linear part removed (vs itself)", removed, len(rows) - 1))
        del model
    lines = [f"{tokens.shape[0]} held-out sequences of {tokens.shape[1]} tokens (the data of {runs[0]}); "
             "mean next-token loss in nats; difference from the first run (an ablation row: from its own "
             "run), mean over sequences ± 95 % t interval (sequences as the unit)", "",
             "| run | " + " | ".join(f"loss (positions ≥ {s}) | difference" for s in starts) + " |",
             "|---|" + "---|---|" * len(starts)]
    for index, (label, loss, paired) in enumerate(rows):
        cells = []
        for s in starts:
            diff, half = mean_ci([a - b for a, b in zip(loss[s], rows[paired][1][s])])
            cells += [f"{sum(loss[s]) / len(loss[s]):.4f}", "–" if index == 0 else f"{diff:+.4f} ± {half:.4f}"]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare_pairs(pairs: list[tuple[Path, Path]], long: bool = False, ablate: bool = False,
                  long_seqs: int | None = None, late=(512,)) -> str:
    """The markdown table of matched (control, student) pairs: each pair's mean difference over
    sequences (± its interval over sequences), then the mean over pairs ± a 95 % t interval over pairs.
    With ``ablate``, each hybrid student's linear-part gain (removed − kept) beside it, the same way."""
    tokens = held_out(pairs[0][0], long, long_seqs)
    starts = starts_for(long, tokens.shape[1], late)
    columns = [("student − control", s) for s in starts]
    if ablate:
        columns += [("linear part's gain", s) for s in starts]
    per_pair = []  # per pair: per column, the per-sequence differences
    for control, student in pairs:
        base, _ = scored(control, tokens, starts)
        losses, model = scored(student, tokens, starts)
        diffs = [[a - b for a, b in zip(losses[s], base[s])] for s in starts]
        if ablate:
            if not is_hybrid(student):
                raise SystemExit(f"--ablate needs hybrid students; {student} has no linear part to remove")
            removed, model = scored(student, tokens, starts, ablate=True, model=model)
            diffs += [[a - b for a, b in zip(removed[s], losses[s])] for s in starts]
        del model
        per_pair.append(diffs)
    lines = [f"{len(pairs)} matched pairs; {tokens.shape[0]} held-out sequences of {tokens.shape[1]} tokens (the "
             f"data of {pairs[0][0]}); mean difference in next-token loss (nats). Per pair ± 95 % t over "
             f"sequences; the last row ± 95 % t over pairs ({len(pairs) - 1} degrees of freedom)", "",
             "| pair | " + " | ".join(f"{name} (positions ≥ {s})" for name, s in columns) + " |",
             "|---|" + "---|" * len(columns)]
    means = []
    for (control, student), diffs in zip(pairs, per_pair):
        cells = [mean_ci(d) for d in diffs]
        means.append([m for m, _ in cells])
        lines.append(f"| {student.name} − {control.name} | " + " | ".join(f"{m:+.4f} ± {h:.4f}" for m, h in cells) + " |")
    over = [mean_ci([row[c] for row in means]) for c in range(len(columns))]
    lines.append(f"| mean over {len(pairs)} pairs | " + " | ".join(
        f"**{m:+.4f}**" + ("" if h is None else f" ± {h:.4f}") for m, h in over) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="finished run directories; the first is the reference "
                        "(with --pairs: control, student, control, student, ...)")
    parser.add_argument("--pairs", action="store_true",
                        help="the runs are matched (control, student) pairs: the mean over pairs, training runs as the unit")
    parser.add_argument("--long", action="store_true", help="the long-context sequences, also from position 512")
    parser.add_argument("--long-seqs", type=int, default=None,
                        help="with --long: this many long sequences (default: the run's eval.long_context_seqs)")
    parser.add_argument("--from", dest="late", type=int, nargs="+", default=[512],
                        help="with --long: also the difference over positions ≥ each of these (default: 512)")
    parser.add_argument("--ablate", action="store_true",
                        help="also each hybrid run without its linear part, paired against itself")
    parser.add_argument("--out", default=None, help="write the markdown here too")
    args = parser.parse_args(argv)
    if len(args.runs) < 2:
        parser.error("give a reference run and at least one run to compare with it")
    if args.pairs and len(args.runs) % 2:
        parser.error(f"--pairs takes control, student pairs: {len(args.runs)} runs is an odd number")
    runs = [Path(r) for r in args.runs]
    if args.pairs:
        text = compare_pairs(list(zip(runs[::2], runs[1::2])), args.long, args.ablate, args.long_seqs, args.late)
    else:
        text = compare(runs, args.long, args.ablate, args.long_seqs, args.late)
    flags = (" --long" if args.long else "") + (f" --long-seqs {args.long_seqs}" if args.long_seqs else "")
    flags += f" --from {' '.join(map(str, args.late))}" if args.long and args.late != [512] else ""
    flags += " --ablate" if args.ablate else ""
    flags += " --pairs" if args.pairs else ""
    command = "python -m studies.paired_heldout " + " ".join(args.runs) + flags
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(f"`{command}`\n\n{text}\n")


if __name__ == "__main__":
    main()
