"""Rotary position embedding for every rope type the supported families use, bit-for-bit the frequencies of
transformers' `modeling_rope_utils` (fp32). Cos/sin are computed per call from the positions, so the same object
rotates a forward's fresh keys and the ShadowKV cache's rebuilt keys at their true positions."""
from __future__ import annotations

import math

import torch
import triton

from kernels.rope import rope

from .spec import ModelSpec


class RotaryEmbedding:
    """apply(x (n, h, d), positions (n,)) rotates the first `rotary_dim` channels of each head; the rest pass.

    longrope (Phi-3) and dynamic NTK choose their frequencies from the length of the sequence the token belongs
    to ("seq_lens", per token): longrope takes its long factors once that length exceeds the pretraining length,
    dynamic stretches its base past max_position_embeddings. transformers decides this per forward from
    max(positions) + 1, which is the default; a key is reproduced exactly by passing the length it was first
    rotated with."""

    def __init__(self, spec: ModelSpec, device: torch.device | str | None = None):
        self.rotary_dim = spec.rotary_dim
        self.interleaved = spec.rope_interleaved
        self.rope_type = spec.rope_type
        self.params = spec.rope_scaling or {}
        self.base = spec.rope_theta
        self.max_position_embeddings = spec.max_position_embeddings
        self.attention_factor = 1.0  # scales cos and sin (longrope, yarn)
        self.long_inv_freq = None
        inv_freq = {"default": self._default, "linear": self._linear, "dynamic": self._default,
                    "llama3": self._llama3, "longrope": self._longrope, "yarn": self._yarn}[self.rope_type]()
        self.inv_freq = inv_freq.to(device)  # (rotary_dim/2,) fp32
        if self.long_inv_freq is not None:
            self.long_inv_freq = self.long_inv_freq.to(device)

    @property
    def uses_seq_lens(self) -> bool:
        return self.rope_type in ("longrope", "dynamic")

    def apply(self, x: torch.Tensor, positions: torch.Tensor, seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        freqs = positions[:, None].float() * self.frequencies(positions, seq_lens)  # (n, rotary_dim/2), fp32
        cos = (freqs.cos() * self.attention_factor)[:, None, :]  # (n, 1, rotary_dim/2)
        sin = (freqs.sin() * self.attention_factor)[:, None, :]
        rot = x[..., :self.rotary_dim].float()
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)  # (n, h, rd)
        else:
            x1, x2 = rot.chunk(2, dim=-1)
            rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        if self.rotary_dim == x.shape[-1]:  # no channel passes: no copy to join them
            return rotated.to(x.dtype)
        return torch.cat((rotated.to(x.dtype), x[..., self.rotary_dim:]), dim=-1)

    def apply_pair(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(apply(q), apply(k)) of a forward's queries and keys; on CUDA one fused kernel (kernels.rope)."""
        d = q.shape[-1]
        if not (q.is_cuda and d == triton.next_power_of_2(d)):
            return self.apply(q, positions, seq_lens), self.apply(k, positions, seq_lens)
        freqs = self.frequencies(positions, seq_lens).float()
        return rope(q, k, positions, freqs.expand(positions.shape[0], -1), self.attention_factor, self.interleaved)

    def frequencies(self, positions: torch.Tensor, seq_lens: torch.Tensor | None) -> torch.Tensor:
        """(rotary_dim/2,) or, when it depends on the sequence length, (n, rotary_dim/2)."""
        if not self.uses_seq_lens:
            return self.inv_freq
        if seq_lens is None:
            seq_lens = (positions.max() + 1).expand(positions.shape[0])
        if self.rope_type == "longrope":
            is_long = seq_lens > self.params["original_max_position_embeddings"]
            return torch.where(is_long[:, None], self.long_inv_freq, self.inv_freq)
        return self._dynamic(seq_lens)

    def _exponents(self) -> torch.Tensor:
        return torch.arange(0, self.rotary_dim, 2, dtype=torch.int64).float() / self.rotary_dim

    def _default(self) -> torch.Tensor:
        return 1.0 / (self.base ** self._exponents())

    def _linear(self) -> torch.Tensor:
        return self._default() / self.params["factor"]

    def _dynamic(self, seq_lens: torch.Tensor) -> torch.Tensor:
        # NTK-aware base stretch for sequences longer than max_position_embeddings, in fp32 as transformers does.
        factor, max_len, dim = self.params["factor"], self.max_position_embeddings, self.rotary_dim
        stretched = self.base * ((factor * seq_lens / max_len) - (factor - 1)) ** (dim / (dim - 2))  # (n,)
        scaled = 1.0 / (stretched[:, None] ** self._exponents().to(seq_lens.device))  # (n, rotary_dim/2)
        return torch.where((seq_lens > max_len)[:, None], scaled, self.inv_freq)

    def _llama3(self) -> torch.Tensor:
        inv_freq = self._default()
        p = self.params
        factor, low, high, old_len = (p["factor"], p["low_freq_factor"], p["high_freq_factor"],
                                      p["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        return torch.where(is_medium, smoothed, scaled)

    def _longrope(self) -> torch.Tensor:
        p = self.params
        original = p["original_max_position_embeddings"]
        factor = p.get("factor") or self.max_position_embeddings / original
        self.attention_factor = p.get("attention_factor") or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original)))
        powers = self.base ** self._exponents()
        self.long_inv_freq = 1.0 / (torch.tensor(p["long_factor"], dtype=torch.float32) * powers)
        return 1.0 / (torch.tensor(p["short_factor"], dtype=torch.float32) * powers)

    def _yarn(self) -> torch.Tensor:
        p, dim, base = self.params, self.rotary_dim, self.base
        original = p["original_max_position_embeddings"]
        factor = p.get("factor") or self.max_position_embeddings / original
        self.attention_factor = p.get("attention_factor") or _yarn_attention_factor(
            factor, p.get("mscale"), p.get("mscale_all_dim"))
        low, high = _yarn_correction_range(p.get("beta_fast") or 32, p.get("beta_slow") or 1, dim, base, original,
                                           p.get("truncate", True))
        if low == high:
            high += 0.001  # as transformers: no zero-width ramp
        powers = base ** (torch.arange(0, dim, 2).float() / dim)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
        extrapolation = 1 - ramp  # share of each frequency kept unscaled
        return (1.0 / (factor * powers)) * (1 - extrapolation) + (1.0 / powers) * extrapolation


def _yarn_attention_factor(factor: float, mscale: float | None, mscale_all_dim: float | None) -> float:
    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0
    if mscale and mscale_all_dim:
        return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
    return get_mscale(factor)


def _yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, original: int,
                           truncate: bool) -> tuple[float, float]:
    """Rotary channel pairs [low, high] between which YaRN ramps from interpolation to extrapolation."""
    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original / (num_rotations * 2 * math.pi))) / (2 * math.log(base))
    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)
