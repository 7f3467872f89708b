"""Symmetry transforms planted by hand on Hugging Face's own parameter names, written apart from
``glmc.symmetry.transforms`` so that what glmc's matchers undo is not something glmc made itself (the invariance
tests and the scaling benchmark use them).

Each planter moves a native state dict in its own dtype, one tensor at a time (a billion-parameter model is not held
twice): norm gains folded into their readers, then a residual rotation, KV-head and in-group query permutations, a
q/k map commuting with the rotary positions and a v/o map per KV head, and an MLP permutation (with a scale on the
linear side of a gated MLP where ``orthogonal`` is false).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

State = dict[str, torch.Tensor]
LLAMA_LAYER = "model.layers.{}."


def orthogonal(n: int, g: torch.Generator) -> torch.Tensor:
    """A Haar-random orthogonal n × n matrix (float64)."""
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def rotary_map(head_dim: int, rotary: int, g: torch.Generator, is_orthogonal: bool) -> torch.Tensor:
    """A map that commutes with rotary positions on the first ``rotary`` dimensions: per ``rotate_half`` pair
    (i, i + rotary/2) a rotation times a scale; on the dimensions left alone, any orthogonal (or invertible) map."""
    half = rotary // 2
    m = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    for i in range(half):
        angle = float(torch.rand(1, generator=g)) * 6.283
        scale = 1.0 if is_orthogonal else float(torch.exp(0.3 * torch.randn(1, generator=g)))
        c, s = scale * torch.cos(torch.tensor(angle)), scale * torch.sin(torch.tensor(angle))
        m[i, i], m[i, i + half], m[i + half, i], m[i + half, i + half] = c, -s, s, c
    if rotary < head_dim:
        m[rotary:, rotary:] = free_map(head_dim - rotary, g, is_orthogonal)
    return m


def free_map(n: int, g: torch.Generator, is_orthogonal: bool) -> torch.Tensor:
    """An orthogonal map, or an invertible one near the identity."""
    if is_orthogonal:
        return orthogonal(n, g)
    return torch.eye(n, dtype=torch.float64) + 0.3 * torch.randn(n, n, generator=g, dtype=torch.float64) / n**0.5


def _times(w: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """w @ m in w's dtype."""
    return w @ m.to(w.dtype)


def _fold_llama(s: State, hf: Any) -> None:
    """Each RMSNorm's gain into the linear layers that read it; the gains become ones."""
    for i in range(hf.num_hidden_layers):
        p = LLAMA_LAYER.format(i)
        for norm, readers in (("input_layernorm", ("self_attn.q", "self_attn.k", "self_attn.v")),
                              ("post_attention_layernorm", ("mlp.gate", "mlp.up"))):
            gain = s[f"{p}{norm}.weight"]
            for r in readers:
                s[f"{p}{r}_proj.weight"] = s[f"{p}{r}_proj.weight"] * gain
            s[f"{p}{norm}.weight"] = torch.ones_like(gain)
    s["lm_head.weight"] = s["lm_head.weight"] * s["model.norm.weight"]
    s["model.norm.weight"] = torch.ones_like(s["model.norm.weight"])


def _llama_heads(s: State, p: str, hf: Any, q: torch.Tensor, g: torch.Generator, is_orthogonal: bool) -> None:
    """Layer ``p``'s attention moved by the residual rotation q, KV-head and in-group permutations, per-KV-head maps."""
    heads, kv, d, head_dim = hf.num_attention_heads, hf.num_key_value_heads, hf.hidden_size, hf.head_dim
    group = heads // kv
    kv_perm = torch.randperm(kv, generator=g)
    query_perm = torch.stack([torch.randperm(group, generator=g) for _ in range(kv)])
    m = [rotary_map(head_dim, head_dim, g, is_orthogonal) for _ in range(kv)]
    n = [free_map(head_dim, g, is_orthogonal) for _ in range(kv)]
    names = {r: f"{p}self_attn.{r}_proj.weight" for r in ("q", "k", "v", "o")}
    wq, wk, wv = (s[names[r]].reshape(kv, -1, head_dim, d) for r in ("q", "k", "v"))
    wo = s[names["o"]].reshape(d, kv, group, head_dim)
    new_q, new_k, new_v, new_o = (torch.empty_like(x) for x in (wq, wk, wv, wo))
    for h in range(kv):
        old = int(kv_perm[h])
        inverse_n = torch.linalg.inv(n[h])
        new_k[h, 0] = torch.linalg.inv(m[h]).T.to(wk.dtype) @ wk[old, 0]
        new_v[h, 0] = n[h].to(wv.dtype) @ wv[old, 0]
        for j in range(group):
            new_q[h, j] = m[h].to(wq.dtype) @ wq[old, int(query_perm[h, j])]
            new_o[:, h, j] = _times(wo[:, old, int(query_perm[h, j])], inverse_n)
    for r, new in (("q", new_q), ("k", new_k), ("v", new_v)):
        s[names[r]] = _times(new.reshape(-1, d), q.T)
    s[names["o"]] = q.to(new_o.dtype) @ new_o.reshape(d, -1)


def plant_llama(sd: Mapping[str, torch.Tensor], hf: Any, seed: int, is_orthogonal: bool = True) -> State:
    """A ``LlamaForCausalLM`` (or Mistral, Qwen2 without biases) state dict moved by every symmetry class of the
    family, in its own dtype; ``hf`` is its transformers config. Replaces the dict's tensors one by one."""
    g = torch.Generator().manual_seed(seed)
    s = dict(sd)
    _fold_llama(s, hf)
    q = orthogonal(hf.hidden_size, g)
    for key in ("model.embed_tokens.weight", "lm_head.weight"):
        s[key] = _times(s[key], q.T)
    for i in range(hf.num_hidden_layers):
        p = LLAMA_LAYER.format(i)
        _llama_heads(s, p, hf, q, g, is_orthogonal)
        f = hf.intermediate_size
        perm = torch.randperm(f, generator=g)
        scale = torch.ones(f, dtype=torch.float64) if is_orthogonal else torch.exp(
            0.5 * torch.randn(f, generator=g, dtype=torch.float64))
        gate, up, down = (f"{p}mlp.{r}_proj.weight" for r in ("gate", "up", "down"))
        s[gate] = _times(s[gate][perm], q.T)
        s[up] = _times(s[up][perm] * scale[:, None].to(s[up].dtype), q.T)
        s[down] = q.to(s[down].dtype) @ (s[down][:, perm] / scale.to(s[down].dtype))
    return s


NEOX_LAYER = "gpt_neox.layers.{}."


def orthogonal_fixing_ones(n: int, g: torch.Generator) -> torch.Tensor:
    """A random orthogonal n × n matrix with Q·1 = 1: it commutes with a LayerNorm's centring."""
    ones = torch.ones(n, 1, dtype=torch.float64) / n**0.5
    basis, _ = torch.linalg.qr(torch.cat([ones, torch.randn(n, n - 1, generator=g, dtype=torch.float64)], 1))
    rest = basis[:, 1:]
    return rest @ orthogonal(n - 1, g) @ rest.T + ones @ ones.T


def _fold_layernorm(s: State, norm: str, readers: tuple[str, ...]) -> None:
    """A LayerNorm's gain and bias into the linear layers reading it (weight · diag(γ), bias + weight · β)."""
    gain, shift = s[f"{norm}.weight"], s[f"{norm}.bias"]
    for r in readers:
        weight = s[f"{r}.weight"]
        s[f"{r}.bias"] = s[f"{r}.bias"] + weight @ shift
        s[f"{r}.weight"] = weight * gain
    s[f"{norm}.weight"], s[f"{norm}.bias"] = torch.ones_like(gain), torch.zeros_like(shift)


def _neox_heads(s: State, p: str, hf: Any, q: torch.Tensor, g: torch.Generator, is_orthogonal: bool) -> None:
    """Layer ``p``'s fused q|k|v (per head: q, k, v rows) and dense moved by the residual map q, a head permutation,
    a q/k map commuting with the partial rotary, and a v/o map per head."""
    heads, d = hf.num_attention_heads, hf.hidden_size
    head_dim = d // heads
    rotary = int(head_dim * dict(hf.rope_parameters or {}).get("partial_rotary_factor", 1.0))
    perm = torch.randperm(heads, generator=g)
    m = [rotary_map(head_dim, rotary, g, is_orthogonal) for _ in range(heads)]
    n = [free_map(head_dim, g, is_orthogonal) for _ in range(heads)]
    fused, dense = f"{p}attention.query_key_value", f"{p}attention.dense.weight"
    w = s[f"{fused}.weight"].reshape(heads, 3, head_dim, d)
    b = s[f"{fused}.bias"].reshape(heads, 3, head_dim)
    o = s[dense].reshape(d, heads, head_dim)
    new_w, new_b, new_o = torch.empty_like(w), torch.empty_like(b), torch.empty_like(o)
    for h in range(heads):
        old = int(perm[h])
        for slot, mat in enumerate((m[h], torch.linalg.inv(m[h]).T, n[h])):
            new_w[h, slot] = mat.to(w.dtype) @ w[old, slot]
            new_b[h, slot] = mat.to(b.dtype) @ b[old, slot]
        new_o[:, h] = _times(o[:, old], torch.linalg.inv(n[h]))
    s[f"{fused}.weight"] = _times(new_w.reshape(-1, d), q.T)
    s[f"{fused}.bias"] = new_b.reshape(-1)
    s[dense] = q.to(new_o.dtype) @ new_o.reshape(d, -1)
    s[f"{p}attention.dense.bias"] = _times(s[f"{p}attention.dense.bias"], q.T)


def plant_neox(sd: Mapping[str, torch.Tensor], hf: Any, seed: int, is_orthogonal: bool = True) -> State:
    """A ``GPTNeoXForCausalLM`` state dict (attention biases on) moved by every symmetry class of the family, in its
    own dtype: LayerNorms folded, a residual rotation fixing the ones vector, head permutations, per-head maps
    commuting with the partial rotary, MLP permutations (GELU: no scale)."""
    g = torch.Generator().manual_seed(seed)
    s = dict(sd)
    for i in range(hf.num_hidden_layers):
        p = NEOX_LAYER.format(i)
        _fold_layernorm(s, f"{p}input_layernorm", (f"{p}attention.query_key_value",))
        _fold_layernorm(s, f"{p}post_attention_layernorm", (f"{p}mlp.dense_h_to_4h",))
    final = "gpt_neox.final_layer_norm"  # the head has no bias to take β: it stays, as β/γ, and turns with the stream
    gain = s[f"{final}.weight"]
    s["lm_head.weight"], s[f"{final}.bias"] = s["lm_head.weight"] * gain, s[f"{final}.bias"] / gain
    s[f"{final}.weight"] = torch.ones_like(gain)
    q = orthogonal_fixing_ones(hf.hidden_size, g)
    for key in ("gpt_neox.embed_in.weight", "lm_head.weight", f"{final}.bias"):
        s[key] = _times(s[key], q.T)
    for i in range(hf.num_hidden_layers):
        p = NEOX_LAYER.format(i)
        _neox_heads(s, p, hf, q, g, is_orthogonal)
        perm = torch.randperm(hf.intermediate_size, generator=g)
        up, down = f"{p}mlp.dense_h_to_4h", f"{p}mlp.dense_4h_to_h"
        s[f"{up}.weight"] = _times(s[f"{up}.weight"][perm], q.T)
        s[f"{up}.bias"] = s[f"{up}.bias"][perm]
        s[f"{down}.weight"] = q.to(s[f"{down}.weight"].dtype) @ s[f"{down}.weight"][:, perm]
        s[f"{down}.bias"] = _times(s[f"{down}.bias"], q.T)
    return s


PLANTERS = {"llama": plant_llama, "mistral": plant_llama, "neox": plant_neox}
