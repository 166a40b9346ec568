"""Do finished runs' students recall a passkey, or get closer to it? Paired, per prompt.

``python -m studies.passkey REFERENCE_RUN RUN [RUN ...] [--length 1024] [--trials 10] [--ablate] [--teacher] [--pairs] [--out FILE]``

Every run's evaluated student (the last one the pipeline wrote) answers the same ``--trials``
prompts of the pipeline's passkey probe (a seeded 5-digit key hidden at depths spread evenly over
the text, ``dofla.eval.longctx``). Per run: the share recalled exactly (greedy) and the mean answer
NLL, the nats spent on " <key>" after the prompt (a uniform guess of the digits: 11.5). Exact recall
is all or nothing and stays at 0 long after a student starts to get closer, so the NLL is the
measure that moves; each run's NLL is compared with the reference run's on the same prompts, the
mean difference with a two-sided 95 % t interval over prompts (the interval is over prompts, not
over training runs). ``--ablate`` adds each hybrid student without its linear part, paired against
the same run; ``--teacher`` adds the first run's teacher.

``--pairs C1 S1 C2 S2 ...`` compares each student Sᵢ with its own control Cᵢ (say, trained on the same
text without a linear part): per pair the keys recalled and the answer NLL difference on every
prompt (± 95 % t over prompts), then the mean over pairs with a 95 % t interval over pairs (training
runs as the unit, n − 1 degrees of freedom). Prints markdown; ``--out`` writes it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from dofla.report import mean_ci, run_config
from studies.paired_heldout import final_student, is_hybrid


def trials_of(model, tokenizer, length: int, trials: int, seed: int) -> list[tuple[bool, float]]:
    from dofla.eval import passkey_trials

    return passkey_trials(model.eval(), tokenizer, length, trials, torch.Generator().manual_seed(seed))


def rows_for(runs: list[Path], length: int, trials: int, seed: int, ablate: bool, teacher: bool):
    """(name, [(recalled, nll)] per prompt, the index of the row its NLL is paired with, None for
    the reference) for every row of the table: the teacher (``teacher``), then every run, each
    hybrid one followed by itself without its linear part (``ablate``)."""
    from dofla.eval import without_linear_part
    from dofla.models import load_student, load_student_tokenizer, load_teacher

    tokenizer = load_student_tokenizer(final_student(runs[0]))
    rows = []
    first = 1 if teacher else 0  # the reference run's row
    if teacher:
        cfg = run_config(runs[0])
        model, _ = load_teacher(cfg.model.source, cfg.model.revision)
        rows.append(("teacher", trials_of(model, tokenizer, length, trials, seed), first))
    for i, run in enumerate(runs):
        model = load_student(final_student(run))
        rows.append((run.name, trials_of(model, tokenizer, length, trials, seed), None if i == 0 else first))
        if ablate and is_hybrid(run):
            own = len(rows) - 1
            with without_linear_part(model):
                rows.append((f"{run.name}, linear part removed", trials_of(model, tokenizer, length, trials, seed),
                             own))
    return rows


def table(rows, length: int) -> str:
    lines = [f"| student | passkey @ {length} | answer NLL (nats) | NLL − its reference, 95 % t over prompts |",
             "|---|---|---|---|"]
    for name, results, reference in rows:
        nll = [n for _, n in results]
        recalled = sum(hit for hit, _ in results)
        diff = "reference"
        if reference is not None:
            ref_name, ref_results, _ = rows[reference]
            mean, half = mean_ci([a - b for a, b in zip(nll, (n for _, n in ref_results))])
            diff = f"{mean:+.2f} ± {half:.2f} (vs {ref_name})"
        lines.append(f"| {name} | {recalled}/{len(results)} | {sum(nll) / len(nll):.2f} | {diff} |")
    return "\n".join(lines)


def pairs_table(rows, length: int) -> str:
    """``rows`` (:func:`rows_for`) of C1, S1, C2, S2, …: per pair Sᵢ − Cᵢ in keys recalled and in answer
    NLL (± 95 % t over prompts), then the mean over pairs ± 95 % t over pairs."""
    lines = [f"| pair | recalled @ {length}: student / control | keys, student − control | "
             "answer NLL, student − control (95 % t over prompts) |", "|---|---|---|---|"]
    keys, nlls = [], []
    for (control, c_results, _), (student, s_results, _) in zip(rows[::2], rows[1::2]):
        hits = [sum(hit for hit, _ in results) for results in (s_results, c_results)]
        mean, half = mean_ci([s - c for (_, s), (_, c) in zip(s_results, c_results)])
        keys.append(hits[0] - hits[1])
        nlls.append(mean)
        lines.append(f"| {student} − {control} | {hits[0]} / {hits[1]} of {len(s_results)} | {keys[-1]:+d} | "
                     f"{mean:+.2f} ± {half:.2f} |")
    if len(keys) > 1:
        (k, k_half), (n, n_half) = mean_ci(keys), mean_ci(nlls)
        lines.append(f"| mean over {len(keys)} pairs (95 % t over pairs) | | **{k:+.1f}** ± {k_half:.1f} | "
                     f"**{n:+.2f}** ± {n_half:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="finished run directories; the first is the reference")
    parser.add_argument("--length", type=int, default=1024, help="prompt length in tokens (default 1024)")
    parser.add_argument("--trials", type=int, default=10, help="prompts, at depths spread evenly (default 10)")
    parser.add_argument("--seed", type=int, default=0, help="the keys' seed (default 0, the pipeline's at seed=0)")
    parser.add_argument("--ablate", action="store_true", help="also each hybrid student without its linear part")
    parser.add_argument("--teacher", action="store_true", help="also the first run's teacher")
    parser.add_argument("--pairs", action="store_true",
                        help="runs are pairs CONTROL STUDENT …: each student against its own control")
    parser.add_argument("--out", default=None, help="write the markdown here too")
    args = parser.parse_args(argv)
    if args.trials < 2:
        parser.error("--trials must be at least 2 for an interval over prompts")
    if args.pairs and (len(args.runs) % 2 or args.ablate or args.teacher):
        parser.error("--pairs takes an even number of runs (CONTROL STUDENT, …) and neither --ablate nor --teacher")
    runs = [Path(r) for r in args.runs]
    rows = rows_for(runs, args.length, args.trials, args.seed, args.ablate, args.teacher)
    text = pairs_table(rows, args.length) if args.pairs else table(rows, args.length)
    flags = f" --length {args.length} --trials {args.trials}" + (f" --seed {args.seed}" if args.seed else "")
    flags += (" --ablate" if args.ablate else "") + (" --teacher" if args.teacher else "")
    flags += " --pairs" if args.pairs else ""
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(f"`python -m studies.passkey {' '.join(args.runs)}{flags}`\n\n{text}\n")


if __name__ == "__main__":
    main()
