"""Which weights a node serves: a short fingerprint of a checkpoint's weight files.

The node logs and reports what it serves at every start (DESIGN.md, "Safety model"), so that
a log or a /diagnostics record says which weights commanded the arm. Hashing a whole
multi-gigabyte `model.pt` would add tens of seconds to every start, so the fingerprint reads
a bounded part of each file:

    sha256 over, per weight file in load order: its size (8 bytes, little-endian), its first
    FINGERPRINT_CHUNK bytes and its last FINGERPRINT_CHUNK bytes (the whole file when smaller
    than two chunks)

and keeps the first FINGERPRINT_DIGITS hex digits. It is a FINGERPRINT, not a full hash: it
tells different checkpoints apart (any change of size, header, first or last tensors) and the
same file on two machines, but a change confined to the middle of a large file goes unseen.
Files are the ones `model.checkpoint` loads: a directory's `model.pt`, else its
`*.safetensors` in sorted order, or the one weight file `checkpoint_path` names.

Plain python (hashlib); no torch.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

FINGERPRINT_CHUNK = 16 * 2**20      # bytes read from each end of every weight file
FINGERPRINT_DIGITS = 12             # hex digits kept (48 bits)
_READ = 2**20                       # bytes per read call


def weight_files(checkpoint_path: str | Path) -> list[Path]:
    """The weight files of a checkpoint directory (`model.pt`, or the `*.safetensors` shards,
    sorted) or the weight file itself: what `checkpoint.load_checkpoint` loads and
    `weights_fingerprint` identifies.

    Raises:
        FileNotFoundError: the path does not exist, or a directory holds neither.
        ValueError: a directory holds both (which one is the model is not for us to guess:
            a stale model.pt beside new shards was served silently).
    """
    path = Path(checkpoint_path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f'checkpoint path {path} does not exist')
    shards = sorted(path.glob('*.safetensors'))
    if (path / 'model.pt').is_file():
        if shards:
            raise ValueError(f'checkpoint {path}: holds both model.pt and '
                             f'{[s.name for s in shards]}: keep one set of weights in the '
                             'directory, or set checkpoint_path to the weight file to serve')
        return [path / 'model.pt']
    if not shards:
        raise FileNotFoundError(f'checkpoint {path}: neither model.pt nor *.safetensors found')
    return shards


def _update(digest, f, size: int) -> None:
    """Feed `size` bytes of open file `f`, from its current position, to `digest`."""
    while size > 0:
        block = f.read(min(_READ, size))
        if not block:
            break
        digest.update(block)
        size -= len(block)


def weights_fingerprint(checkpoint_path: str | Path) -> str:
    """FINGERPRINT_DIGITS lower-case hex digits identifying the checkpoint's weight files
    (see the module docstring: size + first and last FINGERPRINT_CHUNK bytes of each).

    Raises:
        FileNotFoundError, ValueError: as `weight_files`. OSError: a file cannot be read.
    """
    digest = hashlib.sha256()
    for file in weight_files(checkpoint_path):
        size = file.stat().st_size
        digest.update(size.to_bytes(8, 'little'))
        with open(file, 'rb') as f:
            if size <= 2 * FINGERPRINT_CHUNK:
                _update(digest, f, size)
            else:
                _update(digest, f, FINGERPRINT_CHUNK)
                f.seek(size - FINGERPRINT_CHUNK)
                _update(digest, f, FINGERPRINT_CHUNK)
    return digest.hexdigest()[:FINGERPRINT_DIGITS]
