"""training/train.py's command line on CPU, two steps with every training term on: it trains, saves a plain Llama
whose factorised k_proj was merged back at its rank, scores it densely and records the run."""
import json

import torch
from safetensors.torch import load_file

from support.cli import run_module
from training.data import TASKS


def test_two_steps_with_every_term_save_a_plain_llama_of_key_rank_20(tmp_path):
    out, results = tmp_path / "model", tmp_path / "train.json"
    run_module("training.train", "--device", "cpu", "--step-scale", "0.001", "--max-context", "512",
               "--tokens-per-step", "1024", "--workers", "0", "--eval-samples", "1", "--eval-contexts", "1024",
               "--key-proj-rank", "20", "--key-rank-weight", "0.1", "--landmark-weight", "0.1",
               "--rank-attention-weight", "0.1", "--rank-logit-weight", "0.1", "--out", str(out),
               "--results", str(results), timeout_s=600)
    record = json.loads(results.read_text())
    assert record["command"].startswith("python -m training.train ") and record["steps"] == 2
    assert [(r["task"], r["context"], r["samples"]) for r in record["rows"]] == [(t, 1024, 1) for t in TASKS]
    assert all(0 <= r["score"] <= 100 for r in record["rows"])
    weights = load_file(str(out / "model.safetensors"))
    k_proj = [w for name, w in weights.items() if name.endswith("self_attn.k_proj.weight")]
    assert len(k_proj) == 6 and all(w.shape == (128, 384) for w in k_proj)  # merged: a plain Linear
    singular = [torch.linalg.svdvals(w.float()) for w in k_proj]
    assert all(s[20] < 0.01 * s[19] for s in singular)  # rank 20, but for bf16 rounding
    assert (out / "README.md").read_text().startswith("# shadowkv-small") and (out / "tokenizer.json").exists()
