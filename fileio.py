"""
Files that must survive a crash, and their digests. Only the standard library: data preparation's
spawned workers, the tokenizer and the bench and eval scripts import it without paying for torch,
and it imports nothing of this repo, so any module may import it.

atomic_write(path, data)  bytes or str (as UTF-8) through a temporary file beside path, fsync,
                          rename over path, fsync of the directory: a crash leaves the old file
                          or the new one, never half of one
write_json(path, obj)     atomic_write of obj as indented JSON and a final newline
write_figure(path, fig)   atomic_write of a matplotlib figure, rendered in the format path's suffix names
fsync_dir(d)              make a rename in directory d durable
sha256_file(path)         the hex sha256 of a file, read in blocks
"""
import hashlib
import io
import json
import os


def fsync_dir(d):
    """Make a rename in directory d durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(d or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path, data):
    """Write bytes (or str, as UTF-8) to path so that a crash leaves either the old file or the new
    one. The temporary file sits beside the target (a rename across filesystems is not atomic)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # a full disk, or a second Ctrl-C mid-write: leave no temp file behind
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(d)


def write_json(path, obj, indent=1):
    """obj as JSON, atomically: a reader never sees half a file."""
    atomic_write(path, json.dumps(obj, indent=indent) + "\n")


def write_figure(path, fig, dpi=120):
    """A matplotlib figure as an image (png unless path's suffix names another format), atomically.
    Takes the figure object: this file needs no matplotlib."""
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format=os.path.splitext(path)[1][1:] or "png")
    atomic_write(path, buf.getvalue())


def sha256_file(path, chunk=1 << 24):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
