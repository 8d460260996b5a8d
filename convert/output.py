"""Writing a folder atomically, with a progress bar over tensors and bytes."""

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Dict, Iterator

import mlx.core as mx

from mlx_mtp.errors import MTPError


@contextmanager
def atomic_folder(out: Path, force: bool) -> Iterator[Path]:
    """Yield ``OUT.tmp-xxxx``; rename it to ``out`` on success, remove it on any failure."""
    out = Path(out)
    if out.exists() and not force:
        raise MTPError(f"{out} exists (use --force to replace it)")
    if out.exists() and not out.is_dir():
        raise MTPError(f"{out} exists and is not a folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f"{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:  # Ctrl-C included: never leave a half-written folder
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_files(files: Dict[Path, Callable[[Path], None]]) -> None:
    """Write each file through ``writer(tmp_path)``, then rename them all into place."""
    done = []
    try:
        for path, writer in files.items():
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
