"""model/provenance.py: the fingerprint of a checkpoint's weight files is sha256 over each
file's size and its first and last FINGERPRINT_CHUNK bytes (re-derived here with hashlib),
over the files the loader reads, in its order."""
import hashlib

import pytest

from molmobot_policy.model import provenance
from molmobot_policy.model.provenance import weight_files, weights_fingerprint

CHUNK = 8       # small chunks so that files of a few dozen bytes have a head, middle and tail


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(provenance, 'FINGERPRINT_CHUNK', CHUNK)


def _expected(*contents: bytes) -> str:
    digest = hashlib.sha256()
    for data in contents:
        digest.update(len(data).to_bytes(8, 'little'))
        digest.update(data if len(data) <= 2 * CHUNK else data[:CHUNK] + data[-CHUNK:])
    return digest.hexdigest()[:12]


def test_fingerprint_of_a_large_file_is_size_head_and_tail(tmp_path):
    data = bytes(range(100))
    (tmp_path / 'model.pt').write_bytes(data)
    assert weights_fingerprint(tmp_path) == _expected(data)
    assert weights_fingerprint(tmp_path / 'model.pt') == _expected(data)


def test_a_small_file_is_hashed_whole(tmp_path):
    (tmp_path / 'model.pt').write_bytes(b'0123456789')
    assert weights_fingerprint(tmp_path) == _expected(b'0123456789')


def test_changed_tail_or_size_changes_the_fingerprint_a_changed_middle_does_not(tmp_path):
    """A fingerprint, not a full hash (documented): the middle of a large file is not read."""
    path = tmp_path / 'model.pt'
    data = bytearray(range(100))
    path.write_bytes(bytes(data))
    original = weights_fingerprint(tmp_path)
    data[50] ^= 0xFF
    path.write_bytes(bytes(data))
    assert weights_fingerprint(tmp_path) == original
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    assert weights_fingerprint(tmp_path) != original
    path.write_bytes(bytes(data) + b'x')
    assert weights_fingerprint(tmp_path) != original


def test_safetensors_shards_are_fingerprinted_each_in_sorted_order(tmp_path):
    shards = {'model-00002-of-00002.safetensors': b'B' * 40,
              'model-00001-of-00002.safetensors': b'A' * 30}
    for name, data in shards.items():
        (tmp_path / name).write_bytes(data)
    assert weight_files(tmp_path) == sorted(tmp_path / n for n in shards)
    assert weights_fingerprint(tmp_path) == _expected(b'A' * 30, b'B' * 40)


def test_a_directory_with_both_model_pt_and_safetensors_is_refused(tmp_path):
    """model.pt was silently preferred: a stale one beside new shards was served (sixth
    fresh-user trial). The file itself can still be named."""
    (tmp_path / 'model.pt').write_bytes(b'pt')
    (tmp_path / 'x.safetensors').write_bytes(b'st')
    with pytest.raises(ValueError, match=r"holds both model.pt and \['x.safetensors'\]"):
        weight_files(tmp_path)
    assert weight_files(tmp_path / 'model.pt') == [tmp_path / 'model.pt']


def test_missing_weights_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match='neither model.pt nor'):
        weights_fingerprint(tmp_path)
    with pytest.raises(FileNotFoundError, match='does not exist'):
        weights_fingerprint(tmp_path / 'nope')
