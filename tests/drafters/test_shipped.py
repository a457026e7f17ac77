"""The drafters shipped in drafters/<model>/<method>/: readable, the method their folder says, within the
size budget (30 MB each, 200 MB in all), each with a model card."""

from __future__ import annotations

from specstand.drafters.trained import SHIPPED_ROOT, WEIGHTS, read_drafter, shipped_drafter


def test_shipped_drafters_are_complete_and_within_budget():
    folders = sorted(p.parent for p in SHIPPED_ROOT.glob(f"*/*/{WEIGHTS}"))
    assert folders, "no shipped drafter"
    total = 0
    for folder in folders:
        spec, tensors = read_drafter(folder)
        size = (folder / WEIGHTS).stat().st_size
        total += size
        assert spec.method == folder.name and spec.target == folder.parent.name
        assert size <= 30e6, (folder, size)
        assert "Held-out calls" in (folder / "README.md").read_text()
        assert len(tensors["d2t"]) == spec.draft_vocab_size
        assert shipped_drafter(spec.target, spec.method) == folder
    assert total <= 200e6
