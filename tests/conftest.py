import os
import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402
import tiny_own_layout  # noqa: E402

# Draft policies on the prior cost guess (by the BLAS), not on a measurement
# of each tiny model: deterministic, and no costs.json written by the suite.
# tests/test_probe.py measures; processes the tests start inherit this.
os.environ["MLX_MTP_COSTS"] = "prior"
os.environ["MLX_MTP_HISTORY"] = "off"  # no run starts from another's drafts

# heads in the DeepSeek and MiMo layouts (tests/tiny.py)
DRAFT_FAMILIES = [
    "deepseek_v3",
    "glm4_moe",
    "glm4_moe_lite",
    "mimo",
    "deepseek_v32",
    "glm_moe_dsa",
]
# heads in their own layouts (tests/tiny_own_layout.py); then those of several layers
OWN_LAYOUT_FAMILIES = list(tiny_own_layout.MODEL_TYPES)
MULTI_LAYER_FAMILIES = list(tiny_own_layout.MULTI_LAYER_TYPES)


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    """Per family: (folder with MTP layer, folder with the trunk alone)."""
    root = tmp_path_factory.mktemp("tiny")
    cache = {}

    def get(model_type: str, seed: int = 0):
        if (model_type, seed) not in cache:
            own = OWN_LAYOUT_FAMILIES + MULTI_LAYER_FAMILIES
            builder = tiny_own_layout if model_type in own else tiny
            cache[model_type, seed] = builder.build_folder(
                root / f"{model_type}-{seed}", model_type, seed
            )
        return cache[model_type, seed]

    return get


@pytest.fixture(autouse=True)
def _float32_default():
    mx.random.seed(0)
    yield


@pytest.fixture(autouse=True)
def _memory_bound_prior(monkeypatch):
    """Without ``tune``, the cost-aware draft count starts from costs that
    depend on the machine (none pays on a CPU with MLX's bundled BLAS). Tests
    pin the memory-bound guess of a GPU, so that they draft, and alike
    everywhere."""
    monkeypatch.setattr("mlx_mtp.config.compute_bound", lambda: False)
