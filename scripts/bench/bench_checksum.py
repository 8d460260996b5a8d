"""What a prompt-cache file's checksum costs (``prompt_file``'s SHA-256):
the pass that seals a file once written, and the one that verifies it before
it is read, against the write and the read themselves.

The caches have the default model's geometry (SmolLM2-135M: 30 layers and
the MTP head's, 3 KV heads of 64, float32 on the CPU), random values:

    python scripts/bench/bench_checksum.py --tokens 7680
"""

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlx_mtp import prompt_file


def caches(tokens: int, layers: int, heads: int, dim: int, dtype) -> list:
    out = []
    for _ in range(layers):
        c = KVCache()
        k = mx.random.normal((1, heads, tokens, dim)).astype(dtype)
        c.update_and_fetch(k, k + 1)
        out.append(c)
    mx.eval([c.state for c in out])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=7680)
    ap.add_argument("--layers", type=int, default=31)
    ap.add_argument("--heads", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where the file goes (default: tmp)")
    a = ap.parse_args()
    entries = caches(a.tokens, a.layers, a.heads, a.dim, getattr(mx, a.dtype))
    metadata = {prompt_file.CHECKSUM: f"sha256:{'0' * 64}"}
    folder = Path(a.dir or tempfile.mkdtemp())
    path = folder / "checksum-bench.safetensors"
    rows = {"write (unsealed)": [], "seal": [], "verify": [], "read (mx.load)": []}
    for _ in range(a.repeats):
        tic = time.perf_counter()
        prompt_file.write_atomic(
            path, lambda t: prompt_file.save_prompt_cache(t, entries, metadata)
        )
        rows["write (unsealed)"].append(time.perf_counter() - tic)
        tic = time.perf_counter()
        prompt_file._seal(path)
        rows["seal"].append(time.perf_counter() - tic)
        with open(path, "rb") as f:
            tic = time.perf_counter()
            prompt_file.verify(f, path)
            rows["verify"].append(time.perf_counter() - tic)
            f.seek(0)
            tic = time.perf_counter()
            arrays = mx.load(f, format="safetensors")
            mx.eval(list(arrays.values()))
            rows["read (mx.load)"].append(time.perf_counter() - tic)
    size = path.stat().st_size
    path.unlink()
    print(f"{a.tokens} tokens, {a.layers} layers x {a.heads} heads x {a.dim}, "
          f"{a.dtype}: {size / 1e6:.1f} MB")  # fmt: skip
    for name, times in rows.items():
        t = statistics.median(times)
        print(f"{name:18} {t * 1000:8.1f} ms  ({size / t / 1e9:.2f} GB/s)")


if __name__ == "__main__":
    main()
