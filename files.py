"""The files the tools write (a table, a figure, results, a benchmark's numbers), written the one way:

    files.check_output_file(path, "--out", "runs.png", ours)   # before the work: refused, with the fix
    with files.replaced(path) as tmp:                          # after it: whole, or not at all
        fig.savefig(tmp)

A tool writes over nothing it did not write: an existing file is kept unless `ours` recognises it as the tool's
own, and the check comes before the work, so a path that cannot be written costs no wait. A write goes to a
temporary file beside the target, fsynced and renamed over it: a kill leaves the old file or the new one, never a
part of one that looks finished. Torch-free, so a plotting tool starts without it.
"""

import contextlib
import json
import os


def fsync_dir(path):
    """Make the directory's renames durable (a rename is only in memory until its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_output_file(path, flag, example, ours=None):
    """Refuse, before a tool's work, an output file it could not write (lost after the work otherwise) or an
    existing file it did not write: a directory, a file that `ours` does not recognise, a path under a file or in a
    directory that is not writable (missing folders are created by the write). flag: the tool's option; example: a
    file name, for a directory given; ours: (is_ours(path), what the tool's files are, its rule), or None where the
    tool writes over any file."""
    if os.path.isdir(path):
        raise ValueError(
            f"{flag} {path} is a directory; give a file name, e.g. {os.path.join(path, example)}"
        )
    if ours is not None and os.path.exists(path):
        is_ours, what, rule = ours
        if not is_ours(path):
            raise ValueError(f"{flag} {path} exists and is not {what}; give another file ({rule})")
    blocked = _blocked(os.path.abspath(path))
    if blocked:
        raise ValueError(
            f"{flag} {path} cannot be written: {blocked[0]} is {blocked[1]}; give another path"
        )


def _blocked(path):
    """(its nearest existing folder, why) when the folders above path cannot hold what the write creates there --
    that folder is a file, or not writable -- else None. The folders missing in between are the write's to create:
    the first one there decides."""
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return parent, "a file, not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return parent, "not writable"
    return None


def check_output_dir(path, key, what, read_only_ok=False):
    """Refuse, before the run's work, a directory it would write in at `path` (a key's value) and could not (a bare
    errno at its first write otherwise, after the build): the path or its nearest existing parent is a file, or
    that parent is not writable (a missing directory is created by the run). what: the directory wanted, for the
    fix; read_only_ok: an existing directory the run may only read (an index cache built before) passes."""
    path = os.path.abspath(path)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ValueError(f"{key}={path} is not a directory: give {what}")
        if not read_only_ok and not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{key}={path} is not writable: give {what}")
        return
    blocked = _blocked(path)
    if blocked:
        raise ValueError(
            f"{key}={path} cannot be created: {blocked[0]} is {blocked[1]}; give {what}"
        )


def json_holds(path, keys):
    """The file at path is a JSON object with every one of keys (how a tool knows its own results); False when
    it is missing, unreadable, not JSON or another value."""
    try:
        with open(path) as f:
            found = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(found, dict) and set(keys) <= found.keys()


@contextlib.contextmanager
def replaced(path):
    """Yield a temporary path beside path, with path's extension (a figure's format is read from it); once the
    block has written it, fsync it and rename it onto path. A failure or a kill in the block leaves path as it
    was; a failure removes the temporary file too (a kill leaves it, hidden, never under path's name)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    # the process's own name: two writers of one path do not collide, and the file gets the umask's mode
    name, ext = os.path.splitext(os.path.basename(path))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.tmp{ext}")
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def write_text(text, path):
    """Write text to path whole (through replaced), ending it with one newline."""
    with replaced(path) as tmp, open(tmp, "w") as f:
        f.write(text.rstrip("\n") + "\n")
