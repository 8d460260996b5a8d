"""A DFlash drafter in numpy (float64), written from the published PyTorch
code's math (z-lab/dflash ``dflash/model.py``: ``Qwen3DFlashAttention``,
``Qwen3DFlashDecoderLayer``, ``DFlashDraftModel.forward`` and
``compute_logits``, ``_attention_mask``, ``dflash_generate``), independently
of ``mlx_mtp.drafters.dflash``: it reads the folder's ``config.json`` and
safetensors itself.

One forward: the context ``hidden_norm(fc(features))`` at positions
``0..S-1`` gives every layer keys and values (its own ``k_proj``, ``k_norm``,
RoPE) and the block ``[y, MASK...]`` at positions ``S..S+B-1`` queries the
context and itself; a full-attention layer sees everything (``is_causal``
unset), a sliding one causally within its window. Drafts are the target's
output head over the final norm at block positions ``1..B-1``. DFlash 2
(``DFlash2DraftModel``): the convolution around each sublayer and the
candidate selector's greedy path, from the same file.
"""

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


class NumpyDFlash:
    def __init__(self, folder: Path, embed: np.ndarray, lm_head: np.ndarray):
        folder = Path(folder)
        self.cfg = json.loads((folder / "config.json").read_text())
        self.w = {
            k: v.astype(np.float64)
            for k, v in load_file(str(folder / "model.safetensors")).items()
        }
        self.embed = embed.astype(np.float64)
        self.lm_head = lm_head.astype(np.float64)

    def _get(self, name, default=None):
        inner = self.cfg.get("dflash_config", {})
        return inner.get(name, self.cfg.get(name, default))

    @property
    def mask_token_id(self) -> int:
        return int(self._get("mask_token_id"))

    @property
    def layer_ids(self):
        return list(self._get("target_layer_ids"))

    def _theta(self) -> float:
        if "rope_theta" in self.cfg:
            return float(self.cfg["rope_theta"])
        return float(self.cfg["rope_parameters"]["rope_theta"])

    def _rms(self, x, w):
        eps = self.cfg["rms_norm_eps"]
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    def _rope(self, x, pos):
        """``x [heads, L, hd]`` rotated at positions ``pos`` (rotate_half form)."""
        hd = x.shape[-1]
        inv = self._theta() ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        ang = pos[:, None] * inv[None]
        cos = np.concatenate([np.cos(ang)] * 2, -1)
        sin = np.concatenate([np.sin(ang)] * 2, -1)
        half = hd // 2
        rot = np.concatenate([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    def _layer_kind(self, i):
        types = self.cfg.get("layer_types")
        kind = types[i] if types else "full_attention"
        causal = self.cfg.get("is_causal")
        causal = (kind == "sliding_attention") if causal is None else bool(causal)
        window = self.cfg["sliding_window"] if kind == "sliding_attention" else None
        return causal, window

    def _conv(self, h, dynamic, base):
        """DFlash 2's grouped causal convolution over the block (model.py's
        ``_grouped_dynamic_convolve``): ``sum_o (base[o] + dyn[t, o]) * h[t-o]``."""
        B, D = h.shape
        group = self._get("conv_group_size")
        x = h.reshape(B, D // group, group)
        out = np.zeros_like(x)
        for o in range(base.shape[0]):
            past = np.zeros_like(x)
            past[o:] = x[: B - o] if o < B else 0
            out += (base[o].reshape(D // group, group) + dynamic[:, o, :, None]) * past
        return out.reshape(B, D)

    def _prepare(self, h, prefix):
        """The convolved input and the kernels of the output's convolution."""
        w = self.w
        if prefix + "base_kernel" not in w:
            return h, None
        kernel, group = self._get("conv_kernel_size"), self._get("conv_group_size")
        dyn = (h @ w[prefix + "kernel_projection.weight"].T).reshape(
            h.shape[0], 2, kernel, h.shape[1] // group
        )
        return self._conv(h, dyn[:, 0], w[prefix + "base_kernel"][0]), dyn[:, 1]

    def _finish(self, h, dyn, prefix):
        if dyn is None:
            return h
        return self._conv(h, dyn, self.w[prefix + "base_kernel"][1])

    def select(self, hidden: np.ndarray, logits: np.ndarray, anchor: int):
        """DFlash 2's greedy path (model.py's ``CandidateSelector.select``):
        each slot's top-k candidates scored by their logit plus
        ``<pred[previous] * P h, succ[candidate]>``."""
        w, top = self.w, self._get("selector_top_k")
        proj = hidden @ w["candidate_selector.hidden_projection.weight"].T
        pred = w["candidate_selector.predecessor_codebook"]
        succ = w["candidate_selector.successor_codebook"]
        previous, path = anchor, []
        for j in range(logits.shape[0]):
            cands = np.argsort(-logits[j])[:top]
            scores = logits[j, cands] + (pred[previous] * proj[j] * succ[cands]).sum(-1)
            previous = int(cands[np.argmax(scores)])
            path.append(previous)
        return path

    def logits(self, features: np.ndarray, block) -> np.ndarray:
        """``features [S, n_taps * D]`` (the target's layer outputs at positions
        ``0..S-1``), ``block`` token ids: logits ``[len(block) - 1, V]``."""
        return self.head(self.hidden(features, block))

    def head(self, h: np.ndarray) -> np.ndarray:
        logits = h @ self.lm_head.T * float(self._get("output_multiplier", 1.0))
        cap = self._get("final_logit_softcapping")
        if cap:
            logits = np.tanh(logits / cap) * cap
        return logits

    def hidden(self, features: np.ndarray, block) -> np.ndarray:
        """The final hidden states at block positions ``1..``."""
        cfg, w = self.cfg, self.w
        S, B = features.shape[0], len(block)
        H, KV, hd = (
            cfg["num_attention_heads"],
            cfg["num_key_value_heads"],
            cfg["head_dim"],
        )
        ctx = self._rms(
            features.astype(np.float64) @ w["fc.weight"].T, w["hidden_norm.weight"]
        )
        h = self.embed[np.array(block)] * float(self._get("input_embedding_scale", 1.0))
        pos = np.arange(S + B, dtype=np.float64)
        qpos, kpos = np.arange(S, S + B)[:, None], np.arange(S + B)[None]
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            x = self._rms(h, w[p + "input_layernorm.weight"])
            x, dyn = self._prepare(x, p + "attention_conv.")
            q = (x @ w[p + "self_attn.q_proj.weight"].T).reshape(B, H, hd)
            q = self._rms(q, w[p + "self_attn.q_norm.weight"]).transpose(1, 0, 2)
            both = np.concatenate([ctx, x])
            k = (both @ w[p + "self_attn.k_proj.weight"].T).reshape(S + B, KV, hd)
            k = self._rms(k, w[p + "self_attn.k_norm.weight"]).transpose(1, 0, 2)
            v = (both @ w[p + "self_attn.v_proj.weight"].T).reshape(S + B, KV, hd)
            v = v.transpose(1, 0, 2)
            q, k = self._rope(q, pos[S:]), self._rope(k, pos)
            k, v = np.repeat(k, H // KV, 0), np.repeat(v, H // KV, 0)
            scores = q @ k.transpose(0, 2, 1) * hd**-0.5
            causal, window = self._layer_kind(i)
            visible = np.ones((B, S + B), bool)
            if causal:
                visible &= kpos <= qpos
            if window is not None:
                visible &= qpos - kpos < window
                if not causal:
                    visible &= kpos - qpos < window
            scores = np.where(visible[None], scores, -np.inf)
            scores -= scores.max(-1, keepdims=True)
            att = np.exp(scores)
            att /= att.sum(-1, keepdims=True)
            o = (att @ v).transpose(1, 0, 2).reshape(B, H * hd)
            o = o @ w[p + "self_attn.o_proj.weight"].T
            h = h + self._finish(o, dyn, p + "attention_conv.")
            x = self._rms(h, w[p + "post_attention_layernorm.weight"])
            x, dyn = self._prepare(x, p + "mlp_conv.")
            gate = x @ w[p + "mlp.gate_proj.weight"].T
            up = x @ w[p + "mlp.up_proj.weight"].T
            m = (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
            h = h + self._finish(m, dyn, p + "mlp_conv.")
        return self._rms(h, w["norm.weight"])[1:]
