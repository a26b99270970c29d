import pytest
import torch

from test_kernels_utils import DEVICE, LLAMA, assert_close, slot_ids_for
from kernels.append_token import append_token
from shadowkv_core.shadowkv.reference import project_keys


def _check(B, Hkv, d, rank, window, page_tokens, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    N, P, L = B + 2, 2 * B + 3, 3

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device, dtype)

    qkv = rand(B, (4 + 2) * Hkv * d)  # the new tokens' keys and values are strided views, as the model passes them
    k_pre, v = qkv[:, :Hkv * d].view(B, Hkv, d), qkv[:, 3 * Hkv * d:4 * Hkv * d].view(B, Hkv, d)
    k_rot = rand(B, Hkv, d)
    sv = rand(N, L, Hkv, rank, d)[:, 1] / rank ** 0.5  # one layer of the slots' bases
    u_pages, win_k, win_v = rand(P, page_tokens, rank), rand(N, L, window, Hkv, d), rand(N, L, window, Hkv, d)
    slot_ids = slot_ids_for(B, N, g)
    token_page = torch.randperm(P, generator=g)[:B].to(device)
    token_row = torch.randint(0, page_tokens, (B,), generator=g).to(device)
    window_pos = torch.randint(0, window, (B,), generator=g).to(device)
    expected_u, expected_k, expected_v = u_pages.clone(), win_k.clone(), win_v.clone()
    for b in range(B):  # the per-sequence append of layer.decode_layer
        s = int(slot_ids[b])
        expected_u[token_page[b], token_row[b]] = project_keys(k_pre[b:b + 1], sv[s])[0].to(dtype)
        expected_k[s, 1, window_pos[b]] = k_rot[b]
        expected_v[s, 1, window_pos[b]] = v[b]
    for got, expected in ((u_pages, expected_u), (win_k, expected_k), (win_v, expected_v)):
        got[expected != got] = float("nan")  # poison what the kernel must write
    append_token(k_pre, k_rot, v, sv, slot_ids, u_pages, token_page, token_row, win_k[:, 1], win_v[:, 1],
                 window_pos, block_r=16)
    assert_close(u_pages, expected_u, dtype, "U rows")
    assert torch.equal(win_k, expected_k) and torch.equal(win_v, expected_v), "the window holds the exact key, value"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("B,Hkv,rank", [(1, 2, 40), (5, 3, 17)])
def test_append_token_small(B, Hkv, rank, dtype):
    _check(B, Hkv, 32, rank, window=12, page_tokens=16, dtype=dtype, device=DEVICE)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 8, 32])
def test_append_token_llama(batch):
    _check(batch, LLAMA["num_kv_heads"], LLAMA["head_dim"], LLAMA["rank"], window=96, page_tokens=128,
           dtype=torch.bfloat16, device="cuda", seed=batch)
