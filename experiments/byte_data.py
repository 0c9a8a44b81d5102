"""Byte-level text that every machine has without downloads: the Python standard library.

    files = stdlib_files()                       # sorted *.py of the stdlib, no tests
    train_files, val_files = split_by_file(files, val_fraction=0.05)
    train = load_bytes(train_files)              # (n,) uint8, files joined by SEPARATOR
    x, y = sample_batch(train, batch=8, context=1024, generator=g)   # (8, 1024) int64 each

The split is by file (a hash of the path relative to the stdlib root), so no file is in both
sets and the split is the same on every machine with the same stdlib. Test packages
(`test/`, `tests/`, `idlelib/idle_test/`) and site-packages are left out: they repeat data
files and generated code that would flatter a language model.
"""

import glob
import hashlib
import os
import sysconfig

import numpy as np
import torch

SEPARATOR = 0  # NUL never occurs in Python source, so it marks a file boundary


def stdlib_root():
    return sysconfig.get_paths()["stdlib"]


def stdlib_files(root=None):
    """Sorted paths of the standard library's *.py files, without tests and site-packages."""
    root = root or stdlib_root()
    files = []
    for path in glob.glob(os.path.join(root, "**", "*.py"), recursive=True):
        parts = os.path.relpath(path, root).split(os.sep)
        if {"site-packages", "dist-packages", "test", "tests", "idle_test"} & set(parts[:-1]):
            continue
        files.append(path)
    return sorted(files)


def split_by_file(files, val_fraction=0.05, root=None):
    """(train_files, val_files): a file is in validation iff the first 8 bytes of the SHA-256
    of its path relative to root, read as a fraction of 2^64, fall below val_fraction."""
    root = root or stdlib_root()
    train, val = [], []
    for path in files:
        digest = hashlib.sha256(os.path.relpath(path, root).encode()).digest()
        (val if int.from_bytes(digest[:8], "big") / 2**64 < val_fraction else train).append(path)
    return train, val


def load_bytes(files):
    """(n,) uint8 tensor: the files' bytes, each followed by SEPARATOR."""
    chunks = []
    for path in files:
        with open(path, "rb") as f:
            chunks.append(np.frombuffer(f.read() + bytes([SEPARATOR]), dtype=np.uint8))
    return torch.from_numpy(np.concatenate(chunks).copy())


def sample_batch(data, batch, context, generator):
    """Random windows: x = data[i : i + context], y = data[i + 1 : i + context + 1], each
    (batch, context) int64; start positions drawn from `generator` (so a run can resume)."""
    starts = torch.randint(0, len(data) - context - 1, (batch,), generator=generator)
    offsets = torch.arange(context + 1)
    windows = data[starts[:, None] + offsets].long()  # (B, context + 1)
    return windows[:, :-1], windows[:, 1:]


def eval_windows(data, context, num_tokens):
    """The first num_tokens predictions of data cut into non-overlapping windows of `context`:
    x, y each (num_tokens // context, context). Every context length scores the same bytes
    (num_tokens a multiple of each context), each window starting from an empty context."""
    if num_tokens % context:
        raise ValueError(f"num_tokens {num_tokens} is not a multiple of context {context}")
    x = data[:num_tokens].long().view(-1, context)
    y = data[1:num_tokens + 1].long().view(-1, context)
    return x, y
