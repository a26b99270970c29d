"""Each step of the ShadowKV reference on random inputs."""
import pytest
import torch

from shadowkv_core.attention import attention_ref
from shadowkv_core.shadowkv.reference import (_gram, assign_slots, chunk_landmarks, factorize_keys, find_outlier_chunks,
                                              gather_values, landmark_scores, meet_landmarks, paged_rows,
                                              project_keys,
                                              rebuild_keys, scoring_query, select_chunks,
                                              sparse_decode_attention_ref)


class RopeForTests:
    """Rotate-half RoPE with the `apply(x (n, h, d), positions (n,))` interface of the model's rotary (fp32 math);
    its frequencies do not depend on the sequence length."""

    uses_seq_lens = False
    interleaved = False
    attention_factor = 1.0

    def __init__(self, head_dim: int, base: float = 10000.0):
        self.inv_freq = base ** (-torch.arange(0, head_dim, 2).float() / head_dim)  # (d/2,)

    def frequencies(self, positions: torch.Tensor, seq_lens=None) -> torch.Tensor:
        return self.inv_freq.to(positions.device)

    def apply(self, x: torch.Tensor, positions: torch.Tensor, seq_lens=None) -> torch.Tensor:
        angles = positions.float()[:, None] * self.inv_freq.to(positions.device)  # (n, d/2)
        cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]  # (n, 1, d)
        sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]
        x1, x2 = x.float().chunk(2, -1)
        return (x.float() * cos + torch.cat([-x2, x1], -1) * sin).to(x.dtype)


def test_factorize_full_rank_reconstructs():
    torch.manual_seed(0)
    k_pre = torch.randn(200, 2, 16)
    u, sv = factorize_keys(k_pre, rank=32)
    assert u.shape == (200, 32) and sv.shape == (2, 32, 16)
    rebuilt = torch.einsum("sr,hrd->shd", u, sv)
    torch.testing.assert_close(rebuilt, k_pre, atol=2e-5, rtol=1e-5)


def test_factorize_exactly_is_the_best_rank_r_approximation():
    """iters None (eigh): the best rank-r approximation; the default's distance from it: the subspace iteration test."""
    torch.manual_seed(0)
    k_pre = torch.randn(300, 2, 8) @ torch.randn(8, 8)  # (S, Hkv, d)
    u, sv = factorize_keys(k_pre, rank=5, iters=None)
    k_cat = k_pre.reshape(300, 16)
    rebuilt = torch.einsum("sr,hrd->shd", u, sv).reshape(300, 16)
    uu, s, vh = torch.linalg.svd(k_cat, full_matrices=False)
    best = (uu[:, :5] * s[:5]) @ vh[:5]
    torch.testing.assert_close(rebuilt, best, atol=1e-3, rtol=1e-3)


def test_project_keys_matches_factorize_rows():
    torch.manual_seed(0)
    k_pre = torch.randn(64, 2, 8)
    u, sv = factorize_keys(k_pre, rank=6)
    torch.testing.assert_close(project_keys(k_pre[40:], sv), u[40:], atol=1e-5, rtol=1e-5)


def test_chunk_landmarks_are_chunk_means():
    k_rot = torch.randn(6 * 4, 3, 5)
    lm = chunk_landmarks(k_rot, 4)
    assert lm.shape == (6, 3, 5)
    torch.testing.assert_close(lm[2], k_rot[8:12].mean(0))


@pytest.mark.parametrize("kind", ["mean", "bounds"])
def test_meet_landmarks_keeps_exact_keys(kind):
    torch.manual_seed(1)
    C, n, d = 8, 10, 16
    keys = torch.randn(n, C, d) * torch.rand(d) * 3
    lm = chunk_landmarks(keys.reshape(n * C, 1, d), C, kind)[:, 0]  # (n, d or 2d)
    torch.testing.assert_close(meet_landmarks(keys, lm, kind), keys)


def test_meet_landmarks_mean_takes_out_an_error_a_chunk_shares():
    torch.manual_seed(1)
    C, n, d = 8, 10, 16
    keys = torch.randn(n, C, d) * torch.rand(d) * 3
    lm = chunk_landmarks(keys.reshape(n * C, 1, d), C, "mean")[:, 0]
    shared = torch.randn(n, 1, d)  # an error every key of a chunk has alike
    torch.testing.assert_close(meet_landmarks(keys + shared, lm, "mean"), keys, atol=1e-5, rtol=1e-5)


def test_meet_landmarks_bounds_clamp_each_key_into_the_bounds_and_never_move_it_away():
    """Any rebuild, however wrong: every output lies in its chunk's bounds, each coordinate is the rebuilt one or the
    bound nearest it, and none is farther from the exact key than the rebuilt one (the exact value lies inside)."""
    torch.manual_seed(2)
    C, n, d = 8, 10, 16
    keys = torch.randn(n, C, d)
    rebuilt = keys + torch.randn(n, C, d) * 0.7 + torch.randn(n, 1, d) * 0.5
    lm = chunk_landmarks(keys.reshape(n * C, 1, d), C, "bounds")[:, 0]
    out = meet_landmarks(rebuilt, lm, "bounds")
    centre, half = lm[:, None, :d], lm[:, None, d:]
    low, high = centre - half, centre + half
    assert bool(((out >= low - 1e-6) & (out <= high + 1e-6)).all())
    inside = (rebuilt >= low) & (rebuilt <= high)
    torch.testing.assert_close(out[inside], rebuilt[inside])
    torch.testing.assert_close(out[rebuilt < low], low.expand_as(out)[rebuilt < low])
    assert bool(((out - keys).abs() <= (rebuilt - keys).abs() + 1e-6).all())
    assert (out - keys).norm() < (rebuilt - keys).norm()
    one = meet_landmarks(rebuilt[:, :1], lm, "bounds")  # per key: a chunk's other keys change nothing
    torch.testing.assert_close(one, out[:, :1])


def test_bounds_landmarks_score_at_least_every_key_of_their_chunk():
    """A bounds landmark [centre, half-range] scored with [q, |q|] is an upper bound of q·k over its chunk's keys,
    met where one key takes every dimension's extreme that q's sign picks."""
    torch.manual_seed(0)
    C, n, Hkv, d = 8, 12, 3, 16
    k_rot = torch.randn(n * C, Hkv, d) * torch.rand(1, 1, d) * 4
    lm = chunk_landmarks(k_rot, C, "bounds")
    assert lm.shape == (n, Hkv, 2 * d)
    chunks = k_rot.view(n, C, Hkv, d)
    torch.testing.assert_close(lm[..., :d] - lm[..., d:], chunks.amin(1))
    torch.testing.assert_close(lm[..., :d] + lm[..., d:], chunks.amax(1))
    for _ in range(5):
        q = torch.randn(Hkv, d)
        bound = torch.einsum("hd,nhd->nh", scoring_query(q, "bounds"), lm)  # (n, Hkv)
        best = torch.einsum("hd,nchd->nch", q, chunks).amax(1)
        assert (bound >= best - 1e-4).all()
    q = torch.randn(Hkv, d)
    extreme = torch.where(q > 0, chunks[3].amax(0), chunks[3].amin(0))  # (Hkv, d): every bound q's sign picks
    k_rot.view(n, C, Hkv, d)[3, 5] = extreme
    lm = chunk_landmarks(k_rot, C, "bounds")
    torch.testing.assert_close(torch.einsum("hd,hd->h", scoring_query(q, "bounds"), lm[3]),
                               torch.einsum("hd,hd->h", q, extreme))


def test_bounds_landmarks_find_a_key_that_the_mean_averages_away():
    """One key matches the query in a few dimensions among chunk-mates that cancel it: the chunk's mean scores like
    any other chunk's, its bounds score it first."""
    torch.manual_seed(0)
    C, n, d = 8, 16, 32
    k_rot = torch.randn(n * C, 1, d) * 0.5
    q = torch.zeros(1, d)
    q[0, :4] = 3.0
    k_rot[6 * C + 2, 0, :4] = 4.0  # the needle's key
    k_rot[6 * C + 3: 7 * C, 0, :4] -= 4.0 / (C - 3)  # its chunk-mates pull the mean back
    k_rot[6 * C:6 * C + 2, 0, :4] = 0.0
    none = torch.zeros(1, n, dtype=torch.bool)
    by_mean = landmark_scores(q, chunk_landmarks(k_rot, C), none, scale=1.0)
    by_bounds = landmark_scores(scoring_query(q, "bounds"), chunk_landmarks(k_rot, C, "bounds"), none, scale=1.0)
    assert select_chunks(by_bounds, 1).item() == 6
    assert select_chunks(by_mean, 1).item() != 6


def test_outliers_find_planted_bad_chunks():
    torch.manual_seed(0)
    C, n, Hkv, d = 8, 20, 2, 16
    direction = torch.randn(Hkv, d)
    k_rot = direction + 0.05 * torch.randn(n * C, Hkv, d)  # every token close to its chunk mean
    k_rot[5 * C + 3, 0] = -direction[0]  # chunk 5 badly approximated on head 0
    k_rot[11 * C, 1] = torch.randn(d) * 3  # chunk 11 on head 1
    k_rot[17 * C + 7, 1] = -direction[1]  # chunk 17 on head 1
    ids = find_outlier_chunks(k_rot, C, num_outliers=2)
    assert ids.shape == (2, 2)
    assert 5 in ids[0].tolist()
    assert ids[1].tolist() == [11, 17]


def test_landmark_scores_softmax_then_group_max_and_excluded():
    torch.manual_seed(0)
    Hq, Hkv, d, n = 4, 2, 8, 10
    q, lm = torch.randn(Hq, d), torch.randn(n, Hkv, d)
    excluded = torch.zeros(Hkv, n, dtype=torch.bool)
    excluded[0, 3] = excluded[1, 7] = True
    scores = landmark_scores(q, lm, excluded, scale=0.3)
    for h in range(Hkv):
        keep = ~excluded[h]
        per_q = torch.stack([(lm[keep, h] @ q[g] * 0.3).softmax(0) for g in (2 * h, 2 * h + 1)])
        torch.testing.assert_close(scores[h, keep], per_q.amax(0))
        assert torch.isneginf(scores[h, ~keep]).all()
    ids = select_chunks(scores, 9)
    assert 3 not in ids[0].tolist() and 7 not in ids[1].tolist()


def test_select_chunks_breaks_ties_by_the_lower_chunk_id():
    """A head whose landmark logits are all equal (a uniform softmax: every score a tie) takes its first k chunks, as
    the Triton top-k does; torch.topk leaves that order unspecified, and the fast path and this reference then chose
    different chunks for such a head (the shipped model, greedy decode, fp32 interpreter)."""
    scores = torch.tensor([[0.25, 0.25, 0.25, 0.25, 0.25, 0.25], [0.1, 0.3, 0.3, float("-inf"), 0.3, 0.0]])
    assert select_chunks(scores, 4).tolist() == [[0, 1, 2, 3], [1, 2, 4, 0]]


def test_assign_slots_keeps_hits_in_place_and_moves_only_misses():
    resident = torch.tensor([[10, 11, 12, 13], [-1, -1, -1, -1], [1, 2, 3, 4]])
    selected = torch.tensor([[13, 20, 11, 21], [5, 6, 7, 8], [4, 3, 2, 1]])
    new, miss = assign_slots(resident, selected)
    assert new.tolist() == [[20, 11, 21, 13], [5, 6, 7, 8], [1, 2, 3, 4]]
    assert miss.tolist() == [[True, False, True, False], [True] * 4, [False] * 4]


def test_assign_slots_random_properties_and_fewer_selected_than_slots():
    torch.manual_seed(0)
    Hkv, K = 3, 6
    resident = torch.full((Hkv, K), -1)
    for step in range(20):
        k = 4 if step % 3 == 0 else K
        selected = torch.stack([torch.randperm(12)[:k] for _ in range(Hkv)])
        new, miss = assign_slots(resident, selected)
        for h in range(Hkv):
            assert sorted(new[h][new[h] >= 0].tolist()) == sorted(selected[h].tolist())
            hits = [s for s in range(K) if resident[h, s] >= 0 and resident[h, s] in selected[h]]
            assert all(new[h, s] == resident[h, s] and not miss[h, s] for s in hits)
            assert miss[h].sum() == k - len(hits)
        resident = new


def test_rebuild_keys_equals_rope_of_the_original_keys():
    torch.manual_seed(0)
    C, Hkv, d = 4, 2, 8
    rope = RopeForTests(d)
    k_pre = torch.randn(10 * C, Hkv, d)
    u, sv = factorize_keys(k_pre, rank=Hkv * d)
    chunks, heads = torch.tensor([7, 2, 2]), torch.tensor([0, 0, 1])
    positions = chunks[:, None] * C + torch.arange(C)  # (M, C)
    keys = rebuild_keys(u[positions], sv[heads], positions, rope)
    k_rot = rope.apply(k_pre, torch.arange(10 * C))
    torch.testing.assert_close(keys, k_rot[positions, heads[:, None]], atol=1e-5, rtol=1e-5)


def test_paged_rows_and_gather_values_follow_the_page_table():
    pages = torch.arange(5 * 4 * 2 * 3).float().view(5, 4, 2, 3)  # (num_pages, page_tokens, Hkv, d)
    table = torch.tensor([3, 0, 4])  # logical page i -> physical page
    logical = pages[table].reshape(12, 2, 3)  # (seq_tokens, Hkv, d)
    rows = torch.tensor([0, 5, 11])
    torch.testing.assert_close(paged_rows(pages, table, rows), logical[rows])
    vals = gather_values(pages, table, torch.tensor([1, 5]), torch.tensor([1, 0]), chunk_size=2)
    torch.testing.assert_close(vals, torch.stack([logical[2:4, 1], logical[10:12, 0]]))


@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2)])
def test_sparse_decode_attention_matches_per_head_softmax(Hq, Hkv):
    torch.manual_seed(0)
    d, n = 8, 13
    q, k, v = torch.randn(Hq, d), torch.randn(Hkv, n, d), torch.randn(Hkv, n, d)
    out = sparse_decode_attention_ref(q, k, v, 0.5)
    G = Hq // Hkv
    expect = torch.stack([(k[h // G] @ q[h] * 0.5).softmax(0) @ v[h // G] for h in range(Hq)])
    torch.testing.assert_close(out, expect, atol=1e-5, rtol=1e-5)
    same = attention_ref(q[None], k.transpose(0, 1), v.transpose(0, 1), 0.5, causal=False)[0]
    torch.testing.assert_close(out, same)


def _decaying_keys(S: int, Hkv: int, d: int, seed: int) -> torch.Tensor:
    """Keys whose energy falls off over their directions, as real pre-RoPE keys' does (a few strong ones, a long
    tail), in a random orientation."""
    g = torch.Generator().manual_seed(seed)
    W = Hkv * d
    spectrum = torch.logspace(0, -2.5, W)
    orient = torch.linalg.qr(torch.randn(W, W, generator=g))[0]
    return ((torch.randn(S, W, generator=g) * spectrum) @ orient.T).reshape(S, Hkv, d)


def _tail(k_pre: torch.Tensor, u: torch.Tensor, sv: torch.Tensor) -> float:
    """Share of the keys' energy the factorisation loses."""
    rebuilt = torch.einsum("sr,hrd->shd", u, sv)
    return ((k_pre - rebuilt).square().sum() / k_pre.square().sum()).item()


@pytest.mark.parametrize("rank,kv_heads,head_dim", [(8, 2, 64), (40, 2, 64), (100, 2, 64), (160, 8, 128)])
def test_factorize_by_subspace_iteration_is_near_the_best_rank_r(rank, kv_heads, head_dim):
    """The default (subspace iteration) loses at most 0.5 % more key energy than the exact eigh (the best rank-r
    approximation), at this model's width and at Llama-3.1-8B's (8 KV heads of 128, rank 160, where two oversampled
    iterations with Rayleigh-Ritz did not), its U rows are the keys on its basis, and its basis is orthonormal."""
    k_pre = _decaying_keys(3000, kv_heads, head_dim, seed=rank)
    exact = factorize_keys(k_pre, rank, iters=None)
    u, sv = factorize_keys(k_pre, rank)
    assert _tail(k_pre, u, sv) <= 1.005 * _tail(k_pre, *exact)
    basis = sv.transpose(0, 1).reshape(rank, -1)  # (r, Hkv*d)
    torch.testing.assert_close(basis @ basis.T, torch.eye(rank), atol=1e-5, rtol=0)
    torch.testing.assert_close(project_keys(k_pre, sv), u, atol=1e-4, rtol=1e-4)


def test_factorize_keys_of_lower_rank_than_asked():
    """Keys of rank 20 (a k_proj of rank 20, as the shipped model's) factorised at rank 160: the iterations on a
    rank-deficient Gram matrix stay finite, the basis is still orthonormal (room for later tokens' other directions)
    and the keys rebuild exactly."""
    g = torch.Generator().manual_seed(3)
    k_pre = (torch.randn(2000, 20, generator=g) @ torch.randn(20, 8 * 128, generator=g)).reshape(2000, 8, 128)
    u, sv = factorize_keys(k_pre, 160)
    basis = sv.transpose(0, 1).reshape(160, -1)
    assert torch.isfinite(u).all() and torch.isfinite(sv).all()
    torch.testing.assert_close(basis @ basis.T, torch.eye(160), atol=1e-5, rtol=0)
    assert _tail(k_pre, u, sv) < 1e-9


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_factorize_half_precision_keys_on_cuda(dtype):
    """On CUDA, the keys' Gram matrix (bf16: their own tensor-core product with fp32 sums; fp16: from their fp32
    copy) is within fp32's rounding of the fp64 one, and the factorisation as near the best rank-r as on the CPU."""
    k_pre = _decaying_keys(3000, 8, 128, seed=5).to(dtype)
    k_cat = k_pre.reshape(3000, -1).double()
    gram = _gram(k_pre.reshape(3000, -1).cuda(), k_pre.reshape(3000, -1).cuda().float())
    assert gram.dtype == torch.float32
    torch.testing.assert_close(gram.double().cpu(), k_cat.T @ k_cat, atol=1e-5 * k_cat.square().sum(0).max().item(),
                               rtol=0)
    exact = factorize_keys(k_pre.float(), 160, iters=None)
    u, sv = factorize_keys(k_pre.cuda(), 160)
    assert _tail(k_pre.float(), u.cpu(), sv.cpu()) <= 1.005 * _tail(k_pre.float(), *exact)
    basis = sv.transpose(0, 1).reshape(160, -1)
    torch.testing.assert_close(basis @ basis.T, torch.eye(160, device="cuda"), atol=1e-5, rtol=0)


def test_factorize_by_default_never_calls_eigh(monkeypatch):
    """The default factorisation keeps no oversampled columns, so it needs no Rayleigh-Ritz eigh (whose status check
    would make the host wait for the device on CUDA); the exact one (iters None) is eigh."""
    k_pre = _decaying_keys(500, 2, 64, seed=1)
    calls = []
    eigh = torch.linalg.eigh
    monkeypatch.setattr(torch.linalg, "eigh", lambda *a, **kw: calls.append(1) or eigh(*a, **kw))
    factorize_keys(k_pre, 20)
    assert calls == []
    factorize_keys(k_pre, 20, iters=None)
    assert calls == [1]


def test_factorize_without_iterations_is_worse():
    """Zero iterations (a random projection alone) lose clearly more: the iterations are what make it near-best."""
    k_pre = _decaying_keys(3000, 2, 64, seed=0)
    assert _tail(k_pre, *factorize_keys(k_pre, 20, iters=0)) > 1.05 * _tail(k_pre, *factorize_keys(k_pre, 20))
