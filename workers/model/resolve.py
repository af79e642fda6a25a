"""What a `model` setting names, as the HF-format directory the engine loads.

- an HF-format directory: itself;
- `tiny`: the embedded tiny random model (tests, and an explicit choice);
- a `.gguf` file, or a directory holding one GGUF file and no safetensors: that
  file converted once (workers/model/gguf.py) into
  `cache_dir()/models/gguf-<stem>-<key>`, where the key hashes the file's
  absolute path, size, modification and status-change times: hashing a multi-GB file's bytes on
  every start would cost more than the check is worth, and a file replaced in
  place changes its size or time. A file lock makes concurrent first uses (every
  worker of a cluster starting at once) convert it once; a new conversion of a file
  removes that file's earlier ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

from pdserve.kernels.file_lock import exclusive
from pdserve.workers.tiny.corpus import cache_dir

TINY = "tiny"
LOCK_TIMEOUT_S = 1800.0  # converting a 70B GGUF on a slow disk takes minutes, not hours


def resolve_model(model: str, progress: bool = False) -> Path:
    """The directory to load for `model`; ValueError naming `model` if there is none."""
    if model == TINY:
        from pdserve.workers.tiny.builder import default_model_dir

        return default_model_dir(progress=progress)
    from pdserve.workers.model.gguf import convert_gguf, find_gguf

    path = Path(model).expanduser()
    gguf = find_gguf(path)
    if gguf is None:
        return path
    out = converted_dir(gguf)
    done = out / "config.json"  # written before the directory is renamed into place
    if done.is_file():
        return out
    with _locked(out.with_name(out.name + ".lock")):
        if not done.is_file():  # another process may have converted it meanwhile
            # A conversion killed hard (OOM, SIGKILL) left its temporary directory: only the lock's
            # holder converts, so any there now is an orphan (float32 weights: GBs each).
            for orphan in out.parent.glob(f".{out.name}.*"):
                if orphan.is_dir():
                    shutil.rmtree(orphan, ignore_errors=True)
            if progress:
                print(f"[pdserve] converting {gguf} into {out} (once)", file=sys.stderr, flush=True)
            convert_gguf(gguf, out, progress=progress)
            (out / SOURCE_FILE).write_text(str(gguf.resolve()))
            _drop_older_conversions(gguf, out)
    return out


SOURCE_FILE = "pdserve-gguf-source"  # in a conversion: the GGUF file it was made from


def _drop_older_conversions(gguf: Path, kept: Path) -> None:
    """Remove the conversions of `gguf` made before it changed (float32 weights: GBs each). A file
    replaced or touched is converted again under a new key, and each earlier copy stayed in the
    cache for good. A process still serving from one keeps its open files (POSIX)."""
    source = str(gguf.resolve())
    for old in kept.parent.glob(f"gguf-{gguf.stem}-*"):
        marker = old / SOURCE_FILE
        if old != kept and old.is_dir() and marker.is_file() and marker.read_text() == source:
            shutil.rmtree(old, ignore_errors=True)


# Changes what a conversion writes (2: the pre-tokenizers transformers' GGUF reader lacks): a model
# converted before is converted again, not loaded as it was.
CONVERTER_VERSION = 2


def converted_dir(gguf: Path) -> Path:
    st = gguf.stat()
    # ctime too (as git's index keeps it): cp -p, rsync -a and tar x put back the old mtime of a
    # file they replace, but none can set its ctime, which any write, rename or utime moves.
    key = hashlib.sha256(f"{gguf.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0"
                         f"{CONVERTER_VERSION}".encode()).hexdigest()[:12]
    return cache_dir() / "models" / f"gguf-{gguf.stem}-{key}"


@contextlib.contextmanager
def _locked(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """The conversion's lock, waited for at most `timeout_s` (a converter that hangs
    must not hang every worker that starts after it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(exclusive(path, timeout_s))
        except TimeoutError:
            raise ValueError(f"model: another process has been converting into {path.with_suffix('')} "
                             f"for over {timeout_s:.0f} s; remove {path} if none is") from None
        yield
