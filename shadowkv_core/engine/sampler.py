"""Sampler: the next token of every sequence of a batch, on the logits' device, in one pass and without a host sync.

A row with a grammar (structured output) first has every id its grammar does not allow set to -inf. Then each row's
logits are adjusted as vLLM does: its logit_bias added, its end-of-sequence and stop token ids masked
until min_tokens are out, then its repetition, frequency and presence penalties applied. Greedy rows take the argmax.
Sampled rows divide by their temperature, keep the ids at least min_p times as likely as their most likely one, then
their top-k and then their nucleus (top-p), and draw by the Gumbel-max trick: the argmax of logits + Gumbel noise is a
draw from their softmax. The noise is not drawn from a generator's stream but hashed from (the request's seed, the
token's index in its output, the vocabulary id): a request's tokens are the same whichever batch it decodes in, on the
CPU and on CUDA, and a step can be sampled while the one before it is still running (EngineConfig.async_decode), since
no generator state lives on the host. The penalties' output counts live on the device (OutputCounts) and count each
token as it is drawn, so they cost the same at every step.

Logprobs are computed only for the rows that ask, after the draw (StepLogprobs): those of the raw logits, before any
of the request's adjustments (vLLM's default), with each token's rank and the top ids; a step without them does
nothing more.
"""
from __future__ import annotations

import torch

from ..transfers import Readback, to_device
from .sequence import Sequence, TokenLogprob
from .structured import allowed_mask

_U32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # spreads consecutive vocabulary ids over the hash's input space


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32, C. Wellons: full avalanche) of int64 values in [0, 2^32). The products
    overflow int64 and wrap; only their low 32 bits are kept, which wrapping leaves exact."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _U32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _U32
    return x ^ (x >> 16)


def gumbel_noise(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """keys (B, 3) int64 in [0, 2^32): (seed low, seed high, token index) per row -> (B, V) float32 standard Gumbel
    noise, a pure function of each row's key and the vocabulary id."""
    row = _mix32(_mix32(_mix32(keys[:, 0]) ^ keys[:, 1]) ^ keys[:, 2])
    ids = torch.arange(vocab_size, dtype=torch.int64, device=keys.device)
    bits = _mix32((row[:, None] + ids[None, :] * _GOLDEN) & _U32) >> 8  # 24 uniform bits: float32 holds them exactly
    u = (bits.float() + 0.5) * 2.0 ** -24  # in (0, 1)
    return -torch.log(-torch.log(u))


def add_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits (B, V) + each row's logit_bias {token id: bias}."""
    entries = [(row, token, bias) for row, seq in enumerate(seqs) for token, bias in seq.params.logit_bias.items()]
    if not entries:
        return logits
    rows, tokens, biases = zip(*entries)
    index = to_device([rows, tokens], torch.int64, logits.device)
    values = to_device(list(biases), torch.float32, logits.device)
    return logits.index_put((index[0], index[1]), values, accumulate=True)


def mask_until_min_tokens(logits: torch.Tensor, seqs: list[Sequence], index: list[int],
                          eos_token_ids: tuple[int, ...]) -> torch.Tensor:
    """logits (B, V) with the ids that would end each row (stop_token_ids, and end-of-sequence unless ignore_eos)
    at -inf while the row's output is shorter than its min_tokens."""
    entries = [(row, token) for row, (seq, i) in enumerate(zip(seqs, index)) if i < seq.params.min_tokens
               for token in (*seq.params.stop_token_ids, *(() if seq.params.ignore_eos else eos_token_ids))]
    if not entries:
        return logits
    rows, tokens = to_device(list(zip(*entries)), torch.int64, logits.device)
    return logits.index_put((rows, tokens), logits.new_full((len(entries),), float("-inf")))


class OutputCounts:
    """Per sequence with penalties, on the device: how often each id occurs in its output. A row starts from the
    output the sequence has when it first samples and counts each token as it is drawn (in flight or not), so a step's
    penalties cost the same however long the outputs are."""

    def __init__(self, vocab_size: int, device: torch.device):
        self.table = torch.zeros(0, vocab_size, dtype=torch.float32, device=device)
        self.rows: dict[int, int] = {}  # seq_id -> its row of the table
        self.free_rows: list[int] = []

    def _row(self, seq: Sequence) -> int:
        row = self.rows.get(seq.seq_id)
        if row is not None:
            return row
        if not self.free_rows:
            n = self.table.shape[0]
            grown = self.table.new_zeros(max(n, 4), self.table.shape[1])
            self.table = torch.cat([self.table, grown])
            self.free_rows = list(range(self.table.shape[0] - 1, n - 1, -1))
        row = self.rows[seq.seq_id] = self.free_rows.pop()
        self.table[row].zero_()
        if seq.output_token_ids:
            tokens = to_device(seq.output_token_ids, torch.int64, self.table.device)
            self.table[row].index_add_(0, tokens, torch.ones(len(tokens), device=self.table.device))
        return row

    def _rows(self, seqs: list[Sequence]) -> torch.Tensor:
        """(B,) int64 on the device: each sequence's row, -1 for those without penalties."""
        return to_device([self._row(seq) if seq.params.has_penalties else -1 for seq in seqs], torch.int64,
                         self.table.device)

    def of(self, seqs: list[Sequence]) -> torch.Tensor:
        """(B, V) float32: each sequence's output counts (zeros for those without penalties)."""
        rows = self._rows(seqs)
        return self.table[rows.clamp(min=0)] * (rows >= 0).float()[:, None]

    def add(self, seqs: list[Sequence], tokens: torch.Tensor) -> None:
        """Count each sequence's newly drawn token, tokens (B,) int64 on the device."""
        rows = self._rows(seqs)
        self.table.index_put_((rows.clamp(min=0), tokens), (rows >= 0).float(), accumulate=True)

    def copy(self, src_seq_id: int, dst: Sequence) -> None:
        """dst (a fork of src_seq_id, holding the same output) counts what src counts, tokens in flight included."""
        if src_seq_id in self.rows:
            self.table[self._row(dst)] = self.table[self.rows[src_seq_id]]

    def free(self, seq_id: int) -> None:
        row = self.rows.pop(seq_id, None)
        if row is not None:
            self.free_rows.append(row)


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence], counts: torch.Tensor) -> torch.Tensor:
    """vLLM's penalties on logits (B, V), given each row's output counts (B, V): repetition_penalty r divides
    positive (multiplies negative) logits of ids in the prompt or the output; then frequency_penalty × the id's count
    and presence_penalty × (count > 0), over the output only, are subtracted."""
    floats = to_device([[seq.params.repetition_penalty for seq in seqs], [seq.params.frequency_penalty for seq in seqs],
                        [seq.params.presence_penalty for seq in seqs]], torch.float32, logits.device)
    entries = [(row, token) for row, seq in enumerate(seqs) if seq.params.repetition_penalty != 1
               for token in seq.prompt_token_ids]
    seen = counts > 0
    if entries:
        rows, tokens = to_device(list(zip(*entries)), torch.int64, logits.device)
        seen = seen.index_put((rows, tokens), seen.new_ones(len(entries)))
    r = floats[0][:, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    return logits - floats[1][:, None] * counts - floats[2][:, None] * (counts > 0)


def adjust_logits(logits: torch.Tensor, seqs: list[Sequence], index: list[int], eos_token_ids: tuple[int, ...] = (),
                  counts: OutputCounts | None = None) -> torch.Tensor:
    """logits (B, V) float32 after each row's logit_bias, min_tokens mask and penalties (the order vLLM applies
    them in); the same tensor when no row asks for any. counts: the rows' output counts (default: counted from each
    sequence's output)."""
    logits = mask_until_min_tokens(add_logit_bias(logits, seqs), seqs, index, eos_token_ids)
    if any(seq.params.has_penalties for seq in seqs):
        counts = counts if counts is not None else OutputCounts(logits.shape[1], logits.device)
        logits = apply_penalties(logits, seqs, counts.of(seqs))
    return logits


def mask_by_grammar(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits (B, V) with every id its row's grammar (structured output) does not allow next at -inf; the same tensor
    when no row has a grammar. Each grammar must be at the row's last token: no step of it may be in flight."""
    rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return logits
    allowed = torch.ones_like(logits, dtype=torch.bool)
    allowed[rows] = allowed_mask([seqs[row].grammar.bitmask() for row in rows], logits.shape[1], logits.device)
    return logits.masked_fill(~allowed, float("-inf"))


def filter_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits (B, V) with every id less likely than min_p (B,) times the row's most likely id set to -inf."""
    floor = logits.max(dim=-1, keepdim=True).values + torch.log(min_p[:, None])
    return logits.masked_fill(logits < floor, float("-inf"))


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, max_k: int,
                       any_top_p: bool) -> torch.Tensor:
    """logits (B, V) float32 with every id outside each row's top-k (top_k (B,), 0: off) and then outside its nucleus
    (the smallest set of most likely ids reaching top_p (B,) of the probability, 1: off) set to -inf. max_k (the
    largest top_k in use, 0 if none) and any_top_p come from the host, so that nothing here waits for the device."""
    if max_k:
        kth = torch.topk(logits, max_k, dim=-1).values.gather(1, (top_k - 1).clamp(min=0)[:, None])
        logits = logits.masked_fill((top_k[:, None] > 0) & (logits < kth), float("-inf"))
    if any_top_p:
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(ordered, dim=-1)
        drop = probs.cumsum(-1) - probs >= top_p[:, None]  # keep the smallest prefix reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence], token_index: list[int] | None = None,
           eos_token_ids: tuple[int, ...] = (), counts: OutputCounts | None = None) -> torch.Tensor:
    """logits (B, V) float32, one row per sequence in `seqs` order -> (B,) int64 tokens on the logits' device.
    token_index[i]: the index in its output of the token drawn for seqs[i] (default: its output's length).
    eos_token_ids: the model's end-of-sequence ids (masked under min_tokens). counts: the sequences' output counts
    for the penalties, which count the drawn tokens (default: counted afresh from each sequence's output)."""
    index = token_index or [len(seq.output_token_ids) for seq in seqs]
    if counts is None and any(seq.params.has_penalties for seq in seqs):
        counts = OutputCounts(logits.shape[1], logits.device)
    logits = adjust_logits(mask_by_grammar(logits, seqs), seqs, index, eos_token_ids, counts)
    tokens = logits.argmax(dim=-1) if all(seq.params.is_greedy for seq in seqs) else \
        _draw(logits, seqs, index)
    if any(seq.params.has_penalties for seq in seqs):
        counts.add(seqs, tokens)
    return tokens


def _draw(logits: torch.Tensor, seqs: list[Sequence], index: list[int]) -> torch.Tensor:
    """Sampled rows' tokens by temperature, min-p, top-k, top-p and Gumbel-max; greedy rows' argmax."""
    B, V = logits.shape
    params = [seq.params for seq in seqs]
    top_k = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    ints = to_device([[seq.seed & _U32 for seq in seqs], [seq.seed >> 32 & _U32 for seq in seqs], index, top_k],
                     torch.int64, logits.device)
    floats = to_device([[p.temperature or 1.0 for p in params], [p.top_p for p in params],
                        [float(p.is_greedy) for p in params], [p.min_p for p in params]], torch.float32, logits.device)
    scaled = logits / floats[0][:, None]
    if any(p.min_p > 0 for p in params):
        scaled = filter_min_p(scaled, floats[3])
    scaled = filter_top_k_top_p(scaled, ints[3], floats[1], max(top_k), any(p.top_p < 1 for p in params))
    drawn = (scaled + gumbel_noise(ints[:3].T, V)).argmax(dim=-1)
    return torch.where(floats[2] > 0, logits.argmax(dim=-1), drawn)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits (n, V), tokens (n,) int64 -> (n, 2 + 2k) float64 on the device: each token's logprob under
    log_softmax(logits), its rank (1: the most likely id), the k most likely ids' logprobs, then those ids (float64
    holds ids and ranks exactly, so one copy reads them all back)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens[:, None])
    rank = (lp > chosen).sum(dim=-1, keepdim=True) + 1
    top = torch.topk(lp, k, dim=-1)
    return torch.cat([chosen.double(), rank.double(), top.values.double(), top.indices.double()], dim=1)


def unpack_logprobs(packed: list[list[float]], ks: list[int]) -> list[TokenLogprob]:
    """token_logprobs' rows read back -> one TokenLogprob per row, keeping the row's first ks[i] top ids."""
    out = []
    for row, k in zip(packed, ks):
        width = (len(row) - 2) // 2
        top = tuple((int(row[2 + width + j]), row[2 + j]) for j in range(k))
        out.append(TokenLogprob(row[0], int(row[1]), top))
    return out


class StepLogprobs:
    """The logprobs of a step's drawn tokens, for the rows that ask (SamplingParams.logprobs), computed from the raw
    logits and copied to the host behind the step's work; None from `of` when no row asks, so that a step without
    logprobs does nothing more."""

    def __init__(self, rows: list[int], ks: list[int], packed: torch.Tensor):
        self.rows, self.ks, self.readback = rows, ks, Readback(packed)

    @classmethod
    def of(cls, logits: torch.Tensor, tokens: torch.Tensor, seqs: list[Sequence]) -> StepLogprobs | None:
        rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if not rows:
            return None
        ks = [seqs[i].params.logprobs for i in rows]
        at = to_device(rows, torch.int64, logits.device)
        return cls(rows, ks, token_logprobs(logits[at], tokens[at], max(ks)))

    def by_row(self) -> dict[int, TokenLogprob]:
        """Waits for the copy: {batch row: its token's logprobs}."""
        return dict(zip(self.rows, unpack_logprobs(self.readback.tolist(), self.ks)))
