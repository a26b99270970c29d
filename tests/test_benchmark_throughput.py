"""benchmarks/throughput.py on a tiny geometry on CPU, through the command lines: the script runs end to end, and the
HF baseline's shortcut is honest (benchmarks/hf_check.py: its static cache decodes what its dynamic cache does). No
speed is asserted. (Its batch shortcut, LLMEngine.fork, is the engine's: tests/test_engine.py.)"""
import dataclasses
import importlib.util
import json

import pytest
import torch

from shadowkv_core import memory_model as mm
from shadowkv_core.models.geometry import TINY, TINY_SHADOWKV, model_spec, write_config
from support.cli import run_module

RUN = ["--model", "tiny", "--device", "cpu", "--contexts", "512", "--warmup-steps", "1", "--profile-steps", "1",
       "--max-new-tokens", "24"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run of every kind of method: dense (model dtype and fp8 KV), ShadowKV (bf16 and fp8 values; CUDA graphs
    asked for and not), HF's two caches."""
    root = tmp_path_factory.mktemp("throughput")
    kernels = root / "kernels.json"
    kernels.write_text(json.dumps({"meta": {}, "rows": [{"kernel": "fetch_values"}]}))
    run_module("benchmarks.throughput", *RUN, "--steps", "2", "--max-batch", "3", "--methods", "dense", "dense_fp8",
               "shadowkv", "shadowkv_fp8", "shadowkv_eager", "hf", "hf_static", "--out", str(root / "t.json"),
               "--kernels-json", str(kernels), timeout_s=900)
    return root, json.loads((root / "t.json").read_text())


def test_hf_static_cache_decodes_the_same_tokens_as_its_dynamic_cache(tmp_path):
    """The HF baseline's two caches, each filled from the same prefilled prompt and replicated to the batch: the
    static one (written once, positions given) generates exactly the dynamic one's greedy tokens."""
    out = tmp_path / "hf_check.json"
    done = run_module("benchmarks.hf_check", "--model", "tiny", "--device", "cpu", "--out", str(out), timeout_s=600,
                      check=False)
    saved = json.loads(out.read_text())
    dynamic, static = saved["dynamic"], saved["static"]
    assert [len(row) for row in dynamic] == [6, 6, 6] and dynamic == static
    assert len(set(dynamic[0])) > 1  # the tokens change from step to step: positions are honoured
    assert saved["honest"] and done.returncode == 0, done.stderr[-2000:]


def test_no_profiled_steps_profile_nothing(tmp_path):
    """--profile-steps 0 times every batch and profiles none (it divided by zero steps and lost the method's rows)."""
    out = tmp_path / "t.json"
    run_module("benchmarks.throughput", *RUN, "--profile-steps", "0", "--steps", "1", "--max-batch", "2", "--methods",
               "shadowkv", "--out", str(out), timeout_s=600)
    saved = json.loads(out.read_text())
    assert not saved["failures"] and {r["batch"] for r in saved["rows"]} == {1, 2}
    assert not any("breakdown_ms" in r for r in saved["rows"])


def test_script_writes_rows_summary_and_plot(run):
    root, saved = run
    assert not saved["failures"] and saved["environment"]["command"]
    rows = saved["rows"]
    assert {r["method"] for r in rows} == {"dense", "dense_fp8", "shadowkv", "shadowkv_fp8", "shadowkv_eager", "hf",
                                           "hf_static"}
    for r in rows:
        assert r["decode_tok_s"] > 0 and r["ttft_s"] > 0 and r["itl_p99_ms"] >= r["itl_p50_ms"] > 0
        assert r["steps"] == 2
    assert {r["batch"] for r in rows if r["method"] == "shadowkv"} == {1, 2, 3}
    assert {r["batch"] for r in rows if r["method"] == "shadowkv_eager"} == {3}
    assert all(0 <= r["hit_rate"] <= 1 and r["peak_host_gib"] > 0 for r in rows if r["method"] == "shadowkv")
    assert "QKV" in next(r for r in rows if r["method"] == "dense" and "breakdown_ms" in r)["breakdown_ms"]
    summary = saved["summary"][0]
    # fp8 blocks: at least the dense batch fits (the largest batch each ran; the summary's is its fastest row's, which
    # a loaded CPU may put at any batch)
    largest = {m: max(r["batch"] for r in rows if r["method"] == m) for m in ("dense", "dense_fp8")}
    assert largest["dense_fp8"] >= largest["dense"]
    assert summary["dense_method"] == max(("dense", "dense_fp8"), key=lambda m: summary[f"{m}_tok_s"])
    assert {"shadowkv_over_dense", "shadowkv_over_hf", "prefill_overhead", "dense_x_roofline",
            "shadowkv_fp8_over_dense", "fp8_batch_over_bf16", "shadowkv_graph_speedup_at_3"} <= set(summary)
    # The plot needs the `bench` extra (matplotlib); without it the run still writes its JSON and no PNG.
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (root / "t.png").exists() == has_matplotlib
    assert not has_matplotlib or (root / "t.png").stat().st_size > 0
    # the decode step of record is Llama-3.1-8B's: a tiny run leaves the kernels' results alone
    assert json.loads((root / "kernels.json").read_text())["rows"] == [{"kernel": "fetch_values"}]


def test_a_replica_of_two_ranks_decodes_sized_by_one_ranks_bytes(tmp_path):
    """--tensor-parallel 2: each engine is a group of two ranks (gloo on the CPU), sized by one rank's geometry (half
    the KV heads: twice the sequences of a rank's bytes); no profile, which would see rank 0 alone."""
    out = tmp_path / "tp.json"
    g = mm.Geometry.from_spec(model_spec(write_config(TINY)), torch.float32)
    host_gib = 2.5 * mm.seq_bytes(g, TINY_SHADOWKV, 512, 24).host / mm.GIB  # two and a half sequences' values
    run_module("benchmarks.throughput", *RUN, "--steps", "2", "--max-batch", "6", "--methods", "dense", "shadowkv",
               "--tensor-parallel", "2", "--host-gib", str(host_gib), "--out", str(out),
               "--kernels-json", str(tmp_path / "k.json"), timeout_s=900)
    saved = json.loads(out.read_text())
    assert not saved["failures"] and saved["tensor_parallel_size"] == 2
    rows = saved["rows"]
    assert {r["method"] for r in rows} == {"dense", "shadowkv"}
    assert all(r["tensor_parallel_size"] == 2 and "breakdown_ms" not in r and r["decode_tok_s"] > 0 for r in rows)
    # each rank's budget, where a rank keeps half of each sequence's values: five sequences (one GPU would hold two)
    assert max(r["batch"] for r in rows if r["method"] == "shadowkv") == 5


def test_hugging_face_runs_on_one_gpu_alone():
    done = run_module("benchmarks.throughput", *RUN, "--methods", "hf", "--tensor-parallel", "2", timeout_s=120,
                      check=False)
    assert done.returncode == 2 and "--tensor-parallel" in done.stderr


def test_a_tiered_method_keeps_values_on_the_device_when_the_host_bounds_the_batch(tmp_path):
    """With a host budget of about two sequences' values and room on the "device", _tiered picks a share > 0 that
    holds more sequences, and its misses are partly read from the device region (the reference path on CPU)."""
    g = mm.Geometry.from_spec(model_spec(write_config(TINY)), torch.float32)
    host_gib = 2.5 * mm.seq_bytes(g, TINY_SHADOWKV, 512, 24).host / mm.GIB
    args = [*RUN, "--steps", "3", "--host-gib", str(host_gib), "--max-batch", "4", "--kernels-json",
            str(tmp_path / "k.json")]
    run_module("benchmarks.throughput", *args, "--methods", "shadowkv", "shadowkv_tiered_pipelined",
               "--out", str(tmp_path / "t.json"), timeout_s=900)
    out = json.loads((tmp_path / "t.json").read_text())
    assert not out["failures"]
    plain = max(r["batch"] for r in out["rows"] if r["method"] == "shadowkv")
    tiered = [r for r in out["rows"] if r["method"] == "shadowkv_tiered_pipelined"]
    assert plain == 2 and max(r["batch"] for r in tiered) > plain
    assert all(0 < r["device_value_share"] <= 1 and r["device_fetch_fraction"] > 0 for r in tiered)
    # a sweep over given shares: one run per share, rows told apart by it, the summary naming the best one's share
    # (each share in its own process, as on CUDA)
    run_module("benchmarks.throughput", *args, "--methods", "shadowkv_tiered_pipelined", "--tier-share", "0.25", "0.75",
               "--isolate", "--out", str(tmp_path / "s.json"), timeout_s=900)
    swept = json.loads((tmp_path / "s.json").read_text())
    assert not swept["failures"]
    shares = {r["device_value_share"] for r in swept["rows"]}
    assert shares == {0.25, 0.75}
    best = max(swept["rows"], key=lambda r: r["decode_tok_s"])
    assert swept["summary"][0]["shadowkv_tiered_pipelined_device_value_share"] == best["device_value_share"]
    held = [max(r["batch"] for r in swept["rows"] if r["device_value_share"] == x) for x in (0.25, 0.75)]
    assert held[1] > held[0]  # the host bounds the batch here: less of each sequence on it holds more sequences


def test_method_names_set_the_configuration_they_say():
    """Each suffix of a method's name sets its own field of the run's ShadowKV config and nothing else."""
    from benchmarks.throughput import ENGINE_METHODS, RESCORE, method_setup
    from shadowkv_core.config import ShadowKVConfig
    base = ShadowKVConfig()
    cfg, options = method_setup("shadowkv_fp8lm_rebuild_tiered_pipelined", base, tier_share=0.375)
    assert (cfg.value_format, cfg.landmark_format, cfg.landmark_kind) == ("fp8", "fp8", base.landmark_kind)
    assert cfg.landmark_rebuild and cfg.device_value_share == 0.375 and options["pipeline_decode"]
    mean, _ = method_setup("shadowkv_fp8lm_mean_tiered_pipelined", base, tier_share=0.375)
    assert mean.landmark_kind == "mean" and not mean.landmark_rebuild
    plain, options = method_setup("shadowkv_eager", base)
    assert plain == dataclasses.replace(base, device_value_share=0.0)
    assert not options["cuda_graphs"] and not options["pipeline_decode"]
    assert method_setup("dense_fp8", base) == (None, {**options, "cuda_graphs": True, "kv_cache_dtype": "fp8"})
    shadow = {m: method_setup(m, base)[0] for m in ENGINE_METHODS}
    assert all(cfg is None or cfg.landmark_rebuild == ("_rebuild" in m) for m, cfg in shadow.items())
    assert all(cfg is None or (cfg.rescore > 0) == ("_rescore" in m) for m, cfg in shadow.items())
    rescored, _ = method_setup("shadowkv_fp8lm_rescore_tiered_pipelined", base, tier_share=0.375)
    assert rescored == dataclasses.replace(base, value_format="fp8", landmark_format="fp8", device_value_share=0.375,
                                           rescore=RESCORE)
