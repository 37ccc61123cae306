"""Durable files (grpo/run/durable.py): a file or folder is whole under its name or not there; a failed fill
leaves nothing behind; appended lines land in order."""

from __future__ import annotations

import pytest

from grpo.run.durable import append_line, fill_folder, publish, write_atomically


def test_write_atomically_replaces_the_whole_file_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"old and longer than the new text")
    write_atomically(path, b"new")
    assert path.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]


def test_append_line_adds_each_line_after_the_last(tmp_path):
    path = tmp_path / "metrics.jsonl"
    append_line(path, b'{"step": 1}\n')
    append_line(path, b'{"step": 2}\n')
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'


def test_a_folder_that_fails_to_fill_is_removed_and_the_error_raised(tmp_path):
    tmp = tmp_path / ".tmp-checkpoint-3"

    def half_then_full_disk(folder):
        folder.mkdir()
        (folder / "optimizer.pt").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space"):
        fill_folder(tmp, half_then_full_disk)
    assert not tmp.exists()


def test_a_filled_folder_is_published_under_its_final_name_with_its_files(tmp_path):
    tmp, final = tmp_path / ".tmp-adapter", tmp_path / "adapter"
    (tmp / "stale").mkdir(parents=True)  # left by an earlier fill that a kill cut short: replaced

    def write(folder):
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"weights")

    fill_folder(tmp, write)
    publish(tmp, final)
    assert not tmp.exists() and [p.name for p in final.iterdir()] == ["adapter_model.safetensors"]
