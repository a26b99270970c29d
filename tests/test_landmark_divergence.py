"""The landmark divergence of training/objectives.py: how far ShadowKV's chunk scores are from dense
attention."""
import math

import torch

from training.objectives import landmark_divergence, rank_attention_divergence, rank_logit_error, rotate


def rope(length: int, d: int, theta: float = 500000.0) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    angles = torch.arange(length).float()[:, None] * inv
    emb = torch.cat([angles, angles], -1)
    return emb.cos(), emb.sin()


def brute_force(queries, keys, answer_mask, cos, sin, kv_heads, chunk, window):
    """The same quantity, one answer position and query head at a time."""
    B, L, _ = keys.shape
    d = cos.shape[-1]
    Hq = queries.shape[-1] // d
    total = count = 0.0
    for b in range(B):
        for t in answer_mask[b].nonzero().flatten().tolist():
            count += 1
            for h in range(Hq):
                kh = h // (Hq // kv_heads)
                k = rotate(keys[b, :, kh * d:(kh + 1) * d].double(), cos.double(), sin.double())  # (L, d)
                q = rotate(queries[b, t, h * d:(h + 1) * d].double(), cos[t].double(), sin[t].double())
                attn = torch.softmax(k[:t + 1] @ q / math.sqrt(d), 0)
                chunks = [c for c in range(L // chunk) if (c + 1) * chunk - 1 < t - window]
                p = torch.stack([attn[c * chunk:(c + 1) * chunk].sum() for c in chunks])
                covered = p.sum()
                p = p / covered
                logits = torch.stack([k[c * chunk:(c + 1) * chunk].mean(0) @ q / math.sqrt(d) for c in chunks])
                kl = (p * (p.log() - torch.log_softmax(logits, 0))).sum()
                total += float(kl * covered) / Hq
    return total / max(count, 1)


def random_case(seed: int, B=3, L=96, Hq=4, Hkv=2, d=8):
    g = torch.Generator().manual_seed(seed)
    queries = torch.randn(B, L, Hq * d, generator=g)
    keys = torch.randn(B, L, Hkv * d, generator=g)
    mask = torch.zeros(B, L, dtype=torch.bool)
    mask[0, 60:67] = True  # a task row's answer
    mask[2, 85:96] = True  # one that runs to the row's end
    return queries, keys, mask  # row 1: plain text, no answer


def test_matches_brute_force_on_random_rows():
    queries, keys, mask = random_case(0)
    cos, sin = rope(96, 8)
    got = landmark_divergence(queries, keys, mask, cos, sin, num_kv_heads=2, chunk=4, window=8, span=12)
    want = brute_force(queries, keys, mask, cos, sin, 2, 4, 8)
    assert want > 0.01
    assert abs(float(got) - want) < 1e-4 * max(1.0, want)


def test_zero_when_landmarks_stand_for_their_chunks_and_without_answers():
    queries, keys, mask = random_case(1)
    keys = keys.view(3, 24, 4, 16)[:, :, :1].expand(-1, -1, 4, -1).reshape(3, 96, 16)  # one key per chunk of 4
    still = torch.ones(96, 8), torch.zeros(96, 8)  # no rotation: every token of a chunk has its landmark's key
    assert float(landmark_divergence(queries, keys, mask, *still, num_kv_heads=2, chunk=4, window=8, span=12)) < 1e-6
    none = torch.zeros_like(mask)
    assert float(landmark_divergence(queries, keys, none, *rope(96, 8), num_kv_heads=2, chunk=4, window=8)) == 0.0


def test_its_gradient_lowers_it():
    queries, keys, mask = random_case(2)
    cos, sin = rope(96, 8)
    keys.requires_grad_()
    before = landmark_divergence(queries, keys, mask, cos, sin, num_kv_heads=2, chunk=4, window=8, span=12)
    before.backward()
    assert torch.isfinite(keys.grad).all()
    with torch.no_grad():
        step = keys - 0.05 * keys.grad / keys.grad.norm() * keys.norm()
        after = landmark_divergence(queries, step, mask, cos, sin, num_kv_heads=2, chunk=4, window=8, span=12)
    assert after < before


def brute_force_rank(queries, keys, answer_mask, cos, sin, kv_heads, rank):
    """KL(dense || rank-r keys' attention), one answer position and query head at a time, the basis from eigh."""
    B, L, _ = keys.shape
    d = cos.shape[-1]
    Hq = queries.shape[-1] // d
    total = count = 0.0
    for b in range(B):
        k_cat = keys[b].double()
        basis = torch.linalg.eigh(k_cat.T @ k_cat)[1][:, -rank:]
        low = k_cat @ basis @ basis.T
        for t in answer_mask[b].nonzero().flatten().tolist():
            count += 1
            for h in range(Hq):
                kh = h // (Hq // kv_heads)
                q = rotate(queries[b, t, h * d:(h + 1) * d].double(), cos[t].double(), sin[t].double())
                exact, approx = (rotate(x[:t + 1, kh * d:(kh + 1) * d], cos[:t + 1].double(), sin[:t + 1].double())
                                 for x in (k_cat, low))
                p = torch.softmax(exact @ q / math.sqrt(d), 0)
                total += float((p * (p.log() - torch.log_softmax(approx @ q / math.sqrt(d), 0))).sum()) / Hq
    return total / max(count, 1)


def test_rank_attention_divergence_matches_brute_force():
    queries, keys, mask = random_case(3)
    cos, sin = rope(96, 8)
    got = rank_attention_divergence(queries, keys, mask, cos, sin, num_kv_heads=2, rank=5, iters=None, span=12)
    want = brute_force_rank(queries, keys, mask, cos, sin, 2, 5)
    assert want > 0.01
    assert abs(float(got) - want) < 1e-4 * max(1.0, want)


def test_rank_attention_divergence_is_zero_for_keys_of_that_rank_and_its_gradient_lowers_it():
    queries, keys, mask = random_case(4)
    cos, sin = rope(96, 8)
    g = torch.Generator().manual_seed(5)
    low = torch.randn(3, 96, 4, generator=g) @ torch.randn(4, 16, generator=g)  # rank 4 of 16
    assert float(rank_attention_divergence(queries, low, mask, cos, sin, num_kv_heads=2, rank=4, span=12)) < 1e-5
    keys.requires_grad_()
    before = rank_attention_divergence(queries, keys, mask, cos, sin, num_kv_heads=2, rank=4, span=12)
    before.backward()
    assert torch.isfinite(keys.grad).all()
    with torch.no_grad():
        step = keys - 0.05 * keys.grad / keys.grad.norm() * keys.norm()
        after = rank_attention_divergence(queries, step, mask, cos, sin, num_kv_heads=2, rank=4, span=12)
    assert after < before


def test_rank_logit_error_matches_brute_force_and_moves_only_the_keys():
    queries, keys, mask = random_case(6)
    cos, sin = rope(96, 8)
    queries.requires_grad_()
    keys.requires_grad_()
    got = rank_logit_error(queries, keys, mask, cos, sin, num_kv_heads=2, rank=5, iters=None, span=12)
    B, L, _ = keys.shape
    total = count = 0.0
    for b in range(B):
        k_cat = keys[b].detach().double()
        basis = torch.linalg.eigh(k_cat.T @ k_cat)[1][:, -5:]
        for t in mask[b].nonzero().flatten().tolist():
            count += 1
            for h in range(4):
                kh = h // 2
                q = rotate(queries[b, t, h * 8:(h + 1) * 8].detach().double(), cos[t].double(), sin[t].double())
                exact, dropped = (rotate(x[:t + 1, kh * 8:(kh + 1) * 8], cos[:t + 1].double(), sin[:t + 1].double())
                                  for x in (k_cat, k_cat - k_cat @ basis @ basis.T))
                p = torch.softmax(exact @ q / math.sqrt(8), 0)
                total += float((p * (dropped @ q / math.sqrt(8)) ** 2).sum()) / 4
    want = total / count
    assert want > 1e-3
    assert abs(float(got.detach()) - want) < 1e-4 * max(1.0, want)
    got.backward()
    assert queries.grad is None and torch.isfinite(keys.grad).all() and keys.grad.abs().sum() > 0
