"""A head norm stored in the other convention: loading refuses it by name, convert fixes it.

Zero-centred families (Qwen3.5 here) read ``1 + w``; a converter that stored
the factor ``1 + w`` itself, or subtracted the 1 twice, shifts the scale by
one. Plain families (GLM-4.5 here) read ``w``; one stored zero-centred sits
near 0. Either way the scale lands about one away from the trunk's norms.
"""

import numpy as np
import pytest
import tiny
import tiny_hybrid
from mlx_mtp.convert import convert

import mlx_mtp
from mlx_mtp.errors import MTPError
from mlx_mtp.generate import mtp_logits

TOKENS = list(range(40, 72))
CASES = [
    # (family, tensor, shift applied by a faulty converter)
    ("qwen3_5", "mtp.norm.weight", 1.0),  # the factor stored: 1 + w
    ("qwen3_5", "mtp.layers.0.input_layernorm.weight", 1.0),
    ("qwen3_5", "mtp.pre_fc_norm_hidden.weight", -1.0),  # the 1 taken twice
    ("glm4_moe", "model.layers.2.shared_head.norm.weight", -1.0),  # plain as w - 1
    ("glm4_moe", "model.layers.2.enorm.weight", -1.0),
]


def build(family):
    if family in tiny_hybrid.MODEL_TYPES:
        return tiny_hybrid.build_weights(family)
    return tiny.build_weights(family)


@pytest.mark.parametrize("family,tensor,shift", CASES)
def test_load_refuses_and_convert_fixes(tmp_path, capsys, family, tensor, shift):
    config, trunk_w, mtp_w = build(family)
    good = tiny.save_folder(tmp_path / "good", config, trunk_w, mtp_w)
    bad_w = dict(mtp_w, **{tensor: mtp_w[tensor] + shift})
    bad = tiny.save_folder(tmp_path / "bad", config, trunk_w, bad_w)

    with pytest.raises(MTPError) as e:
        mlx_mtp.load_model(bad)
    assert str(e.value).startswith(tensor) and "\n" not in str(e.value)

    fixed = convert(bad, tmp_path / "fixed")
    assert tensor in capsys.readouterr().err
    a, b = mlx_mtp.load_model(good), mlx_mtp.load_model(fixed)
    np.testing.assert_allclose(
        np.array(mtp_logits(a, TOKENS)), np.array(mtp_logits(b, TOKENS)), atol=1e-5
    )


@pytest.mark.parametrize("family", ["qwen3_5", "glm4_moe"])
def test_right_conventions_pass_untouched(tmp_path, capsys, family):
    config, trunk_w, mtp_w = build(family)
    src = tiny.save_folder(tmp_path / "src", config, trunk_w, mtp_w)
    out = convert(src, tmp_path / "out")
    assert "warning" not in capsys.readouterr().err
    a, b = mlx_mtp.load_model(src), mlx_mtp.load_model(out)
    np.testing.assert_array_equal(
        np.array(mtp_logits(a, TOKENS)), np.array(mtp_logits(b, TOKENS))
    )
