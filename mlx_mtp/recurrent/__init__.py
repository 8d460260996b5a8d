"""Rollback for recurrent layers: states kept per token during a verify pass.

Attention caches roll back by trimming. A recurrent layer (gated delta net,
Kimi delta attention, Mamba2, lightning attention) has one state that every
token overwrites, so during a verify pass its cache keeps the state and the
conv window after each token (``keep_states.KeepStatesCache``) and a rollback
selects the one after the last kept token: no recomputation, nothing kept
outside a verify pass. Per layer kind a mixin over mlx-lm's layer class
(``KeepStates<Layer>``) writes those states; ``gated_delta`` and ``ssm_keep``
are the kept ops, each with a pure-MLX reference and Metal/CUDA kernels
(``metal/``) sharing ``kernels``' dispatch and first-use check.
"""
