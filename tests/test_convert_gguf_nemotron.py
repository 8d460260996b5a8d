"""Nemotron-H GGUFs, written as llama.cpp's converter writes them, convert back.

``write_gguf`` re-implements what llama.cpp's ``conversion/nemotron.py``
(``NemotronHModel``, on ``GraniteHybridModel`` / ``Mamba2Model``) does to a
Hugging Face Nemotron-H checkpoint, from its source: arch ``nemotron_h_moe``
when the config has ``num_experts_per_tok`` (else ``nemotron_h``, which carries
no MTP); ``ssm_a = -exp(A_log)`` and ``ssm_d`` as ``[H, 1]``; ``dt_bias`` as
``ssm_dt.bias``; the conv kernel squeezed; the gated norm as ``[groups, -1]``;
experts stacked; per-layer ``head_count_kv`` / ``feed_forward_length`` arrays;
and the MTP layer folded into one block ``blk.N`` (``mtp.layers.0.{enorm,
hnorm, eh_proj}`` -> ``nextn.*``, ``mtp.layers.1.final_layernorm`` ->
``nextn.shared_head_norm``, ``mtp.layers.0.norm`` -> ``attn_norm``,
``mtp.layers.1.norm`` -> ``ffn_norm``, attention and MoE tensors under
``blk.N``) with ``nemotron_h_moe.nextn_predict_layers``. Names are written
from an explicit table here (llama.cpp's ``gguf-py/gguf/tensor_mapping.py``),
independently of the converter's own map.

The reference is the same Hugging Face checkpoint with every tensor the GGUF
stores as float16 rounded to float16: trunk and MTP logits must agree to
float32 arithmetic.
"""

import mlx.core as mx
import numpy as np
import pytest
import tiny
import tiny_recurrent
from mlx.utils import tree_flatten
from mlx_mtp.convert import add_mtp, convert
from mlx_mtp.convert.describe import describe

import mlx_mtp
from mlx_mtp.generate import mtp_logits

TOKENS = list(range(40, 72))
LAYER = {  # HF name after ``backbone.layers.{i}.`` -> GGUF name after ``blk.{i}.``
    "norm.weight": "attn_norm.weight",
    "mixer.in_proj.weight": "ssm_in.weight",
    "mixer.conv1d.weight": "ssm_conv1d.weight",
    "mixer.conv1d.bias": "ssm_conv1d.bias",
    "mixer.dt_bias": "ssm_dt.bias",
    "mixer.A_log": "ssm_a",
    "mixer.D": "ssm_d",
    "mixer.norm.weight": "ssm_norm.weight",
    "mixer.out_proj.weight": "ssm_out.weight",
    "mixer.q_proj.weight": "attn_q.weight",
    "mixer.k_proj.weight": "attn_k.weight",
    "mixer.v_proj.weight": "attn_v.weight",
    "mixer.o_proj.weight": "attn_output.weight",
    "mixer.up_proj.weight": "ffn_up.weight",
    "mixer.down_proj.weight": "ffn_down.weight",
    "mixer.gate.weight": "ffn_gate_inp.weight",
    "mixer.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mixer.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mixer.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
MTP = {  # the folded block's special names (NemotronHModel._MTP_SPECIAL_RENAMES)
    "mtp.layers.0.enorm.weight": "nextn.enorm.weight",
    "mtp.layers.0.hnorm.weight": "nextn.hnorm.weight",
    "mtp.layers.0.eh_proj.weight": "nextn.eh_proj.weight",
    "mtp.layers.1.final_layernorm.weight": "nextn.shared_head_norm.weight",
    "mtp.layers.1.norm.weight": "ffn_norm.weight",
}
# kept float32 (1-D in the checkpoint, or the conv kernel)
F32 = ("mixer.A_log", "mixer.D", "mixer.norm.weight", "mixer.conv1d.weight")


def _value(config, suffix, w):
    """llama.cpp's value transform of one tensor."""
    w = np.array(w.astype(mx.float32))
    if suffix == "mixer.A_log":
        return -np.exp(w).reshape(-1, 1)
    if suffix == "mixer.D":
        return w.reshape(-1, 1)
    if suffix == "mixer.conv1d.weight":
        return w.squeeze()
    if suffix == "mixer.norm.weight":
        return w.reshape(config["n_groups"], -1)
    return w


def gguf_tensors(config, weights, mtp):
    """(GGUF name, numpy value, HF name) of every tensor llama.cpp writes."""
    n = len(config["hybrid_override_pattern"])
    top = {"backbone.embeddings.weight": "token_embd.weight",
           "backbone.norm_f.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}  # fmt: skip
    out, experts = [], {}
    for name, w in weights.items():
        if name in top:
            out.append((top[name], _value(config, "", w), name))
            continue
        if name.startswith("mtp."):
            if not mtp:
                continue
            bid, suffix = n, name.split(".", 3)[3]
            if name in MTP:
                out.append((f"blk.{n}.{MTP[name]}", _value(config, "", w), name))
                continue
        else:
            _, _, bid, suffix = name.split(".", 3)
        if ".experts." in suffix:  # mixer.experts.{e}.{up,down}_proj.weight
            _, _, e, proj, _ = suffix.split(".")
            experts.setdefault((bid, proj), {})[int(e)] = np.array(w)
            continue
        out.append((f"blk.{bid}.{LAYER[suffix]}", _value(config, suffix, w), name))
    for (bid, proj), per in experts.items():
        gname = f"blk.{bid}.ffn_{proj.split('_')[0]}_exps.weight"
        out.append((gname, np.stack([per[e] for e in sorted(per)]), gname))
    return out


# what llama.cpp's --mtp export keeps beside the MTP block (filter_tensors)
SHARED = ("token_embd.weight", "output_norm.weight", "output.weight")


def write_gguf(path, config, weights, part="all"):
    """A GGUF as llama.cpp writes it; returns it and the HF names stored float16.

    ``part``: "all", "trunk" (llama.cpp's ``--no-mtp``) or "mtp" (its ``--mtp``:
    the MTP block and the tensors it shares with the trunk).
    """
    import gguf
    from tiny_plain import _tokenizer_metadata

    pattern = config["hybrid_override_pattern"]
    n = len(pattern)
    moe = "num_experts_per_tok" in config
    arch = "nemotron_h_moe" if moe else "nemotron_h"
    mtp = moe and part != "trunk" and any(k.startswith("mtp.") for k in weights)
    blocks = n + mtp
    attn = [i for i, c in enumerate(pattern) if c == "*"] + [n] * mtp
    mlp = [i for i, c in enumerate(pattern) if c == ("E" if moe else "-")] + [n] * mtp
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(blocks)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    ff = config["moe_intermediate_size"] if moe else config["intermediate_size"]
    w.add_feed_forward_length([ff if i in mlp else 0 for i in range(blocks)])
    w.add_head_count(config["num_attention_heads"])
    kv = config["num_key_value_heads"]
    w.add_head_count_kv([kv if i in attn else 0 for i in range(blocks)])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])
    w.add_layer_norm_rms_eps(config["layer_norm_epsilon"])
    w.add_ssm_conv_kernel(config["conv_kernel"])
    w.add_ssm_state_size(config["ssm_state_size"])
    w.add_ssm_group_count(config["n_groups"])
    w.add_ssm_inner_size(config["mamba_num_heads"] * config["mamba_head_dim"])
    w.add_ssm_time_step_rank(config["mamba_num_heads"])
    w.add_vocab_size(config["vocab_size"])
    if moe:
        w.add_expert_used_count(config["num_experts_per_tok"])
        w.add_expert_feed_forward_length(config["moe_intermediate_size"])
        w.add_expert_shared_feed_forward_length(
            config["moe_shared_expert_intermediate_size"]
        )
        w.add_expert_count(config["n_routed_experts"])
        w.add_expert_shared_count(config["n_shared_experts"])
        w.add_expert_weights_norm(config["norm_topk_prob"])
        w.add_expert_weights_scale(config["routed_scaling_factor"])
        w.add_expert_group_count(config["n_group"])
    if mtp:
        w.add_nextn_predict_layers(1)
    _tokenizer_metadata(w, config["eos_token_id"])
    half = set()
    for name, value, hf in gguf_tensors(config, weights, mtp):
        if part == "mtp" and not (name.startswith(f"blk.{n}.") or name in SHARED):
            continue
        if value.ndim >= 2 and not hf.endswith(F32):
            value = value.astype(np.float16)
            half.add(hf)
        w.add_tensor(name, value.astype(value.dtype if value.ndim >= 2 else np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, half


def rounded(weights, half):
    """The checkpoint as the GGUF holds it: float16-stored tensors rounded."""
    out = {}
    for k, v in weights.items():
        stacked = f"blk.{k.split('.')[2]}.ffn_" if ".experts." in k else None
        if k in half or (stacked and any(h.startswith(stacked) for h in half)):
            v = v.astype(mx.float16).astype(mx.float32)
        out[k] = v
    return out


def dense_weights():
    """A Nemotron-H without MoE (``M*M-``): llama.cpp's ``nemotron_h`` arch."""
    from mlx_lm.utils import _get_classes

    drop = ("n_routed_experts", "n_shared_experts", "moe_intermediate_size",
            "moe_shared_expert_intermediate_size", "num_experts_per_tok", "n_group",
            "topk_group", "norm_topk_prob", "routed_scaling_factor",
            "num_nextn_predict_layers", "mtp_hybrid_override_pattern")  # fmt: skip
    base = tiny_recurrent.CONFIGS["nemotron_h"]
    config = {k: v for k, v in base.items() if k not in drop}
    config.update(model_type="nemotron_h", hybrid_override_pattern="M*M-")
    mx.random.seed(1)
    model_class, args_class = _get_classes(config)
    params = dict(tree_flatten(model_class(args_class.from_dict(config)).parameters()))
    tiny_recurrent._mild(params, True)
    return config, tiny_recurrent._unsanitize(params, "nemotron_h")


def rel_error(a, b):
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.abs(a - b).max() / np.abs(a).max())


def trunk_logits(model):
    logits, _ = model.target(mx.array(TOKENS)[None], model.target.make_cache())
    return logits[0]


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-nemotron")
    config, trunk_w, mtp_w = tiny_recurrent.build_weights("nemotron_h")
    weights = {**trunk_w, **mtp_w}
    path, half = write_gguf(root / "nemotron.gguf", config, weights)
    ref = tiny.save_folder(root / "ref", config, rounded(weights, half))
    return path, ref


def test_moe_gguf_gives_the_hf_trunk_and_head(moe, tmp_path):
    path, ref = moe
    info = describe(path)
    assert info.mtp_layers == 1 and info.layers == 4
    assert info.architecture == "nemotron_h_moe (nemotron_h)"
    out = convert(path, tmp_path / "out", dtype="float32")
    got, expect = mlx_mtp.load_model(out), mlx_mtp.load_model(ref)
    assert got.model_type == "nemotron_h" and got.head is not None
    assert got.config["hybrid_override_pattern"] == "M*ME"
    assert got.config["mtp_hybrid_override_pattern"] == "*E"
    assert rel_error(trunk_logits(expect), trunk_logits(got)) < 1e-5
    assert rel_error(mtp_logits(expect, TOKENS), mtp_logits(got, TOKENS)) < 1e-5
    # and it speculates: greedy output is the trunk's
    from test_speculative import mtp_greedy

    prompt = list(range(60, 90))
    with_mtp, stats, _ = mtp_greedy(got, prompt, 16, 3)
    assert with_mtp == mtp_greedy(got, prompt, 16, 0)[0] and stats.accepted > 0


def test_mtp_only_from_the_gguf(moe, tmp_path):
    path, ref = moe
    trunk = convert(path, tmp_path / "trunk", dtype="float32")
    (trunk / "mtp.safetensors").unlink()
    assert mlx_mtp.load_model(trunk).head is None
    add_mtp(path, trunk, dtype="float32")
    got, expect = mlx_mtp.load_model(trunk), mlx_mtp.load_model(ref)
    assert rel_error(mtp_logits(expect, TOKENS), mtp_logits(got, TOKENS)) < 1e-5


def test_separate_mtp_gguf(moe, tmp_path):
    """``--mtp-gguf``: a trunk file written with --no-mtp and llama.cpp's MTP file."""
    _, ref = moe
    config, trunk_w, mtp_w = tiny_recurrent.build_weights("nemotron_h")
    weights = {**trunk_w, **mtp_w}
    trunk, _ = write_gguf(tmp_path / "t.gguf", config, weights, part="trunk")
    head, _ = write_gguf(tmp_path / "mtp-t.gguf", config, weights, part="mtp")
    assert describe(trunk).mtp_layers == 0 and describe(head).mtp_layers == 1
    out = convert(trunk, tmp_path / "out", dtype="float32", mtp_gguf=head)
    got, expect = mlx_mtp.load_model(out), mlx_mtp.load_model(ref)
    assert rel_error(trunk_logits(expect), trunk_logits(got)) < 1e-5
    assert rel_error(mtp_logits(expect, TOKENS), mtp_logits(got, TOKENS)) < 1e-5


def test_dense_gguf_gives_the_hf_trunk(tmp_path):
    config, weights = dense_weights()
    path, half = write_gguf(tmp_path / "dense.gguf", config, weights)
    ref = tiny.save_folder(tmp_path / "ref", config, rounded(weights, half))
    out = convert(path, tmp_path / "out", dtype="float32")
    got, expect = mlx_mtp.load_model(out), mlx_mtp.load_model(ref)
    assert got.config["hybrid_override_pattern"] == "M*M-" and got.head is None
    assert rel_error(trunk_logits(expect), trunk_logits(got)) < 1e-5
