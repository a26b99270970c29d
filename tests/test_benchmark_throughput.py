"""benchmarks/throughput.py on a tiny geometry on CPU: the script runs end to end and its shortcut is honest (a cloned
sequence decodes exactly what its source decodes). No speed is asserted; one test checks how a step is timed, on a
stand-in engine."""
import importlib.util
import json
import os
import time

import pytest
import torch

from benchmarks import hf_baseline
from benchmarks import throughput as tp
from shadowkv_core import ShadowKVConfig
from shadowkv_core import memory_model as mm
from shadowkv_core.models.geometry import TINY_SHADOWKV, model_spec, write_config


def test_hf_static_cache_decodes_the_same_tokens_as_its_dynamic_cache():
    """The HF baseline's two caches, each filled from the same prefilled prompt and replicated to the batch: the
    static one (written once, positions given) generates exactly the dynamic one's greedy tokens."""
    model = hf_baseline.load(write_config(tp.geometry_config("tiny", 1024)), torch.float32, "cpu")
    prompt = torch.randint(0, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    _, token, prefix = hf_baseline.prefill(model, prompt, "cpu")
    dynamic, static = (hf_baseline.decode(model, prefix, token, 3, 6, 1, "cpu", static=s)[1] for s in (False, True))
    assert dynamic.shape == (3, 6) and torch.equal(dynamic, static)
    assert len(set(dynamic[0].tolist())) > 1  # the tokens change from step to step: positions are honoured


def test_script_writes_rows_summary_plot_and_merges_the_decode_step(tmp_path):
    kernels = tmp_path / "kernels.json"
    kernels.write_text(json.dumps({"meta": {}, "rows": [{"kernel": "fetch_values"}, {"kernel": "decode_step"}]}))
    out = tp.main(["--model", "tiny", "--device", "cpu", "--contexts", "512", "--steps", "2", "--warmup-steps", "1",
                   "--profile-steps", "1", "--max-new-tokens", "24", "--max-batch", "3",
                   "--out", str(tmp_path / "t.json"), "--kernels-json", str(kernels)])
    assert not out["failures"]
    assert {r["method"] for r in out["rows"]} == {"dense", "shadowkv", "hf"}
    for r in out["rows"]:
        assert r["decode_tok_s"] > 0 and r["ttft_s"] > 0 and r["itl_p99_ms"] >= r["itl_p50_ms"] > 0
    assert {r["batch"] for r in out["rows"] if r["method"] == "shadowkv"} == {1, 2, 3}
    assert all(0 <= r["hit_rate"] <= 1 and r["peak_host_gib"] > 0 for r in out["rows"] if r["method"] == "shadowkv")
    assert "QKV" in next(r for r in out["rows"] if r["method"] == "dense" and "breakdown_ms" in r)["breakdown_ms"]
    summary = out["summary"][0]
    assert {"shadowkv_over_dense", "shadowkv_over_hf", "prefill_overhead", "dense_x_roofline"} <= set(summary)
    saved = json.loads((tmp_path / "t.json").read_text())
    assert saved["environment"]["command"] and saved["rows"] == json.loads(json.dumps(out["rows"]))
    # The plot needs the `bench` extra (matplotlib); without it the run still writes its JSON and no PNG.
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    assert (tmp_path / "t.png").exists() == has_matplotlib
    assert not has_matplotlib or (tmp_path / "t.png").stat().st_size > 0
    rows = [dict(r, context=122880, batch=8) for r in out["rows"] if r["method"] == "shadowkv"][:1]
    step = tp.merge_decode_step(kernels, rows)
    merged = json.loads(kernels.read_text())["rows"]
    assert [r["kernel"] for r in merged] == ["fetch_values", "decode_step"] and merged[1] == step
    assert step["time_ms"] > 0 and step["floor_ms"] > 0
    # other methods in a run of their own: fp8 values against dense's batch, CUDA graphs against eager
    more = tp.main(["--model", "tiny", "--device", "cpu", "--contexts", "512", "--steps", "2", "--warmup-steps", "1",
                    "--profile-steps", "1", "--max-new-tokens", "24", "--max-batch", "3",
                    "--methods", "dense", "shadowkv", "shadowkv_fp8", "shadowkv_eager", "hf_static",
                    "--out", str(tmp_path / "more.json"), "--kernels-json", str(kernels)])
    assert {r["batch"] for r in more["rows"] if r["method"] == "shadowkv_eager"} == {3}
    assert {"shadowkv_fp8_over_dense", "fp8_batch_over_bf16", "shadowkv_graph_speedup_at_3"} <= set(more["summary"][0])


def test_a_tiered_method_keeps_values_on_the_device_when_the_host_bounds_the_batch(tmp_path):
    """With a host budget of about two sequences' values and room on the "device", _tiered picks a share > 0 that
    holds more sequences, and its misses are partly read from the device region (the reference path on CPU)."""
    model = write_config(tp.geometry_config("tiny", 1024))
    g = mm.Geometry.from_spec(model_spec(model), torch.float32)
    host_gib = 2.5 * mm.seq_bytes(g, TINY_SHADOWKV, 512, 24).host / mm.GIB
    args = ["--model", "tiny", "--device", "cpu", "--contexts", "512", "--steps", "3", "--warmup-steps", "1",
            "--profile-steps", "1", "--max-new-tokens", "24", "--host-gib", str(host_gib), "--max-batch", "4",
            "--out", str(tmp_path / "t.json"), "--kernels-json", str(tmp_path / "k.json")]
    out = tp.main(args + ["--methods", "shadowkv", "shadowkv_tiered_pipelined"])
    assert not out["failures"]
    plain = max(r["batch"] for r in out["rows"] if r["method"] == "shadowkv")
    tiered = [r for r in out["rows"] if r["method"] == "shadowkv_tiered_pipelined"]
    assert plain == 2 and max(r["batch"] for r in tiered) > plain
    assert all(0 < r["device_value_share"] <= 1 and r["device_fetch_fraction"] > 0 for r in tiered)
    # a sweep over given shares: one run per share, rows told apart by it, the summary naming the best one's share
    # (each share in its own process, as on CUDA)
    swept = tp.main(args + ["--methods", "shadowkv_tiered_pipelined", "--tier-share", "0.25", "0.75", "--isolate",
                            "--out", str(tmp_path / "s.json")])
    assert not swept["failures"]
    shares = {r["device_value_share"] for r in swept["rows"]}
    assert shares == {0.25, 0.75}
    best = max(swept["rows"], key=lambda r: r["decode_tok_s"])
    assert swept["summary"][0]["shadowkv_tiered_pipelined_device_value_share"] == best["device_value_share"]
    held = [max(r["batch"] for r in swept["rows"] if r["device_value_share"] == x) for x in (0.25, 0.75)]
    assert held[1] > held[0]  # the host bounds the batch here: less of each sequence on it holds more sequences


def test_run_isolated_runs_in_another_process_and_raises_its_errors():
    assert tp.run_isolated(os.getpid) != os.getpid()
    with pytest.raises(ValueError, match="invalid literal"):
        tp.run_isolated(int, "not a number")


def test_decode_steps_are_timed_return_to_return():
    """time_decode times a step from the return of the one before it, the stats read between them included (with
    async decode the device runs the step in flight meanwhile; nothing drains it before the first timed step)."""
    class Engine:
        calls = 0

        def step(self):
            Engine.calls += 1
            time.sleep(0.005)

        def stats(self):
            time.sleep(0.003)
            return {"step": Engine.calls}

    times, stats = tp.time_decode(Engine(), 3, 2)
    assert [s["step"] for s in stats] == [3, 4, 5]
    assert len(times) == 3 and all(0.008 <= t < 0.05 for t in times[1:]) and 0.005 <= times[0] < 0.05


@pytest.mark.parametrize("method", [m for m in tp.METHODS if not m.startswith("hf")])
def test_a_method_name_sets_what_it_says(method):
    """Each part of an engine method's name sets its config: fp8 values (and landmarks), a device value tier,
    pipelined halves, no CUDA graphs (_eager), no async decode (_sync)."""
    cfg, options = tp.method_setup(method, ShadowKVConfig(), tier_share=0.25)
    if method.startswith("dense"):
        assert cfg is None
    else:
        assert cfg.value_format == ("fp8" if "_fp8" in method else "model")
        assert cfg.landmark_format == ("fp8" if "_fp8lm" in method else "model")
        assert cfg.device_value_share == (0.25 if "_tiered" in method else 0.0)
    assert options["pipeline_decode"] == ("_pipelined" in method)
    assert options["cuda_graphs"] == (not method.endswith("_eager"))
    assert options["async_decode"] == (False if method.endswith("_sync") else "auto")
