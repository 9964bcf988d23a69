"""Image paths in `mlxr run` prompts (supervisor/cli/images.py), found as `ollama run` finds
them."""

from __future__ import annotations

import base64

from mlxr.supervisor.cli.images import take_images


def test_absolute_relative_quoted_and_escaped_paths_are_taken(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.png").write_bytes(b"A")
    (tmp_path / "my pic.JPG").write_bytes(b"B")
    (tmp_path / "c.webp").write_bytes(b"C")
    text = (f"compare {tmp_path}/a.png with ./my\\ pic.JPG and '{tmp_path}/c.webp' please")
    rest, images, files = take_images(text)
    assert rest == "compare with and please"
    assert [base64.b64decode(x) for x in images] == [b"A", b"B", b"C"]
    assert [f.name for f in files] == ["a.png", "my pic.JPG", "c.webp"]


def test_missing_files_and_other_words_stay_in_the_text(tmp_path):
    text = f"what is in {tmp_path}/missing.png, or image.png, or {tmp_path}/notes.txt?"
    assert take_images(text) == (text, [], [])


def test_home_paths_are_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "cat.gif").write_bytes(b"G")
    rest, images, _ = take_images("describe ~/cat.gif")
    assert rest == "describe" and base64.b64decode(images[0]) == b"G"
