"""The kernel emulator itself: it must report what a GPU would get wrong."""

import mlx.core as mx
import pytest
from kernel_harness import EmulatedKernel, KernelRunError, compiler_problem

pytestmark = pytest.mark.skipif(
    compiler_problem() is not None, reason=f"kernel emulator: {compiler_problem()}"
)


def run(kernel, x, threadgroup, dtype=mx.float32):
    return kernel(inputs=[x], output_shapes=[x.shape], output_dtypes=[dtype],
                  grid=(x.size, 1, 1), threadgroup=(threadgroup, 1, 1))[0]  # fmt: skip


def test_bfloat16_rounds_to_nearest_even_like_mlx(tmp_path):
    # Ties both ways, values next to ties, overflow to infinity, NaN, denormals.
    bits = [0x3F808000, 0x3F818000, 0x3F807FFF, 0x3F808001, 0x7F7FFFFF,
            0x7FC00001, 0xFF800000, 0x00008000, 0x00018000, 0xBF80C000]  # fmt: skip
    x = mx.concatenate([mx.array(bits, mx.uint32).view(mx.float32),
                        mx.random.normal((4096,))])  # fmt: skip
    kernel = EmulatedKernel(
        "metal", "to_bf16", ["x"], ["y"],
        "uint i = thread_position_in_grid.x;\ny[i] = static_cast<bfloat16_t>(x[i]);",
        workdir=tmp_path,
    )  # fmt: skip
    y = run(kernel, x, 256, mx.bfloat16)
    want = x.astype(mx.bfloat16)
    assert mx.array_equal(y.view(mx.uint16), want.view(mx.uint16)).item()


def test_metal_lanes_that_skip_a_simd_sum_are_reported(tmp_path):
    source = """
        uint i = thread_position_in_grid.x;
        if (thread_index_in_simdgroup >= 16) {
          return;  // Metal would sum only the 16 lanes left
        }
        y[i] = simd_sum(x[i]);
    """
    kernel = EmulatedKernel("metal", "diverge", ["x"], ["y"], source, workdir=tmp_path)
    with pytest.raises(KernelRunError, match=r"16 lane\(s\) returned while 16 wait"):
        run(kernel, mx.ones((64,)), 64)


def test_cuda_shuffle_over_a_partial_block_is_reported(tmp_path):
    # 48 threads per block: the second warp has 16 lanes, the full mask 32.
    source = """
        auto i = blockIdx.x * blockDim.x + threadIdx.x;
        y[i] = __shfl_xor_sync(0xffffffff, x[i], 1);
    """
    kernel = EmulatedKernel("cuda", "partial", ["x"], ["y"], source, workdir=tmp_path)
    y = run(kernel, mx.arange(64, dtype=mx.float32), 32)
    assert y.tolist() == [i ^ 1 for i in range(64)]
    with pytest.raises(KernelRunError, match="does not exist"):
        run(kernel, mx.zeros((96,)), 48)
