"""The batched sampler (engine/sampler.py): greedy rows take the argmax; sampled rows follow softmax(logits / T)
restricted to their top-k and nucleus, drawn from noise hashed from (seed, token index), so that a row's token does
not depend on its batch."""
import pytest
import torch

from shadowkv_core.engine.sampler import OutputCounts, StepLogprobs, adjust_logits, sample
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


def test_min_p_keeps_the_ids_at_least_min_p_as_likely_as_the_top():
    # softmax of LOGITS: 0.434, 0.263, 0.079, 0.039, 0.176, 0.008; min_p 0.3: at least 0.130
    freq = frequencies(SamplingParams(temperature=1.0, min_p=0.3))
    assert torch.allclose(freq, expected(1.0, [0, 1, 4]), atol=0.018), freq
    freq = frequencies(SamplingParams(temperature=1.0, min_p=0.3, top_k=2))
    assert torch.allclose(freq, expected(1.0, [0, 1]), atol=0.018), freq


def one_seq(params: SamplingParams, prompt: list[int], output: list[int]) -> Sequence:
    seq = Sequence(0, "r", prompt, params, 0)
    seq.output_token_ids = list(output)
    return seq


def test_penalties_follow_vllm_on_hand_made_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    # prompt holds id 1; the output id 2 twice and id 3 once; id 0 and 4 appear nowhere
    seq = one_seq(SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5),
                  prompt=[1, 1], output=[2, 3, 2])
    got = adjust_logits(logits, [seq], [3])
    want = torch.tensor([[2.0, -1.0 * 2.0, 0.5 / 2.0 - 0.25 * 2 - 0.5, 3.0 / 2.0 - 0.25 - 0.5, -2.0]])
    assert torch.allclose(got, want), (got, want)


def test_output_counts_count_each_drawn_token_and_follow_forks_and_frees():
    params = SamplingParams(temperature=0, frequency_penalty=1.0)
    seqs = [one_seq(params, [0], [1]), one_seq(SamplingParams(temperature=0), [0], [])]
    seqs[1].seq_id = 1
    counts = OutputCounts(4, torch.device("cpu"))
    logits = torch.tensor([[0.0, 0.5, 0.2, 0.1], [0.0, 0.5, 0.2, 0.1]])
    # row 0: id 1 is in its output (0.5 - 1); row 1 has no penalties
    assert sample(logits, seqs, [1, 0], counts=counts).tolist() == [2, 1]
    # the drawn id 2 is counted at once, before it reaches the output (a step in flight)
    assert counts.of(seqs).tolist() == [[0.0, 1.0, 1.0, 0.0], [0.0] * 4]
    assert sample(logits, seqs, [2, 1], counts=counts).tolist() == [3, 1]
    fork = one_seq(params, [0], [1, 2, 3])
    fork.seq_id = 7
    counts.copy(0, fork)
    assert counts.of([fork]).tolist() == [[0.0, 1.0, 1.0, 1.0]]
    counts.free(0)
    counts.free(7)
    fresh = one_seq(params, [0], [3, 3])
    fresh.seq_id = 9
    assert counts.of([fresh]).tolist() == [[0.0, 0.0, 0.0, 2.0]]  # a reused row starts from its own output
    assert len(counts.rows) == 1


def test_logprobs_are_the_raw_log_softmax_with_rank_and_top_ids_for_the_rows_that_ask():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 30, generator=gen) * 2
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.8, top_k=5, logprobs=0, logit_bias={4: 5.0}, presence_penalty=1.0),
              SamplingParams(temperature=1.5, logprobs=20)]
    seqs = seqs_of(params, [1, 2, 3, 4])
    tokens = sample(logits, seqs, [0] * 4)
    got = StepLogprobs.of(logits, tokens, seqs).by_row()
    assert sorted(got) == [0, 2, 3]
    reference = torch.log_softmax(logits.double(), dim=-1)
    for row, lp in got.items():
        token = int(tokens[row])
        assert lp.logprob == pytest.approx(float(reference[row, token]), abs=1e-5)
        assert lp.rank == int((reference[row] > reference[row, token]).sum()) + 1
        k = params[row].logprobs
        order = reference[row].argsort(descending=True)[:k]
        assert [t for t, _ in lp.top] == order.tolist()
        assert [v for _, v in lp.top] == pytest.approx(reference[row, order].tolist(), abs=1e-5)
    assert got[0].rank == 1 and got[0].top[0][0] == int(tokens[0])  # greedy: the most likely id
    assert StepLogprobs.of(logits, tokens, seqs_of([SamplingParams()] * 4, [1, 2, 3, 4])) is None


def test_logit_bias_and_min_tokens_change_what_greedy_picks():
    logits = torch.tensor([[0.0, 1.0, 5.0, 0.5]])
    biased = one_seq(SamplingParams(temperature=0, logit_bias={3: 10.0, 2: -1.0}), [0], [])
    assert sample(logits, [biased]).tolist() == [3]
    # id 2 is the model's end of sequence and id 1 a stop token: both masked for the first 2 tokens only
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1], max_tokens=8)
    assert sample(logits, [one_seq(params, [0], [])], [0], eos_token_ids=(2,)).tolist() == [3]
    assert sample(logits, [one_seq(params, [0], [3])], [1], eos_token_ids=(2,)).tolist() == [3]
    assert sample(logits, [one_seq(params, [0], [3, 3])], [2], eos_token_ids=(2,)).tolist() == [2]
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True)
    assert sample(logits, [one_seq(ignoring, [0], [])], [0], eos_token_ids=(2,)).tolist() == [2]


def test_rows_without_adjustments_keep_their_logits_beside_rows_with():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 40, generator=gen)
    seqs = [one_seq(SamplingParams(), [5], [6]), one_seq(SamplingParams(presence_penalty=1.0, logit_bias={7: 2.0}),
                                                         [5], [6]), one_seq(SamplingParams(min_tokens=1), [5], [])]
    got = adjust_logits(logits, seqs, [1, 1, 0], eos_token_ids=(9,))
    assert torch.equal(got[0], logits[0])
    assert got[1, 6] == logits[1, 6] - 1.0 and got[1, 7] == logits[1, 7] + 2.0
    assert got[2, 9] == float("-inf") and torch.equal(got[2, :9], logits[2, :9])


def test_sampling_params_refuse_out_of_range_fields():
    for bad in ({"min_p": 1.5}, {"min_tokens": 20, "max_tokens": 10}, {"repetition_penalty": 0},
                {"presence_penalty": float("nan")}, {"logit_bias": {-1: 1.0}}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


@pytest.mark.gpu
def test_cuda_draws_the_cpu_tokens_gpu():
    """The noise is a hash, not a generator's stream: the same tokens on CUDA as on the CPU."""
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 1000, generator=gen) * 3
    params = [SamplingParams(temperature=0.7, top_k=50, top_p=0.95), SamplingParams(temperature=1.3)] * 32
    seqs = seqs_of(params, [s * 7919 for s in range(64)])
    index = list(range(64))
    assert sample(logits.cuda(), seqs, index).tolist() == sample(logits, seqs, index).tolist()
