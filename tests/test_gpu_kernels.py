"""The keep-intermediates kernels on a real GPU (Metal or MLX's CUDA build).

On a machine without a GPU backend every test here is skipped; the kernels'
logic is still checked on the CPU by the emulated tests
(test_kernel_emulated.py, test_ssm_kernel_emulated.py). The checks live in
``gpu_checks.py`` so that they also run standalone where pytest is not at hand.
"""

import gpu_checks as checks
import pytest

BACKEND = checks.gd._backend()
pytestmark = pytest.mark.skipif(BACKEND is None, reason="no GPU backend in MLX here")


def test_gated_delta_kernel_matches_reference():
    assert checks.check_kernel(BACKEND) == []


def test_ssm_kernel_matches_reference():
    assert checks.check_ssm_kernel(BACKEND) == []


@pytest.mark.parametrize(
    "family, make, op",
    [
        ("qwen3_next", checks.tiny_qwen3_next, checks.gd),
        ("nemotron_h", checks.tiny_nemotron_h, checks.sk),
    ],
)
def test_greedy_through_kernel_equals_mlx_lm(family, make, op):
    assert checks.check_greedy(family, make, op, 64) == []
