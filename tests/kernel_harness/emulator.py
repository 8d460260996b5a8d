"""Run ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel`` kernels on the CPU.

``EmulatedKernel(backend, **builder_kwargs)`` takes what the real builder
takes (name, input and output names, body, header) and is called as the real
kernel object is (inputs, output shapes and dtypes, grid, threadgroup,
template). It writes the source MLX would generate (``mlx_source``), with the
unchanged body, after a C++ shim of what Metal or CUDA adds (``metal_shim.h``,
``cuda_shim.h``); compiles it with the C++ compiler (``$CXX`` or g++, C++20,
AddressSanitizer and UBSan where they link); and runs it in a subprocess with
the launch semantics of MLX's dispatch (``emu.h``). ``run`` takes many calls
and makes one binary and one process for all of them.
"""

import hashlib
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

from . import mlx_source

HERE = Path(__file__).parent
SHIMS = {"metal": "metal_shim.h", "cuda": "cuda_shim.h"}
BASE_FLAGS = ["-std=c++20", "-O0", "-ffp-contract=off", "-Wno-attributes"]
SANITIZE_FLAGS = [
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
]
# Byte images of the numpy arrays the driver reads and writes.
_NUMPY = {
    mx.float32: np.float32,
    mx.bfloat16: np.uint16,  # raw bits
    mx.bool_: np.bool_,
    mx.int32: np.int32,
    mx.uint32: np.uint32,
}


class KernelRunError(RuntimeError):
    """The emulated kernel failed: a sanitizer report, a divergent collective."""


def compiler() -> str:
    return os.environ.get("CXX", "g++")


@cache
def compiler_problem() -> Optional[str]:
    """None when the compiler builds and runs a C++20 fiber program, else why not."""
    if shutil.which(compiler()) is None:
        return f"no C++ compiler ({compiler()}) on PATH"
    test = '#include "emu.h"\nint main() { return emu::BF16(1.0f).bits != 0x3f80; }\n'
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "probe.cpp", Path(d) / "probe"
        src.write_text(test)
        r = subprocess.run(
            [compiler(), *BASE_FLAGS, "-I", str(HERE), str(src), "-o", str(exe)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0 or subprocess.run([str(exe)]).returncode != 0:
            return f"{compiler()} cannot build C++20 ({r.stderr.strip()[:200]})"
    return None


@cache
def sanitizers_work() -> bool:
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "probe.cpp", Path(d) / "probe"
        src.write_text("int main() { return 0; }\n")
        r = subprocess.run(
            [compiler(), *BASE_FLAGS, *SANITIZE_FLAGS, str(src), "-o", str(exe)],
            capture_output=True,
        )
        return r.returncode == 0 and subprocess.run([str(exe)]).returncode == 0


def _to_bytes(a: mx.array) -> bytes:
    if a.dtype not in _NUMPY:
        raise NotImplementedError(f"dtype {a.dtype} is not emulated")
    view = a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
    return np.ascontiguousarray(np.array(view)).tobytes()


def _from_bytes(data: bytes, shape, dtype: mx.Dtype) -> mx.array:
    out = mx.array(np.frombuffer(data, dtype=_NUMPY[dtype]).reshape(shape))
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


def _fill_hex(dtype: mx.Dtype, init_value: Optional[float]) -> str:
    """One element's bytes: ``init_value``, or all ones (NaN for floats) so that
    an element the kernel never writes shows (MLX leaves outputs uninitialized)."""
    if init_value is None:
        return "ff" * np.dtype(_NUMPY[dtype]).itemsize
    return _to_bytes(mx.array(init_value, dtype=dtype)).hex()


class Plan:
    """Calls of one kernel, and the instances (signatures) they need."""

    def __init__(self, kernel: "EmulatedKernel", instances: List[str], steps):
        self.kernel, self.instances, self.steps = kernel, instances, steps

    def compile(self) -> Path:
        return self.kernel._binary(self.instances)


class EmulatedKernel:
    """A stand-in for the object ``mx.fast.metal_kernel`` / ``cuda_kernel`` return."""

    def __init__(
        self,
        backend: str,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
        shared_memory: int = 0,
        *,
        workdir: Path,
        sanitize: bool = True,
    ):
        if backend not in SHIMS:
            raise ValueError(f"backend must be one of {list(SHIMS)}")
        if atomic_outputs or shared_memory or not ensure_row_contiguous:
            raise NotImplementedError(
                "atomic outputs, shared memory and strided inputs are not emulated"
            )
        if "#include" in header:
            raise NotImplementedError("a header with #include is not emulated")
        self.backend, self.name = backend, name
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.source, self.header = source, header
        self.workdir = Path(workdir)
        self.flags = BASE_FLAGS + (
            SANITIZE_FLAGS if sanitize and sanitizers_work() else []
        )

    def __call__(
        self,
        *,
        inputs,
        output_shapes,
        output_dtypes,
        grid,
        threadgroup,
        template=None,
        init_value=None,
        verbose=False,
        stream=None,
    ):
        call = dict(inputs=inputs, output_shapes=output_shapes,
                    output_dtypes=output_dtypes, grid=grid, threadgroup=threadgroup,
                    template=template, init_value=init_value)  # fmt: skip
        return self.run([call])[0]

    def instance(self, args, output_dtypes, template) -> str:
        """The C++ of one generated kernel and the function that calls it per thread."""
        gen = (
            mlx_source.metal_source
            if self.backend == "metal"
            else mlx_source.cuda_source
        )
        kname, text = gen(self.name, self.header, self.source, self.input_names,
                          args, self.output_names, output_dtypes, template)  # fmt: skip
        types = (
            mlx_source.METAL_TYPES if self.backend == "metal" else mlx_source.CUDA_TYPES
        )
        params = []
        for i, a in enumerate(args):
            t = types[a.dtype]
            if self.backend == "metal" and a.ndim == 0:
                params.append(f"*static_cast<const {t}*>(emu::g_in[{i}])")
            else:
                params.append(f"static_cast<const {t}*>(emu::g_in[{i}])")
        for i, d in enumerate(output_dtypes):
            params.append(f"static_cast<{types[d]}*>(emu::g_out[{i}])")
        if self.backend == "metal":
            params += [f"ids.{a}" for a in mlx_source.metal_attributes(self.source)]
            targs = mlx_source.write_template(template) if template else ""
            call = f"auto ids = emu::metal_ids(t);\n  {kname}{targs}"
        else:
            call = f"(void)t;\n  mlx::core::cu::{kname}"
        body = ",\n      ".join(params)
        return (
            f"{text}\nvoid emu_body(emu::Thread& t) {{\n  {call}(\n      {body});\n}}\n"
        )

    def _binary(self, instances: List[str]) -> Path:
        parts = [f'#include "{SHIMS[self.backend]}"\n#include "emu_main.h"\n']
        for i, text in enumerate(instances):
            parts.append(f"namespace emu_k{i} {{\n{text}}}  // namespace emu_k{i}\n")
        table = ", ".join(f"{{&emu_k{i}::emu_body}}" for i in range(len(instances)))
        parts.append(f"const emu::Instance emu_instances[] = {{{table}}};\n")
        parts.append(f"const int emu_n_instances = {len(instances)};\n")
        tu = "".join(parts)
        shim_text = "".join(
            (HERE / f).read_text() for f in ("emu.h", "emu_main.h", SHIMS[self.backend])
        )
        key = hashlib.sha256((tu + shim_text + " ".join(self.flags)).encode())
        exe = self.workdir / f"{self.name}-{self.backend}-{key.hexdigest()[:16]}"
        if not exe.exists():
            self.workdir.mkdir(parents=True, exist_ok=True)
            src, tmp = exe.with_suffix(".cpp"), exe.with_suffix(".tmp")
            src.write_text(tu)
            cmd = [compiler(), *self.flags, "-I", str(HERE), str(src), "-o", str(tmp)]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                raise KernelRunError(f"compile failed: {' '.join(cmd)}\n{r.stderr}")
            os.replace(tmp, exe)
        return exe

    def plan(self, calls: Sequence[Dict[str, Any]]) -> "Plan":
        """The calls' kernel instances; ``compile`` it (in any thread), then ``run``."""
        instances: Dict[str, int] = {}
        steps = []
        for c in calls:
            inputs = [mlx_source.as_array(x) for x in c["inputs"]]
            if len(inputs) != len(self.input_names):
                raise ValueError(f"expected {len(self.input_names)} inputs")
            args = [mlx_source.ArgInfo(a.dtype, a.ndim, a.size) for a in inputs]
            text = self.instance(args, c["output_dtypes"], c.get("template") or [])
            steps.append((instances.setdefault(text, len(instances)), inputs, c))
        return Plan(self, list(instances), steps)

    def run(self, calls) -> List[List[mx.array]]:
        """Runs each call (the keyword arguments of a kernel call) in order."""
        plan = calls if isinstance(calls, Plan) else self.plan(calls)
        exe = plan.compile()
        plans = plan.steps
        self.workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.workdir) as d:
            lines = []
            for n, (index, inputs, c) in enumerate(plans):
                grid, tg = tuple(c["grid"]), tuple(c["threadgroup"])
                lines.append(f"call {index} {' '.join(map(str, grid + tg))} "
                             f"{len(inputs)} {len(c['output_shapes'])}")  # fmt: skip
                for i, a in enumerate(inputs):
                    data = _to_bytes(a)
                    Path(d, f"c{n}_in{i}").write_bytes(data)
                    lines.append(f"in {len(data)} c{n}_in{i}")
                for i, (shape, dtype) in enumerate(
                    zip(c["output_shapes"], c["output_dtypes"])
                ):
                    nbytes = int(np.prod(shape)) * np.dtype(_NUMPY[dtype]).itemsize
                    fill = _fill_hex(dtype, c.get("init_value"))
                    lines.append(f"out {nbytes} {fill} c{n}_out{i}")
            Path(d, "manifest").write_text("\n".join(lines) + "\n")
            env = {**os.environ, "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=0"}
            r = subprocess.run(
                [str(exe), "manifest"], cwd=d, capture_output=True, text=True, env=env
            )
            if r.returncode != 0:
                raise KernelRunError(
                    f"{self.name} ({self.backend}): {r.stderr[-4000:]}"
                )
            results = []
            for n, (_, _, c) in enumerate(plans):
                results.append([
                    _from_bytes(Path(d, f"c{n}_out{i}").read_bytes(), shape, dtype)
                    for i, (shape, dtype) in enumerate(
                        zip(c["output_shapes"], c["output_dtypes"])
                    )
                ])  # fmt: skip
        return results
