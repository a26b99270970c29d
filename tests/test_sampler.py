"""The batched sampler (engine/sampler.py): greedy rows take the argmax; sampled rows follow softmax(logits / T)
restricted to their top-k and nucleus, drawn from noise hashed from (seed, token index), so that a row's token does
not depend on its batch."""
import pytest
import torch

from shadowkv_core.engine.sampler import sample
from shadowkv_core.engine.sampling import SamplingParams
from shadowkv_core.engine.sequence import Sequence

LOGITS = torch.tensor([2.0, 1.5, 0.3, -0.4, 1.1, -2.0])


def seqs_of(params: list[SamplingParams], seeds: list[int]) -> list[Sequence]:
    return [Sequence(i, f"r{i}", [1, 2, 3], p, s) for i, (p, s) in enumerate(zip(params, seeds))]


def frequencies(params: SamplingParams, draws: int = 20000, seed: int = 11) -> torch.Tensor:
    """Empirical distribution of one request's tokens at `draws` successive token indices (one batch)."""
    tokens = sample(LOGITS.expand(draws, -1).clone(), seqs_of([params] * draws, [seed] * draws), list(range(draws)))
    return torch.bincount(tokens, minlength=len(LOGITS)).float() / draws


def expected(temperature: float, keep: list[int]) -> torch.Tensor:
    p = torch.zeros_like(LOGITS)
    p[keep] = torch.softmax(LOGITS[keep] / temperature, dim=0)
    return p


@pytest.mark.parametrize("params, keep", [
    (SamplingParams(temperature=1.0), [0, 1, 2, 3, 4, 5]),
    (SamplingParams(temperature=0.5), [0, 1, 2, 3, 4, 5]),
    (SamplingParams(temperature=1.0, top_k=3), [0, 1, 4]),
    # softmax of LOGITS: 0.434, 0.263, 0.079, 0.039, 0.176, 0.008: 0.697 lies before id 4, past 0.5
    (SamplingParams(temperature=1.0, top_p=0.5), [0, 1]),
    # the top 3 renormalised: 0.497, 0.301, 0.202: 0.798 before id 4, past 0.75 (not past 0.8)
    (SamplingParams(temperature=1.0, top_k=3, top_p=0.75), [0, 1]),
    (SamplingParams(temperature=1.0, top_k=3, top_p=0.8), [0, 1, 4]),
], ids=["t1", "t0.5", "top_k3", "top_p0.5", "top_k3_top_p0.75", "top_k3_top_p0.8"])
def test_sampled_tokens_follow_the_filtered_softmax(params, keep):
    freq = frequencies(params)
    want = expected(params.temperature, keep)
    assert torch.all(freq[[i for i in range(len(LOGITS)) if i not in keep]] == 0)
    # 20000 draws: a frequency's standard deviation is at most 0.0036; 5 of them
    assert torch.allclose(freq, want, atol=0.018), (freq, want)


def test_a_rows_token_depends_on_its_seed_and_index_only():
    params = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen)
    seeds = [7, 7, 2**40 + 7, -3, 123456789012345]
    index = [0, 1, 0, 4, 9]
    together = sample(logits, seqs_of([params] * 5, seeds), index)
    alone = [int(sample(logits[i:i + 1], seqs_of([params], [seeds[i]]), [index[i]])[0]) for i in range(5)]
    assert together.tolist() == alone
    reversed_batch = sample(logits.flip(0), seqs_of([params] * 5, seeds[::-1]), index[::-1])
    assert reversed_batch.tolist() == alone[::-1]
    # the seed's high bits and the token index both change the draws
    runs = {seed: [int(sample(logits[:1], seqs_of([params], [seed]), [i])[0]) for i in range(40)]
            for seed in (7, 2**40 + 7)}
    assert runs[7] != runs[2**40 + 7] and len(set(runs[7])) > 5


def test_greedy_rows_take_the_argmax_beside_sampled_ones():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 300, generator=gen)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=2.0, top_k=5)] * 3
    tokens = sample(logits, seqs_of(params, list(range(6))), [3] * 6)
    assert tokens[0::2].tolist() == logits[0::2].argmax(-1).tolist()
    top5 = logits[1::2].topk(5).indices
    assert all(int(t) in row.tolist() for t, row in zip(tokens[1::2], top5))


@pytest.mark.gpu
def test_cuda_draws_the_cpu_tokens_gpu():
    """The noise is a hash, not a generator's stream: the same tokens on CUDA as on the CPU."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 1000, generator=gen) * 3
    params = [SamplingParams(temperature=0.7, top_k=50, top_p=0.95), SamplingParams(temperature=1.3)] * 32
    seqs = seqs_of(params, [s * 7919 for s in range(64)])
    index = list(range(64))
    assert sample(logits.cuda(), seqs, index).tolist() == sample(logits, seqs, index).tolist()
