import sys
from pathlib import Path

import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).parent))

import tiny  # noqa: E402

DRAFT_FAMILIES = ["deepseek_v3", "glm4_moe", "glm4_moe_lite", "mimo"]


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory):
    """Per family: (folder with MTP layer, folder with the trunk alone)."""
    root = tmp_path_factory.mktemp("tiny")
    cache = {}

    def get(model_type: str, seed: int = 0):
        if (model_type, seed) not in cache:
            cache[model_type, seed] = tiny.build_folder(
                root / f"{model_type}-{seed}", model_type, seed
            )
        return cache[model_type, seed]

    return get


@pytest.fixture(autouse=True)
def _float32_default():
    mx.random.seed(0)
    yield
