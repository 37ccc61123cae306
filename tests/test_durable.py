"""Durable files (grpo/run/durable.py): a file or folder is whole under its name or not there; a failed fill
leaves nothing behind; appended lines land in order."""

from __future__ import annotations

import os
import stat

import pytest
import torch
from safetensors.torch import save_file

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


@pytest.fixture
def group_writable_umask():
    """umask 002 for the test (a shared machine's usual one): files should come out 0664, not 0644 or 0600."""
    old = os.umask(0o002)
    yield 0o664
    os.umask(old)


def test_written_files_get_the_users_usual_mode(tmp_path, group_writable_umask):
    write_atomically(tmp_path / "config.json", b"{}")
    append_line(tmp_path / "metrics.jsonl", b"{}\n")
    assert stat.S_IMODE((tmp_path / "config.json").stat().st_mode) == group_writable_umask
    assert stat.S_IMODE((tmp_path / "metrics.jsonl").stat().st_mode) == group_writable_umask


def test_a_filled_folder_gives_safetensors_files_the_usual_mode_not_0600(tmp_path, group_writable_umask):
    def write(folder):
        folder.mkdir()
        save_file({"w": torch.zeros(2)}, str(folder / "adapter_model.safetensors"))  # through a private temp file

    fill_folder(tmp_path / ".tmp-adapter", write)
    mode = (tmp_path / ".tmp-adapter" / "adapter_model.safetensors").stat().st_mode
    assert stat.S_IMODE(mode) == group_writable_umask
