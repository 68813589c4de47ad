"""The dequantised-GGUF cache is keyed by the file's content, not its path: every venv installs
its own copy of the embedded model's package, and each copy used to dequantise another ~517 MB
into the cache (a new-user finding: 7 copies)."""

from __future__ import annotations

import os
import shutil

from laser.model.loader import gguf_cache_key


def test_copies_share_a_key_and_a_change_gets_a_new_one(tmp_path):
    a = tmp_path / "one" / "m.gguf"
    a.parent.mkdir()
    a.write_bytes(os.urandom(3 << 20))
    b = tmp_path / "two" / "m.gguf"
    b.parent.mkdir()
    shutil.copy(a, b)
    os.utime(b, (1, 1))  # another install time
    assert gguf_cache_key(a) == gguf_cache_key(b)
    data = bytearray(b.read_bytes())
    data[-10] ^= 0xFF  # the end of the weights
    b.write_bytes(bytes(data))
    assert gguf_cache_key(a) != gguf_cache_key(b)
    data[5] ^= 0xFF  # the header
    c = tmp_path / "c.gguf"
    c.write_bytes(bytes(data[: 1 << 10]))  # a small file is hashed whole
    assert len(gguf_cache_key(c)) == 12 and gguf_cache_key(c) != gguf_cache_key(a)
