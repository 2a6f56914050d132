"""Which models a batch runs, and under which names."""

from __future__ import annotations

import pytest

from kenosis_rewrite.batch import listing


def _touch(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"")
    return path


def test_a_folder_gives_every_onnx_under_it_by_relative_name_leaving_out_hidden_folders_and_the_output(tmp_path):
    for name in ("b.onnx", "sub/a.onnx", ".hidden/c.onnx", "out/d.onnx", "notes.txt"):
        _touch(tmp_path / name)
    found = listing.list_models(str(tmp_path), exclude=str(tmp_path / "out"))
    assert [name for _, name in found] == ["b.onnx", "sub/a.onnx"]
    assert found[1][0] == str(tmp_path / "sub" / "a.onnx")
    assert listing.is_batch_input(str(tmp_path)) and not listing.is_batch_input(str(tmp_path / "b.onnx"))


def test_a_list_file_reads_paths_relative_to_itself_with_comments(tmp_path):
    _touch(tmp_path / "m" / "z.onnx")
    listed = tmp_path / "models.txt"
    listed.write_text("# fleet\nm/z.onnx  # the one\n\n/abs/y.onnx\n")
    assert listing.list_models(str(listed)) == [("/abs/y.onnx", "y.onnx"), (str(tmp_path / "m" / "z.onnx"), "z.onnx")]
    assert listing.is_batch_input(str(listed))


def test_given_paths_are_named_by_file_name_and_pairs_keep_their_names():
    assert listing.resolve_models(["/x/b.onnx", "/y/a.onnx"]) == [("/y/a.onnx", "a.onnx"), ("/x/b.onnx", "b.onnx")]
    assert listing.resolve_models([("/x/m.onnx", "x/m.onnx"), ("/y/m.onnx", "y/m.onnx")])[1] == ("/y/m.onnx", "y/m.onnx")


def test_two_models_of_one_name_are_refused_before_anything_runs():
    with pytest.raises(ValueError, match="same output: m.onnx"):
        listing.resolve_models(["/x/m.onnx", "/y/m.onnx"])
