"""The eval stage's measurement stores: per-sequence values kept beside the scalars, older
measurements without them taken again, and teacher measurements shared across run directories."""
from __future__ import annotations

import json

from dofla.eval.store import MEASUREMENTS, SEQUENCES, Measurements, split_sequences


def counting(values):
    calls = []

    def compute():
        calls.append(1)
        return {"eval/loss": sum(values) / len(values), "seq/heldout/x": list(values)}
    return compute, calls


def test_scalars_and_per_sequence_values_go_to_their_own_files(tmp_path):
    store = Measurements(tmp_path / MEASUREMENTS, main=True)
    compute, calls = counting([1.0, 3.0])
    assert store.get("perplexity/x", {"a": 1}, compute) == {"eval/loss": 2.0}
    entries = json.loads((tmp_path / MEASUREMENTS).read_text())
    sequences = json.loads((tmp_path / SEQUENCES).read_text())
    assert list(entries) == list(sequences) and list(sequences.values()) == [{"seq/heldout/x": [1.0, 3.0]}]
    again = Measurements(tmp_path / MEASUREMENTS, main=True)
    assert again.get("perplexity/x", {"a": 1}, compute) == {"eval/loss": 2.0} and len(calls) == 1
    assert again.per_sequence() == {"seq/heldout/x": [1.0, 3.0]}
    assert again.get("perplexity/x", {"a": 2}, compute) and len(calls) == 2  # other settings: taken again


def test_a_measurement_stored_without_its_sequences_is_taken_again(tmp_path):
    store = Measurements(tmp_path / MEASUREMENTS, main=True)
    compute, calls = counting([2.0])
    store.get("m", {}, compute)
    (tmp_path / SEQUENCES).unlink()  # as a run evaluated before sequences were kept
    Measurements(tmp_path / MEASUREMENTS, main=True).get("m", {}, compute)
    assert len(calls) == 2 and (tmp_path / SEQUENCES).is_file()


def test_a_shared_measurement_is_computed_once_for_every_run_directory(tmp_path):
    shared = tmp_path / "teacher_scores"
    compute, calls = counting([0.5, 1.5])
    for run in ("a", "b"):
        store = Measurements(tmp_path / run / MEASUREMENTS, main=True, shared=shared)
        assert store.get("perplexity/teacher", {"t": 1}, compute, share=True) == {"eval/loss": 1.0}
        assert store.per_sequence() == {"seq/heldout/x": [0.5, 1.5]}
    assert len(calls) == 1
    Measurements(tmp_path / "c" / MEASUREMENTS, main=True, shared=shared).get("perplexity/student", {"t": 1}, compute)
    assert len(calls) == 2  # not shared unless asked


def test_split_sequences_separates_lists_by_prefix():
    assert split_sequences({"a": 1.0, "seq/b": [1.0]}) == ({"a": 1.0}, {"seq/b": [1.0]})


def test_a_directory_scored_twice_gives_the_sequences_of_the_scoring_its_metrics_hold(tmp_path):
    """Scored on one split, then on another: both entries stay (a third scoring may reuse either), stored in
    key order, and the sequences kept for a record are the ones of the metrics.json the last scoring wrote."""
    store = Measurements(tmp_path / MEASUREMENTS, main=True)
    first = store.get("perplexity/student", {"split": "test"}, counting([1.0, 3.0])[0])
    second = store.get("perplexity/student", {"split": "dev"}, counting([5.0, 7.0, 9.0])[0])
    again = Measurements(tmp_path / MEASUREMENTS, main=True)
    assert again.per_sequence(second) == {"seq/heldout/x": [5.0, 7.0, 9.0]}
    assert again.per_sequence(first) == {"seq/heldout/x": [1.0, 3.0]}
    ambiguous = {**first, **second, "eval/loss": 99.0}  # neither entry's scalars: nothing to keep
    assert again.per_sequence(ambiguous) == {}
    store.get("perplexity/other", {"split": "dev"}, lambda: {"seq/heldout/x": [0.0]})  # no scalar tells it apart
    import pytest
    with pytest.raises(ValueError, match="cannot tell apart"):
        Measurements(tmp_path / MEASUREMENTS, main=True).per_sequence(second)
