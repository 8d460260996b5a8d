"""The MTP families by name: a static table, so that listing them loads no model code."""

from typing import Any, Dict, List

# What ``mlx-mtp info`` lists: model_type -> (models, MTP layers of the released
# checkpoints, how they draft: "depth" when layer j drafts depth j + 1)
RELEASED = {
    "deepseek_v3": ("DeepSeek-V3/R1", 1, ""),
    "deepseek_v32": ("DeepSeek-V3.2", 1, ""),
    "glm4_moe": ("GLM-4.5/4.6/4.7", 1, ""),
    "glm4_moe_lite": ("GLM-4.7-Flash", 1, ""),
    "glm_moe_dsa": ("GLM-5", 1, ""),
    "mimo": ("MiMo-7B", 1, ""),
    "mimo_v2_flash": ("MiMo-V2-Flash", 3, "depth"),
    "step3p5": ("Step-3.5/3.7-Flash", 3, "depth"),
    "qwen3_next": ("Qwen3-Next", 1, ""),
    "qwen3_5": ("Qwen3.5/3.6", 1, ""),
    "qwen3_5_moe": ("Qwen3.5/3.6 MoE", 1, ""),
    "ernie4_5_moe": ("ERNIE-4.5 MoE", 1, ""),
    "exaone_moe": ("EXAONE-MoE, K-EXAONE", 1, ""),
    "longcat_flash": ("LongCat-Flash", 1, ""),
    "nemotron_h": ("Nemotron-H / Nemotron 3", 1, ""),
    "kimi_linear": ("Kimi-Linear", 1, ""),
    "kimi_k3": ("Kimi-K3", 1, ""),
    "bailing_hybrid": ("Ling hybrid (Ling-2.5)", 1, ""),
    "bailing_moe_v3": ("Ling-3 (bailing_hybrid)", 1, ""),
    "gemma4": ("Gemma 4 + assistant drafter", 1, ""),
    "gemma4_text": ("Gemma 4 (text) + assistant drafter", 1, ""),
}


# Families whose checkpoints carry MTP layers that mlx-mtp cannot use yet, and why
NOT_YET = {
    "longcat_flash_ngram": "no engine source pins how its MTP layer reads the "
    "n-gram embedding",
    "deepseek_v41": "mlx-lm's LayerCache (sliding window, compressed groups) "
    "cannot roll back a verify pass",
}


def families() -> List[Dict[str, Any]]:
    """Every family with an MTP head: model_type, models, MTP layers, per depth or not."""
    return [
        {
            "model_type": model_type,
            "models": name,
            "mtp_layers": layers,
            "layer_per_depth": how == "depth",
        }
        for model_type, (name, layers, how) in RELEASED.items()
    ]
