"""Meituan LongCat-Flash-Ngram / LongCat-Flash-Lite MTP head (``longcat_flash_ngram``).

The trunk is LongCat-Flash with an n-gram embedding (mlx-lm 0.32
``longcat_flash_ngram``); the MTP layer is LongCat-Flash's, unchanged
(``heads/longcat.py``: ``model.mtp.*``, fuse embedding first, one MLA block
with a dense MLP, its own closing norm, the trunk's ``lm_head`` and final-norm
output). vLLM pins how the layer embeds its token (vllm-project/vllm
``vllm/config/speculative.py`` @ 002e77c1f0ef9b19cff8b9e21cfbd6feb3d6b443,
``hf_config_override``: ``longcat_flash_ngram`` drafts with
``longcat_flash_mtp``; ``vllm/model_executor/models/longcat_flash_mtp.py``
@ 0bb55d60cb667d2f4e263b55304a30b38fe2e55c: ``inputs_embeds`` absent, the
token is looked up in ``model.mtp.embed_tokens``; the MTP speculator,
``vllm/v1/worker/gpu/spec_decode/target_dependent_ar/speculator.py`` @
029a811ebaf31b8ee03422af193179bc93d5fefd, hands it ``inputs_embeds`` only
for multimodal models). So the head reads the plain embedding of its own
table, no n-gram context: it keeps no n-gram state. The trunk's n-gram
window rolls back in ``recurrent/ngram_cache.py``.
"""

from ..recurrent.ngram_cache import patch_trunk  # noqa: F401  (loader hook)
from .longcat import (  # noqa: F401  (the family's interface, LongCat-Flash's)
    LongcatMTP,
    build,
    is_mtp_key,
    num_layers,
    prefix,
    sanitize_block,
)

MODEL_TYPES = {"longcat_flash_ngram": "LongCat-Flash-Lite (LongCat-Flash-Ngram)"}
