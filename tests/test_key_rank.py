"""training/objectives.py: the key low-rank regulariser (the tail share it measures and trains down) and the
factorised key projection (training.train --key-proj-rank)."""
import torch

from training.objectives import (KeyCapture, factorise_key_projections, key_rank, key_tail, merge_key_projections,
                                 top_subspace)
from training.train import model_config


def test_rank_is_shadowkvs_share_of_the_key_width():
    from transformers import LlamaConfig
    cfg = LlamaConfig(**{k: v for k, v in model_config().items() if k not in ("architectures", "torch_dtype")})
    assert key_rank(cfg) == 20  # round(160 / 1024 * 2 * 64)


def test_tail_is_zero_at_the_keys_rank_and_the_eigen_share_otherwise():
    g = torch.Generator().manual_seed(0)
    low = torch.randn(3, 300, 6, generator=g) @ torch.randn(6, 32, generator=g)  # rank 6 of 32
    assert key_tail(low, 6).abs().max() < 1e-5
    keys = torch.randn(3, 300, 32, generator=g) * torch.linspace(3, 0.1, 32)
    eig = torch.linalg.eigvalsh(keys.double().transpose(1, 2) @ keys.double())  # ascending
    expected = eig[:, :-6].sum(-1) / eig.sum(-1)
    torch.testing.assert_close(key_tail(keys, 6).double(), expected, rtol=1e-4, atol=1e-6)


def test_subspace_iteration_matches_eigh():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(4, 500, 64, generator=g) * torch.logspace(0, -2, 64)
    torch.testing.assert_close(key_tail(keys, 10, iters=4), key_tail(keys, 10), rtol=2e-3, atol=1e-5)
    basis = top_subspace(keys.transpose(1, 2) @ keys, 10, iters=4)
    torch.testing.assert_close(basis.transpose(1, 2) @ basis, torch.eye(10).expand(4, 10, 10), atol=1e-5, rtol=0)


def test_its_gradient_lowers_the_tail():
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(2, 200, 32, generator=g).requires_grad_()
    before = key_tail(keys, 4, iters=4).mean()
    before.backward()
    with torch.no_grad():
        after = key_tail(keys - 0.5 * keys.grad / keys.grad.norm() * keys.norm(), 4, iters=4).mean()
    assert after < before


def _small_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    overrides = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
                 "num_key_value_heads": 2, "head_dim": 16}
    spec = {k: v for k, v in model_config().items() if k not in ("architectures", "torch_dtype")}
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**spec, **overrides})).eval()


def test_factorised_key_projections_have_their_rank_for_any_input_and_save_as_a_plain_llama(tmp_path):
    from transformers import AutoModelForCausalLM
    model = _small_llama(0)
    ids = torch.randint(0, 256, (2, 40))
    full = model(input_ids=ids).logits
    factorise_key_projections(model, 32)  # the whole key width: an exact factorisation, same model
    torch.testing.assert_close(model(input_ids=ids).logits, full, rtol=1e-4, atol=1e-4)
    model = _small_llama(0)
    factorise_key_projections(model, 5)
    capture = KeyCapture(model)
    model(input_ids=ids).logits.float().square().mean().backward()
    keys = capture.take()
    capture.close()
    for key in keys:  # (2, 40, 32): every row's keys, random tokens and all, have rank 5
        assert torch.linalg.matrix_rank(key.detach(), rtol=1e-5).max() == 5
    torch.optim.SGD(model.parameters(), lr=0.5).step()  # training moves both factors; the product keeps its rank
    assert all(layer.self_attn.k_proj.down.grad.abs().sum() > 0 for layer in model.model.layers)
    trained = model(input_ids=ids).logits
    merge_key_projections(model)
    assert all(type(layer.self_attn.k_proj) is torch.nn.Linear for layer in model.model.layers)
    weights = [layer.self_attn.k_proj.weight.detach() for layer in model.model.layers]
    assert all(torch.linalg.matrix_rank(w, rtol=1e-5) == 5 for w in weights)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    torch.testing.assert_close(loaded(input_ids=ids).logits, trained, rtol=1e-4, atol=1e-4)
