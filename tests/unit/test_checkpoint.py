"""Checkpoint pruning (no DeepSpeed: an engine stand-in writes the tag's folder)."""

from pathlib import Path

from learner import checkpoint


class _Engine:
    def save_checkpoint(self, root: str, tag: str, save_latest: bool, exclude_frozen_parameters: bool = False) -> None:
        (Path(root) / tag).mkdir(parents=True, exist_ok=True)
        (Path(root) / tag / "state.pt").write_text(tag)


def test_pruning_never_removes_the_checkpoint_latest_names(tmp_path):
    """Tags above the one being saved (a save cut short by a crash, after which the run resumed from an older one;
    a directory that held another run) sort above it: they go, the newest `keep` up to this one stay."""
    root = tmp_path / "checkpoints"
    for tag in ("v12", "v40"):
        (root / tag).mkdir(parents=True)
    for version in (2, 4, 6):
        checkpoint.save(_Engine(), tmp_path, version, {"version": version}, rank=0, keep=2)
        assert (root / "latest").read_text() == f"v{version}"
        assert (root / f"v{version}" / "hub.json").exists()
    assert sorted(p.name for p in root.glob("v*")) == ["v4", "v6"]
