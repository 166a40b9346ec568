"""Which layers' linear parts does a hybrid student's loss depend on? One layer's linear part at a time.

``python -m studies.hybrid_layer_gain RUN_DIR [--seqs 4] [--out FILE]``

Loads a finished hybrid run (its ``student/`` and ``run.json``), and on the run's held-out text
(``--seqs`` sequences of ``data.seq_len``) measures the held-out loss of: the student with every
linear part removed (window + sinks only, as ``eval.ablate_linear``), the full student, and for
each layer i the student with only layer i's linear part kept. ``gain_i`` = loss(window only) −
loss(only layer i linear): positive when that layer's linear part helps on its own. The sum of
the per-layer gains against the full student's gain shows whether the layers' contributions add
up or interact (errors that compound through the stack). Prints markdown; ``--out`` writes it.
"""
from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

from dofla.eval import heldout_loss, without_linear_part


@contextlib.contextmanager
def only_layer(student, layer: int):
    """Within the block, only hybrid layer ``layer`` keeps its linear part."""
    attentions = student.student_attentions()
    kept = attentions[layer].feature_map
    with without_linear_part(student):
        attentions[layer].feature_map = kept
        try:
            yield
        finally:
            attentions[layer].feature_map = None


def layer_gains(student, tokens, batch_size: int = 2, layers=None) -> dict:
    """{"window": loss, "full": loss, "layers": {i: loss with only layer i's linear part}}."""
    hybrid = [i for i, a in enumerate(student.student_attentions()) if a.mode == "hybrid"]
    out = {"full": heldout_loss(student, tokens, batch_size, desc="full student")}
    with without_linear_part(student):
        out["window"] = heldout_loss(student, tokens, batch_size, desc="window + sinks")
    out["layers"] = {}
    for i in hybrid if layers is None else layers:
        with only_layer(student, i):
            out["layers"][i] = heldout_loss(student, tokens, batch_size, desc=f"only layer {i}")
    return out


def table(result: dict) -> str:
    window, gains = result["window"], {i: result["window"] - loss for i, loss in result["layers"].items()}
    lines = ["| layer | loss gain of its linear part alone (nats) |", "|---|---|"]
    lines += [f"| {i} | {g:+.4f} |" for i, g in gains.items()]
    lines += ["", f"window + sinks only: {window:.4f}; full student: {result['full']:.4f} "
              f"(gain {window - result['full']:+.4f}); sum of the per-layer gains: {sum(gains.values()):+.4f}; "
              f"layers that help alone: {sum(g > 0 for g in gains.values())} of {len(gains)}"]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="a finished hybrid run directory (holds student/ and run.json)")
    parser.add_argument("--seqs", type=int, default=4, help="held-out sequences of data.seq_len")
    parser.add_argument("--out", default=None, help="write the markdown here too")
    args = parser.parse_args(argv)

    from dofla.models import load_student, load_student_tokenizer
    from dofla.pipeline import heldout_tokens
    from dofla.report import run_config

    run = Path(args.run)
    cfg = run_config(run)
    student = load_student(run / "student")
    if not any(a.mode == "hybrid" for a in student.student_attentions()):
        raise SystemExit(f"{run} holds no hybrid student (attention=hybrid); nothing to ablate")
    tokenizer = load_student_tokenizer(run / "student")  # saved with the student: no teacher load
    heldout = heldout_tokens(cfg, tokenizer)[: args.seqs]
    start = time.perf_counter()
    text = (f"Held-out loss of {run} ({args.seqs} × {cfg.data.seq_len} held-out tokens) with one layer's linear "
            f"part at a time\n\n" + table(layer_gains(student, heldout, cfg.eval.batch_size))
            + f"\n\n({time.perf_counter() - start:.0f} s)")
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
