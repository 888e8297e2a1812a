"""target.fingerprint: it changes when the model's bytes do, and reads each weight file once."""

import hashlib
import os

from eaglepipe.target import model as target


def folder_with(path, weights: bytes):
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_a_fine_tune_of_the_same_shapes_gets_its_own_fingerprint(tmp_path, monkeypatch):
    monkeypatch.setattr(target, "DIGESTS", tmp_path / "digests")
    base = folder_with(tmp_path / "base", b"\x00" * 4096)
    tuned = folder_with(tmp_path / "tuned", b"\x00" * 4095 + b"\x01")
    assert target.fingerprint(base) != target.fingerprint(tuned)
    assert target.fingerprint(base) == target.fingerprint(folder_with(tmp_path / "copy", b"\x00" * 4096))


def test_a_digest_is_read_once_and_a_rewrite_reads_it_again(tmp_path, monkeypatch):
    monkeypatch.setattr(target, "DIGESTS", tmp_path / "digests")
    weights = folder_with(tmp_path / "model", b"a" * 1000) / "model.safetensors"
    first = target.weight_digest(weights)
    assert first == hashlib.sha256(b"a" * 1000).hexdigest()
    [memo] = [p for p in (tmp_path / "digests").iterdir() if p.suffix != ".lock"]
    memo.write_text("what the memo holds")  # the memo is what a second call returns, not a new read
    assert target.weight_digest(weights) == "what the memo holds"
    before = weights.stat()
    weights.write_bytes(b"b" * 1000)  # rewritten in place: same name, same size
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns - 10**9))  # an mtime of its own (coarse clocks)
    assert target.weight_digest(weights) == hashlib.sha256(b"b" * 1000).hexdigest()


def test_a_hugging_face_hub_blob_is_named_by_its_digest(tmp_path, monkeypatch):
    monkeypatch.setattr(target, "DIGESTS", tmp_path / "digests")
    data = b"weights" * 100
    digest = hashlib.sha256(data).hexdigest()
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / digest).write_bytes(data)
    snapshot = tmp_path / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(tmp_path / "blobs" / digest)
    assert target.weight_digest(snapshot / "model.safetensors") == digest
    assert not (tmp_path / "digests").exists()  # taken from the name, nothing read or kept
