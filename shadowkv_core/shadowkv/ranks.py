"""Per-layer ranks of the key factorisation (ShadowKVConfig.layer_ranks), calibrated on a model's keys.

Layers differ in how much rank their pre-RoPE keys need: in some, a few directions hold nearly all the keys' energy,
in others it is spread. key_spectra runs the model over a calibration text and keeps each layer's Gram matrix of
its keys (all KV heads concatenated, as factorize_keys factorises them); allocate_ranks then shares the replica's
rank budget (`rank` per layer on average, the memory the config already pays) among the layers, each further
column to the layer whose next eigen-direction keeps the largest share of its keys' energy.

    python -m shadowkv_core.shadowkv.ranks --model DIR --text FILE --rank 160
prints the `layer_ranks` to put in a Serve config's `shadowkv` beside `rank`.
"""
from __future__ import annotations

import argparse
import heapq

import torch

from shadowkv_core.attention import prefill_attention_ref
from shadowkv_core.cache.base import AttentionMetadata, CacheSpec, KVCache


class KeySpectra(KVCache):
    """A cache that keeps nothing: each forward is one whole prompt, attended exactly, and each layer's Gram matrix
    of its pre-RoPE keys (Hkv*d, Hkv*d) is summed in fp64 over the forwards."""

    manager = None

    def __init__(self, spec: CacheSpec):
        self.spec = spec
        self.grams: list[torch.Tensor | None] = [None] * spec.num_layers

    def attend(self, layer: int, q: torch.Tensor, k_pre: torch.Tensor, k_rot: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        if meta.num_seqs != 1 or meta.context_lens[0]:
            raise ValueError("KeySpectra takes one whole prompt per forward")
        k = k_pre.reshape(k_pre.shape[0], -1).double()
        gram = k.T @ k
        self.grams[layer] = gram if self.grams[layer] is None else self.grams[layer] + gram
        return prefill_attention_ref(q, k_rot, v, self.spec.scale, self.spec.prefill_chunk_tokens,
                                     self.spec.prefill_attention)

    def finish_forward(self, meta: AttentionMetadata) -> None:
        pass

    def copy_sequence(self, src: int, dst: int) -> None:
        raise NotImplementedError("KeySpectra keeps no sequence")

    def eigenvalues(self) -> list[torch.Tensor]:
        """Each layer's Gram eigenvalues, largest first (fp64, on the CPU)."""
        if any(g is None for g in self.grams):
            raise ValueError("KeySpectra has seen no prompt")
        return [torch.linalg.eigvalsh(g.cpu()).flip(0).clamp_min(0) for g in self.grams]


@torch.no_grad()
def key_spectra(model, spec, token_ids: list[int], device: torch.device | str,
                dtype: torch.dtype) -> list[torch.Tensor]:
    """Each layer's key-Gram eigenvalues (largest first) over one prompt of token_ids through `model` (a Decoder)."""
    cache = KeySpectra(CacheSpec.of(spec, dtype, device))
    ids = torch.tensor(token_ids, device=device)
    positions = torch.arange(len(token_ids), device=device)
    model(ids, positions, cache, AttentionMetadata(True, [0], [len(token_ids)], [0], positions))
    return cache.eigenvalues()


def checkpoint_key_spectra(model: str, token_ids: list[int], device: torch.device | str) -> list[torch.Tensor]:
    """key_spectra of a checkpoint (a local directory or hub id), loaded in bf16 on CUDA and fp32 elsewhere."""
    from shadowkv_core.models import load_model

    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    decoder, spec = load_model(model, dtype, device)
    return key_spectra(decoder, spec, token_ids, device, dtype)


def allocate_ranks(eigenvalues: list[torch.Tensor], rank: int, floor: int | None = None,
                   multiple: int = 1) -> tuple[int, ...]:
    """Ranks, one per layer, averaging `rank`: every layer starts at `floor` (a quarter of rank by default), and
    each further `multiple` columns go to the layer whose next `multiple` eigenvalues are the largest share of its
    trace. The greedy maximises the sum over layers of the share of key energy kept, the shares' gains falling
    as a layer's rank grows (eigenvalues come largest first). multiple: ranks stay multiples of it (tensor
    parallelism: each rank of N factorises its heads at rank/N)."""
    num_layers = len(eigenvalues)
    floor = max(multiple, (rank // 4) // multiple * multiple) if floor is None else floor
    if rank % multiple or floor % multiple or floor < 1:
        raise ValueError(f"rank ({rank}) and floor ({floor}) must be positive multiples of {multiple}")
    if floor > rank:
        raise ValueError(f"floor ({floor}) is above the mean rank ({rank})")
    width = min(len(e) for e in eigenvalues)
    if rank > width:
        raise ValueError(f"rank ({rank}) is above the keys' width ({width})")
    shares = [e / e.sum() if e.sum() > 0 else torch.zeros_like(e) for e in eigenvalues]
    ranks = [floor] * num_layers

    def gain(layer: int) -> float:
        return shares[layer][ranks[layer]:ranks[layer] + multiple].sum().item()

    heap = [(-gain(layer), layer) for layer in range(num_layers) if ranks[layer] + multiple <= width]
    heapq.heapify(heap)
    for _ in range((rank - floor) * num_layers // multiple):
        _, layer = heapq.heappop(heap)
        ranks[layer] += multiple
        if ranks[layer] + multiple <= width:
            heapq.heappush(heap, (-gain(layer), layer))
    return tuple(ranks)


def energy_kept(eigenvalues: list[torch.Tensor], ranks: tuple[int, ...] | list[int]) -> list[float]:
    """The share of each layer's key energy that its rank keeps."""
    return [(e[:r].sum() / e.sum()).item() if e.sum() > 0 else 1.0 for e, r in zip(eigenvalues, ranks)]


def main(argv: list[str] | None = None) -> None:
    from shadowkv_core.models import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="checkpoint directory (or hub id)")
    parser.add_argument("--text", required=True, help="a calibration text file, in the kind of text to be served")
    parser.add_argument("--rank", type=int, required=True, help="the mean rank per layer (ShadowKVConfig.rank)")
    parser.add_argument("--tokens", type=int, default=8192, help="calibration prompt length in tokens")
    parser.add_argument("--floor", type=int, default=None, help="the least rank of a layer (default: rank / 4)")
    parser.add_argument("--multiple", type=int, default=1, help="ranks a multiple of this (tensor_parallel_size)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.model)
    if tokenizer is None:
        raise SystemExit(f"{args.model} ships no tokenizer: the calibration text cannot be encoded")
    with open(args.text, encoding="utf-8") as f:
        token_ids = tokenizer.encode(f.read(), add_special_tokens=True)[:args.tokens]
    eigenvalues = checkpoint_key_spectra(args.model, token_ids, args.device)
    ranks = allocate_ranks(eigenvalues, args.rank, args.floor, args.multiple)
    uniform, kept = energy_kept(eigenvalues, [args.rank] * len(ranks)), energy_kept(eigenvalues, ranks)
    print(f"{len(token_ids)} tokens; key energy kept per layer at rank {args.rank} -> at its own rank")
    for layer, (r, a, b) in enumerate(zip(ranks, uniform, kept)):
        print(f"  layer {layer:3d}: rank {r:4d}  {a:.4f} -> {b:.4f}")
    print(f"layer_ranks: [{', '.join(map(str, ranks))}]")


if __name__ == "__main__":
    main()
