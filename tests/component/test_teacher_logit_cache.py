"""The teacher-logit cache (``dofla.cache.teacher_logits``, ``distill.teacher_cache``): distillation
reading it ends where distillation without it does, its key follows the ids the teacher reads, two
processes compute a text once, a corrupt, truncated or foreign entry is refused and recomputed, and
the least recently used entries go when the cache outgrows its limit."""
from __future__ import annotations

import copy
import dataclasses
import multiprocessing
import time
from pathlib import Path

import pytest
import torch

from dofla.cache.teacher_logits import SUFFIX, TeacherLogitCache, entry_bytes, row_digest
from dofla.data.copies import CopySpans
from dofla.models import convert
from dofla.models.tiny import build_tiny_model
from dofla.train.direct import RandomRows
from dofla.train.distill import DistillSchedule, attention_projections, teacher_targets, train_kl
from dofla.train.kl_targets import ExactTargets, TopKTargets

SCHEDULE = DistillSchedule(steps=4, micro_batch_size=2, lr=1e-2, feature_lr=1e-2, warmup_steps=1, log_every=2)
FIELDS = {"teacher": "tiny", "format": "exact"}


def pair():
    teacher = build_tiny_model("llama", seed=0).eval()
    student = convert(copy.deepcopy(teacher), feature_map="learned_prf", dims=[8, 8])
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in attention_projections(student):
            if p.ndim == 2:
                p.add_(0.3 * torch.randn(p.shape, generator=generator))
    return teacher, student


def tokens(rows=8, length=24, seed=0):  # every row differs from every other
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


class Text:
    """The rows of ``tokens`` in order, ``batch_size`` at a time: one pass over a text."""

    def __init__(self, tokens: torch.Tensor, batch_size: int):
        self.tokens, self.batch_size, self.position = tokens, batch_size, 0
        self.batch_tokens = batch_size * tokens.shape[1]

    def next_batch(self) -> torch.Tensor:
        self.position += 1
        return self.tokens[(self.position - 1) * self.batch_size:self.position * self.batch_size]

    def state(self) -> int:
        return self.position

    def restore(self, position: int) -> None:
        self.position = position


def distil(teacher, student, s, cache=None):
    """train_kl over 4 batches of 4 rows of a 16-row text, the targets from ``cache`` when given."""
    targets_of = None if cache is None else (lambda rows: cache.targets(rows, lambda m: teacher_targets(teacher, m, s)))
    trained, curve, _ = train_kl(copy.deepcopy(student), teacher, Text(tokens(rows=16), 4),
                                 ["features", "attention"], s, progress=False, targets_of=targets_of)
    return trained.state_dict(), [c["kl"] for c in curve]


@pytest.mark.parametrize("topk", [0, 5])
def test_distillation_reading_the_cache_ends_where_distillation_without_it_does(tmp_path, topk):
    teacher, student = pair()
    s = dataclasses.replace(SCHEDULE, teacher_topk=topk)
    cache = TeacherLogitCache(tmp_path, {**FIELDS, "format": f"top{topk}"}, 2**30)
    plain = distil(teacher, student, s)
    first = distil(teacher, student, s, cache)  # computes and stores every row
    assert (cache.hits, cache.misses) == (0, 16) and len(list(cache.dir.glob(f"*{SUFFIX}"))) == 16
    second = distil(teacher, student, s, cache)  # reads every row
    assert (cache.hits, cache.misses) == (16, 16)
    for state, curve in (first, second):
        assert curve == plain[1]
        for name, value in plain[0].items():
            assert torch.equal(state[name], value), name


def test_exact_and_topk_entries_hold_what_the_teacher_gave(tmp_path):
    teacher, _ = pair()
    ids = tokens(rows=3)
    for topk, kind in ((0, ExactTargets), (7, TopKTargets)):
        s = dataclasses.replace(SCHEDULE, teacher_topk=topk)
        cache = TeacherLogitCache(tmp_path, {**FIELDS, "format": topk}, 2**30)
        want = teacher_targets(teacher, ids, s)
        cache.targets(ids, lambda m: teacher_targets(teacher, m, s))
        got = cache.targets(ids[[2, 0]], lambda m: pytest.fail("a stored row was recomputed"))
        assert isinstance(got, kind) and cache.hits == 2
        for name, value in vars(want).items():
            assert torch.equal(getattr(got, name), value[[2, 0]]), name
        entry = next(cache.dir.glob(f"*{SUFFIX}"))
        assert abs(entry.stat().st_size - entry_bytes(24, teacher.config.vocab_size, topk)) < 2048  # plus a header


def test_the_key_is_the_ids_the_teacher_reads_far_copies_included():
    rows = tokens(rows=4, length=80)
    copied = CopySpans(RandomRows(rows, 4, seed=0), share=0.2, distance=16, seed=3).next_batch()
    plain = RandomRows(rows, 4, seed=0).next_batch()
    assert not torch.equal(copied, plain)
    assert {row_digest(r) for r in copied}.isdisjoint(row_digest(r) for r in plain)
    assert row_digest(plain[0]) == row_digest(plain[0].clone().to(torch.int32))  # the ids, not their dtype
    assert row_digest(plain[0, :40]) != row_digest(plain[0])  # a shorter row is another text


def test_a_corrupt_truncated_or_foreign_entry_is_refused_in_one_sentence_and_recomputed(tmp_path, capsys):
    ids = tokens(rows=1)
    calls = []

    def compute(rows):
        calls.append(len(rows))
        return ExactTargets(torch.randn(len(rows), rows.shape[1], 11, generator=torch.Generator().manual_seed(0)))

    cache = TeacherLogitCache(tmp_path, FIELDS, 2**30)
    stored = cache.targets(ids, compute)
    entry = cache.dir / f"{row_digest(ids[0])}{SUFFIX}"
    data = bytearray(entry.read_bytes())
    data[-5] ^= 0xFF  # one bit pattern of the logits
    entry.write_bytes(bytes(data))
    assert torch.equal(cache.targets(ids, compute).logits, stored.logits) and calls == [1, 1]
    assert "is not usable (corrupted: checksum mismatch); recomputing it" in capsys.readouterr().out
    entry.write_bytes(entry.read_bytes()[:-40])
    cache.targets(ids, compute)
    assert calls == [1, 1, 1] and "is not usable (unreadable or truncated" in capsys.readouterr().out
    other = TeacherLogitCache(tmp_path, {**FIELDS, "teacher": "another"}, 2**30)
    other.dir.mkdir(parents=True)
    entry.rename(other.dir / entry.name)  # a file of another namespace under this one's name
    other.targets(ids, compute)
    assert calls == [1, 1, 1, 1] and "written for another teacher, format or text" in capsys.readouterr().out
    cache.targets(ids, compute)
    assert calls == [1, 1, 1, 1, 1]


def test_the_least_recently_used_entries_go_when_the_cache_outgrows_its_limit(tmp_path):
    size = entry_bytes(16, 64, 0) + 512  # one row's entry and a header, about

    def compute(rows):
        return ExactTargets(torch.zeros(len(rows), rows.shape[1], 64))

    cache = TeacherLogitCache(tmp_path, FIELDS, 3 * size)
    rows = tokens(rows=5, length=16)
    for i in range(3):
        cache.targets(rows[i:i + 1], compute)
        time.sleep(0.01)
    cache.targets(rows[:1], compute)  # row 0 is read: now the most recently used
    assert cache.hits == 1
    cache.targets(rows[3:5], compute)  # two more: rows 1 and 2 are the least recently used
    kept = {p.name.removesuffix(SUFFIX) for p in cache.dir.glob(f"*{SUFFIX}")}
    assert kept == {row_digest(rows[i]) for i in (0, 3, 4)}
    assert cache.nbytes() <= 3 * size


def _read_text(root: str, ids: torch.Tensor, log: str, start) -> None:
    """One job: the targets of ``ids``, each computation logged to ``log`` (a line per row), from
    when both jobs have passed ``start`` (a barrier)."""
    def compute(rows):
        with open(log, "a") as handle:
            handle.write("row\n" * len(rows))
        time.sleep(0.5)  # long enough for the other job to ask for the same rows meanwhile
        return TopKTargets(torch.zeros(len(rows), rows.shape[1], 3), torch.zeros(len(rows), rows.shape[1], 3,
                                                                                 dtype=torch.int32),
                           torch.zeros(len(rows), rows.shape[1]))

    cache = TeacherLogitCache(Path(root), FIELDS, 2**30)
    start.wait()
    for first in range(0, len(ids), 2):
        cache.targets(ids[first:first + 2], compute)


def test_two_jobs_reading_the_same_text_compute_it_once(tmp_path):
    ids, log = tokens(rows=6), tmp_path / "computed.log"
    spawn = multiprocessing.get_context("spawn")
    start = spawn.Barrier(2)
    jobs = [spawn.Process(target=_read_text, args=(str(tmp_path / "cache"), ids, str(log), start)) for _ in range(2)]
    for job in jobs:
        job.start()
    for job in jobs:
        job.join(timeout=120)
    assert [job.exitcode for job in jobs] == [0, 0]
    assert log.read_text().count("row") == 6


def stage_context(tmp_path, **distill):
    """What the distill stage's cache needs of a run: its config and its teacher."""
    from types import SimpleNamespace

    from dofla.config import PathsConfig, RunConfig

    cfg = RunConfig()
    cfg.model = dataclasses.replace(cfg.model, source="tiny:llama")
    cfg.paths = PathsConfig(cache_dir=str(tmp_path))
    cfg.distill = dataclasses.replace(cfg.distill, name="kl", **distill)
    return SimpleNamespace(cfg=cfg, teacher=build_tiny_model("llama", seed=0))


@pytest.mark.parametrize("distill, says", [
    ({"teacher_cache": "off"}, None),
    ({"logit_chunk": 8}, "exact targets with distill.logit_chunk are never whole"),
    ({"teacher_cache_gb": 1e-4}, "need 0.5 MiB, more than distill.teacher_cache_gb=0.0001"),
])
def test_the_stage_goes_without_the_cache_when_off_chunked_exact_or_too_large_saying_why(tmp_path, capsys, distill,
                                                                                          says):
    from dofla.stages.distill import teacher_logit_cache

    ctx = stage_context(tmp_path, **distill)
    s = dataclasses.replace(SCHEDULE, logit_chunk=ctx.cfg.distill.logit_chunk)
    assert teacher_logit_cache(ctx, s, 64, 8) is None
    out = capsys.readouterr().out
    assert (says in out) if says else out == ""


def test_the_stage_cache_is_keyed_by_teacher_precision_format_and_temperature(tmp_path):
    from dofla.stages.distill import teacher_logit_cache

    def namespace(**distill):
        ctx = stage_context(tmp_path, **distill)
        return teacher_logit_cache(ctx, dataclasses.replace(SCHEDULE, teacher_topk=ctx.cfg.distill.teacher_topk),
                                   64, 8)

    exact, top = namespace(), namespace(teacher_topk=8)
    assert exact.dir.parent == tmp_path / "teacher_logits" and exact.fields["format"] == "exact"
    assert "temperature" not in exact.fields  # exact logits are the same at any temperature
    assert namespace(temperature=2.0).dir == exact.dir
    assert len({exact.dir, top.dir, namespace(teacher_topk=8, temperature=2.0).dir}) == 3
    assert top.fields["teacher"]["model"]["source"] == "tiny:llama" and top.fields["precision"] == "fp32"


def test_a_topk_beyond_the_vocabulary_and_bad_cache_values_are_refused_before_training(tmp_path):
    from dofla.errors import ConfigError
    from dofla.stages.distill import teacher_logit_cache
    from dofla.validate_training import validate_training

    with pytest.raises(ConfigError, match=r"distill.teacher_topk=300 must be less than the teacher's vocabulary of 257 tokens"):
        teacher_logit_cache(stage_context(tmp_path, teacher_topk=300), SCHEDULE, 64, 8)
    for distill, key in (({"teacher_cache": "on"}, "distill.teacher_cache"), ({"teacher_topk": -1}, "teacher_topk"),
                         ({"teacher_cache_gb": 0}, "distill.teacher_cache_gb")):
        with pytest.raises(ConfigError, match=key):
            validate_training(stage_context(tmp_path, **distill).cfg)
