"""Per-layer ranks (shadowkv/ranks.py): the key spectra a calibration prompt gives, against the keys transformers
computes; the allocation, against every allocation of a small case; the CLI on the shipped model."""
import itertools
from pathlib import Path

import pytest
import torch

from shadowkv_core.models import load_model
from shadowkv_core.shadowkv.ranks import allocate_ranks, energy_kept, key_spectra, main
from support.model_factory import build_tiny_hf_model

SHIPPED = str(Path(__file__).resolve().parents[1] / "models" / "shadowkv-small")


def test_key_spectra_are_the_eigenvalues_of_each_layers_keys(tmp_path):
    """Oracle: transformers' own forward, its k_proj outputs (pre-RoPE keys, all KV heads) hooked per layer."""
    hf = build_tiny_hf_model("llama", tmp_path, seed=1, attention_bias=True)
    ids = torch.randint(0, hf.config.vocab_size, (57,), generator=torch.Generator().manual_seed(0))
    keys = []
    for layer in hf.model.layers:
        layer.self_attn.k_proj.register_forward_hook(lambda mod, inp, out: keys.append(out[0].double()))
    with torch.no_grad():
        hf(ids[None])
    decoder, spec = load_model(str(tmp_path), torch.float32, "cpu")
    got = key_spectra(decoder, spec, ids.tolist(), "cpu", torch.float32)
    assert len(got) == len(keys) == spec.num_layers
    for eig, k in zip(got, keys):
        expect = torch.linalg.svdvals(k) ** 2  # largest first
        assert eig.shape == expect.shape
        torch.testing.assert_close(eig, expect, rtol=1e-4, atol=1e-4 * expect[0].item())


def _spectra(decays, width=8):
    return [torch.tensor([decay ** i for i in range(width)], dtype=torch.float64) for decay in decays]


def test_a_layer_whose_energy_is_spread_takes_rank_from_one_whose_is_not():
    spectra = _spectra([0.2, 0.9, 0.5])
    ranks = allocate_ranks(spectra, rank=4, floor=1)
    assert sum(ranks) == 12 and min(ranks) >= 1
    assert ranks[1] > ranks[2] > ranks[0]
    kept, uniform = energy_kept(spectra, ranks), energy_kept(spectra, [4, 4, 4])
    assert sum(kept) > sum(uniform) and min(kept) > min(uniform)


def test_the_allocation_keeps_the_most_energy_of_any():
    """Every allocation of a small case with the same sum and floor: none keeps more energy in all."""
    spectra = [torch.tensor(s, dtype=torch.float64) for s in ([9, 5, 3, 1, 1, 0.5], [4, 4, 3, 3, 2, 2],
                                                             [20, 1, 0.5, 0.2, 0.1, 0.1], [6, 3, 2, 2, 1, 1])]
    for rank, floor in ((3, 1), (2, 2), (4, 1)):
        got = sum(energy_kept(spectra, allocate_ranks(spectra, rank, floor)))
        best = max(sum(energy_kept(spectra, r)) for r in itertools.product(range(floor, 7), repeat=4)
                   if sum(r) == 4 * rank)
        assert got == pytest.approx(best, abs=1e-12)


def test_equal_spectra_get_equal_ranks_and_multiples_hold():
    assert allocate_ranks(_spectra([0.7] * 4), rank=3, floor=1) == (3, 3, 3, 3)
    ranks = allocate_ranks(_spectra([0.3, 0.95], width=16), rank=6, multiple=2)
    assert sum(ranks) == 12 and all(r % 2 == 0 for r in ranks) and ranks[1] > ranks[0]
    assert allocate_ranks(_spectra([0.01, 0.95], width=16), rank=8) == (2, 14)  # floor: a quarter of the rank


def test_impossible_allocations_are_refused():
    with pytest.raises(ValueError, match="above the keys' width"):
        allocate_ranks(_spectra([0.5, 0.5]), rank=9)
    with pytest.raises(ValueError, match="above the mean rank"):
        allocate_ranks(_spectra([0.5, 0.5]), rank=2, floor=3)
    with pytest.raises(ValueError, match="multiples of 2"):
        allocate_ranks(_spectra([0.5, 0.5]), rank=3, multiple=2)


def test_cli_prints_layer_ranks_a_config_takes(tmp_path, capsys):
    text = tmp_path / "calibration.txt"
    text.write_text("The quick brown fox jumps over the lazy dog, and the dog sleeps on. " * 40)
    main(["--model", SHIPPED, "--text", str(text), "--rank", "20", "--tokens", "600", "--device", "cpu"])
    out = capsys.readouterr().out
    assert out.startswith("600 tokens")
    ranks = [int(r) for r in out.strip().splitlines()[-1].removeprefix("layer_ranks: [").rstrip("]").split(",")]
    assert len(ranks) == 6 and sum(ranks) == 120 and min(ranks) >= 5
