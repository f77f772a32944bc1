"""fileio.py: atomic writes leave the old file or the new one and no temp file; digests; no torch."""
import hashlib
import json
import os
import subprocess
import sys

import pytest

import fileio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_atomic_write_leaves_no_temp_file(tmp_path, monkeypatch):
    p = tmp_path / "sub" / "f.json"
    fileio.atomic_write(str(p), "one")
    fileio.atomic_write(str(p), b"two")
    assert p.read_text() == "two" and os.listdir(p.parent) == ["f.json"]

    def boom(*a):
        raise KeyboardInterrupt
    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(KeyboardInterrupt):
        fileio.atomic_write(str(p), "three")
    assert p.read_text() == "two" and os.listdir(p.parent) == ["f.json"]


def test_write_json_and_sha256_file(tmp_path):
    p = tmp_path / "a" / "r.json"
    fileio.write_json(str(p), {"x": [1, 2]})
    assert p.read_text() == json.dumps({"x": [1, 2]}, indent=1) + "\n"
    assert fileio.sha256_file(str(p), chunk=3) == hashlib.sha256(p.read_bytes()).hexdigest()
    fileio.fsync_dir(str(tmp_path / "missing"))  # a directory that cannot be opened: no error


def test_imports_nothing_heavy():
    """Anything may import it, data preparation's spawned workers included: no torch, no numpy."""
    code = "import sys, fileio; assert not {'torch', 'numpy'} & set(sys.modules), 'imported torch or numpy'"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
