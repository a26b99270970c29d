"""Shared pieces of the kernel tests (no tests here): where kernels run, ragged paged inputs, and a comparison
that prints the mismatching elements (Liger-Kernel style per-dtype tolerances).

Without CUDA the kernels run in Triton's interpreter (conftest.py sets TRITON_INTERPRET=1 before any kernel exists)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-3, 2e-3), torch.bfloat16: (2e-2, 2e-2)}
# Llama-3.1-8B geometry, the real sizes.
LLAMA = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, rank=160, chunk_size=8, budget_chunks=256, outliers=48)


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def rotary_for_tests(rotary_dim: int, interleaved: bool = False, scaling: dict | None = None, device=DEVICE):
    """The model's RotaryEmbedding from the few spec fields it reads."""
    from shadowkv_core.models.rotary import RotaryEmbedding
    spec = SimpleNamespace(rotary_dim=rotary_dim, rope_interleaved=interleaved,
                           rope_type=(scaling or {}).get("rope_type", "default"), rope_scaling=scaling,
                           rope_theta=500000.0, max_position_embeddings=131072)
    return RotaryEmbedding(spec, device)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, name: str,
                 tol: tuple[float, float] | None = None) -> None:
    atol, rtol = tol or TOLERANCES[dtype]
    actual, expected = actual.float().cpu(), expected.float().cpu()
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    same_inf = torch.isinf(expected) & (actual == expected)
    ok = same_inf | ((actual - expected).abs() <= atol + rtol * expected.abs())  # NaN never passes
    if bool(ok.all()):
        return
    bad = (~ok).nonzero()
    lines = [f"  {tuple(i.tolist())}: got {actual[tuple(i)].item():.6g}, expected {expected[tuple(i)].item():.6g}"
             for i in bad[:12]]
    pytest.fail(f"{name}: {len(bad)} of {ok.numel()} elements differ (atol {atol}, rtol {rtol}):\n" + "\n".join(lines))


def ragged_lengths(longest: int, batch: int, seed: int) -> list[int]:
    """`batch` lengths drawn uniformly between half of `longest` and `longest` (a ragged batch at real sizes)."""
    g = torch.Generator().manual_seed(seed)
    return [int(longest * f) for f in torch.empty(batch).uniform_(0.5, 1, generator=g)]


def page_tables(rows_per_seq: list[int], page_rows: int, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """Each sequence's pages scattered at random over one pool -> table (B, max_pages) int32, pool pages."""
    pages = [max(1, -(-n // page_rows)) for n in rows_per_seq]
    total = sum(pages) + 3  # a few pages nobody owns
    perm = torch.randperm(total, generator=generator)
    table = torch.zeros(len(pages), max(pages), dtype=torch.int32)
    start = 0
    for b, p in enumerate(pages):
        table[b, :p] = perm[start:start + p]
        start += p
    return table.to(DEVICE), total


def slot_ids_for(batch: int, num_slots: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randperm(num_slots, generator=generator)[:batch].int().to(DEVICE)


def random_misses(batch: int, num_kv_heads: int, num_slots_per_head: int, num_chunks: list[int],
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Miss lists as assign_slots writes them: per (sequence, head) distinct chunks and distinct slots, ragged
    counts, entries past the count left as garbage (-7)."""
    K = num_slots_per_head
    chunks = torch.full((batch, num_kv_heads, K), -7, dtype=torch.int32)
    slots = torch.full_like(chunks, -7)
    counts = torch.zeros(batch, num_kv_heads, dtype=torch.int32)
    for b in range(batch):
        for h in range(num_kv_heads):
            m = int(torch.randint(0, min(K, num_chunks[b]) + 1, (1,), generator=generator))
            chunks[b, h, :m] = torch.randperm(num_chunks[b], generator=generator)[:m].int()
            slots[b, h, :m] = torch.randperm(K, generator=generator)[:m].sort().values.int()
            counts[b, h] = m
    return chunks.to(DEVICE), slots.to(DEVICE), counts.to(DEVICE)
