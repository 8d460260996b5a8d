"""Writing a folder atomically, with a progress bar over tensors and bytes.

Temporary folders are named ``NAME.tmp-mlx-mtp-PID-xxxxxxxx`` (and
``.old-`` for a folder being replaced) beside the folder they become, so a
later run can tell which ones a killed run left: ours by name, and the
process that made them is gone.
"""

import errno
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator, List

import mlx.core as mx

from mlx_mtp.errors import MTPError

TAG = "mlx-mtp"
_TEMP = re.compile(rf"\.(tmp|old)-{TAG}-(\d+)-[a-z0-9_]+")


def temp_prefix(name: str, kind: str = "tmp") -> str:
    """The ``mkdtemp`` prefix of a temporary folder that becomes ``name``."""
    return f"{name}.{kind}-{TAG}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists but is not ours to signal
        return True
    return True


def remove_stale(parent: Path, name: str) -> List[Path]:
    """Remove the temporary folders for ``name`` in ``parent`` that killed runs left.

    Only folders named as ``temp_prefix`` names them, whose process is gone:
    a build running in another process keeps its own.
    """
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    for p in entries:
        m = _TEMP.fullmatch(p.name[len(name) :]) if p.name.startswith(name) else None
        if not m or not p.is_dir() or p.is_symlink() or _alive(int(m.group(2))):
            continue
        target, kept = Path(parent) / name, p / name
        if m.group(1) == "old" and not name:  # a folder filled in place
            for entry in list(p.iterdir()):  # killed while swapping entries
                if not (target / entry.name).exists():
                    os.replace(entry, target / entry.name)
        elif m.group(1) == "old" and kept.exists() and not target.exists():
            os.replace(kept, target)  # killed between moving it aside and back
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def holds_model(folder: Path) -> bool:
    """A folder mlx-mtp may replace: a model's (config.json, *.safetensors) or empty."""
    entries = list(folder.iterdir())
    if not entries:
        return True
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def in_place(out: Path) -> bool:
    """Whether ``out`` is written in place rather than renamed into place: an
    empty folder (it may be the folder the user is in) or a mount point (a
    mounted drive or a container volume cannot be renamed, and a folder built
    beside it sits on another file system)."""
    return out.is_dir() and (os.path.ismount(out) or not any(out.iterdir()))


def check_target(out: Path, force: bool) -> Path:
    """Refuse, before any work, an ``out`` that cannot or must not be written.

    Returns ``out`` as an absolute path. Left-overs of killed runs for
    ``out`` are removed first.
    """
    out = Path(os.path.abspath(out))
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    remove_stale(out.parent, out.name)
    if out.is_dir():
        remove_stale(out, "")  # those of a run that filled it in place
    if out.exists() and not out.is_dir():
        raise MTPError(f"{out} is a file, not a folder: choose another output folder")
    if out.exists():
        if not force:
            what = "a model" if out.is_dir() and holds_model(out) else "files"
            hint = (
                "use --force to replace it"
                if what == "a model"
                else "choose another output folder"
            )
            raise MTPError(f"{out} exists and holds {what} ({hint})")
        if not holds_model(out):
            first = sorted(p.name for p in out.iterdir())[0]
            raise MTPError(
                f"{out} holds files that are not a model ({first}): --force "
                "replaces only a model folder or an empty one; choose another "
                "output folder"
            )
        inside = os.path.commonpath([out, os.getcwd()]) == str(out)
        if inside and any(out.iterdir()):  # an empty one is filled in place
            raise MTPError(
                f"{out} is the folder you are in: convert from another folder "
                "to replace it"
            )
    elif not parent.is_dir():
        raise MTPError(f"{parent} is not a folder")
    # the most reliable test of write access: write where the work will go
    where = out if out.exists() and in_place(out) else parent
    try:
        probe = tempfile.mkdtemp(prefix=temp_prefix(out.name), dir=where)
        os.rmdir(probe)
    except OSError as e:
        raise MTPError(f"cannot write into {where}: {_reason(e)}") from None
    return out


def check_space(folder: Path, nbytes: int, out: Path) -> None:
    """Refuse to write ``nbytes`` for ``out`` into ``folder`` when they do not fit."""
    free = shutil.disk_usage(folder).free
    if nbytes > free:
        raise MTPError(
            f"not enough space for {out}: the model needs {nbytes / 1e6:.1f} MB, "
            f"{free / 1e6:.1f} MB are free"
        )


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError) and e.errno is not None:
        return os.strerror(e.errno)
    return (str(e).strip() or type(e).__name__).splitlines()[0]


def write_error(e: BaseException, where: Path) -> MTPError:
    """One line for a failed write (MLX's writer raises a bare RuntimeError, the
    tokenizer's a bare Exception)."""
    full = isinstance(e, OSError) and e.errno == errno.ENOSPC
    folder = Path(where)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        full = full or shutil.disk_usage(folder).free < 1 << 20
    except OSError:
        pass
    reason = os.strerror(errno.ENOSPC) if full else _reason(e)
    return MTPError(f"cannot write {where}: {reason}")


@contextmanager
def atomic_folder(out: Path, force: bool) -> Iterator[Path]:
    """Yield a temporary folder; it becomes ``out`` on success and is removed on
    any failure.

    Normally ``OUT.tmp-...`` is built beside ``out`` and renamed to it; an
    existing ``out`` (see ``check_target``) is renamed aside first and removed
    once the new folder is in place. An ``out`` written in place (``in_place``)
    keeps its place: the temporary folder is built inside it, on its file
    system, and its files are moved in at the end.
    """
    out = check_target(out, force)
    if out.exists() and in_place(out):
        with _filled_in_place(out) as tmp:
            yield tmp
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(out.name), dir=out.parent))
    try:
        open_up(tmp)
        yield tmp
        _finish(tmp, out)
    except BaseException:  # Ctrl-C included: never leave a half-written folder
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def open_up(folder: Path) -> None:
    """Give ``folder`` the permissions of one made with the user's umask
    (``mkdtemp`` makes its folders 0700: a model others cannot read)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)


def _finish(tmp: Path, out: Path) -> None:
    if not out.exists():
        os.replace(tmp, out)
        return
    old = Path(tempfile.mkdtemp(prefix=temp_prefix(out.name, "old"), dir=out.parent))
    os.replace(out, old / out.name)
    try:
        os.replace(tmp, out)
    except BaseException:  # put the old folder back (or leave it for a
        os.replace(old / out.name, out)  # later run's remove_stale)
        os.rmdir(old)
        raise
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def _filled_in_place(out: Path) -> Iterator[Path]:
    """Build inside ``out``, then swap its entries for the new ones."""
    tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(""), dir=out))
    old, moved = None, []
    try:
        yield tmp
        old = Path(tempfile.mkdtemp(prefix=temp_prefix("", "old"), dir=out))
        for entry in list(out.iterdir()):
            if entry not in (tmp, old):
                os.replace(entry, old / entry.name)
        for entry in list(tmp.iterdir()):
            os.replace(entry, out / entry.name)
            moved.append(out / entry.name)
        os.rmdir(tmp)
    except BaseException:  # Ctrl-C included: the old entries go back
        for entry in moved:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        if old is not None:
            for entry in list(old.iterdir()):
                os.replace(entry, out / entry.name)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


@contextmanager
def writing(where: Path) -> Iterator[None]:
    """Turn a failed write under ``where`` into one line naming the problem."""
    try:
        yield
    except MTPError:
        raise
    except Exception as e:
        raise write_error(e, where) from None


def atomic_write_files(files: Dict[Path, Callable[[Path], None]]) -> None:
    """Write each file through ``writer(tmp_path)``, then rename them all into place."""
    done = []
    try:
        for path, writer in files.items():
            with writing(path):
                fd, tmp = tempfile.mkstemp(
                    prefix=f".{path.name}.tmp-", dir=path.parent, suffix=path.suffix
                )
                os.close(fd)
                done.append((Path(tmp), path))
                writer(Path(tmp))
        for tmp, path in done:
            os.replace(tmp, path)
    except BaseException:
        for tmp, _ in done:
            tmp.unlink(missing_ok=True)
        raise


def make_progress(enabled: bool):
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[done]}/{task.fields[count]} tensors"),
        DownloadColumn(),
        TimeRemainingColumn(),
        disable=not enabled,
        transient=True,
    )


def materialize(weights: Dict[str, mx.array], description: str, progress) -> None:
    """Evaluate tensors one at a time so the bar moves by tensor and by bytes."""
    if progress is None:
        mx.eval(list(weights.values()))
        return
    total = sum(v.nbytes for v in weights.values())
    task = progress.add_task(description, total=total, done=0, count=len(weights))
    for i, v in enumerate(weights.values()):
        mx.eval(v)
        progress.update(task, advance=v.nbytes, done=i + 1)
    progress.remove_task(task)
