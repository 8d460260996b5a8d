"""The CUDA kernel as MLX's cuda_kernel generates it, compiled by nvcc.

MLX compiles the generated source with NVRTC at the first call
(mlx/backend/cuda/jit_module.cpp: C++17, ``--gpu-architecture=sm_90a`` on a
Hopper GPU). nvcc's device pass is the same front end: it shows the exact
text (signature, template constants, bfloat16 casts) compiles for the GPU.
MLX's own device header is replaced by the CUDA headers it includes.
"""

import re
import shutil
import subprocess

import pytest
from kernel_harness import mlx_source
from test_kernel_emulated import DTYPES, SHAPES, VARIANTS, make_inputs

from mlx_mtp.recurrent import gated_delta as gd

pytestmark = pytest.mark.slow  # end-to-end: see pyproject's markers

# What mlx/backend/cuda/device/utils.cuh and the default header bring in.
PRELUDE = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cooperative_groups.h>
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_generated_cuda_source_compiles_for_sm90(tmp_path):
    parts = [PRELUDE]
    for i, ((has_mask, vectorized), dtypes) in enumerate(
        (v, d) for v in VARIANTS for d in DTYPES.values()
    ):
        spec = gd.kernel_spec("cuda", has_mask, vectorized)
        inputs = make_inputs(SHAPES["gqa-dk128-dv6"], 4, dtypes, has_mask, vectorized)
        call = gd.kernel_call(*inputs)
        args = [
            mlx_source.ArgInfo(a.dtype, a.ndim, a.size)
            for a in map(mlx_source.as_array, call["inputs"])
        ]
        _, text = mlx_source.cuda_source(
            spec["name"], spec["header"], spec["source"], spec["input_names"],
            args, spec["output_names"], call["output_dtypes"], call["template"],
        )  # fmt: skip
        macros = re.findall(r"^#define (\w+)", spec["header"], re.M)
        parts.append(f"namespace k{i} {{\n{text}}}\n")
        parts += [f"#undef {m}\n" for m in macros]
    src = tmp_path / "kernels.cu"
    src.write_text("".join(parts))
    cmd = ["nvcc", "-cubin", "-arch=sm_90a", "-std=c++17", "-Werror", "all-warnings"]
    r = subprocess.run(cmd + [str(src), "-o", str(tmp_path / "kernels.cubin")],
                       capture_output=True, text=True)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
