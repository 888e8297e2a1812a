"""The states connector writes only inside its folder: a relative name is placed there, and an absolute path, ``..``, a
name that is not a .safetensors file, or a symlink leading out (of the file, of a folder on the way, or of the
``.tmp`` file it writes first) is refused with the reason."""

import os

import pytest

from eaglepipe.hidden.connector import confine


@pytest.fixture
def folder(tmp_path):
    inside = tmp_path / "states"
    inside.mkdir()
    return os.path.realpath(inside)


def test_a_relative_name_is_placed_inside_the_folder(folder):
    assert confine(folder, "a.safetensors") == os.path.join(folder, "a.safetensors")
    assert confine(folder, "states-12/s0.safetensors") == os.path.join(folder, "states-12", "s0.safetensors")


@pytest.mark.parametrize(
    "name, reason",
    [
        ("/etc/evil.safetensors", "not a name relative"),
        ("../evil.safetensors", r"climbs out"),
        ("sub/../../evil.safetensors", r"climbs out"),
        ("a/../b.safetensors", r"climbs out"),
        ("evil.sh", r"does not end in \.safetensors"),
        ("", r"does not end in \.safetensors"),
    ],
)
def test_a_name_that_leaves_the_folder_is_refused(folder, name, reason):
    with pytest.raises(ValueError, match=reason):
        confine(folder, name)


def test_a_symlink_leading_out_is_refused(folder, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, os.path.join(folder, "door"))
    os.symlink(outside / "target.safetensors", os.path.join(folder, "file.safetensors"))
    os.symlink(outside / "target.tmp", os.path.join(folder, "twin.safetensors.tmp"))
    for name in ("door/x.safetensors", "file.safetensors", "twin.safetensors"):
        with pytest.raises(ValueError, match="leads out"):
            confine(folder, name)
    os.symlink(os.path.join(folder, "real"), os.path.join(folder, "alias"))
    assert confine(folder, "alias/x.safetensors") == os.path.join(folder, "alias", "x.safetensors")
