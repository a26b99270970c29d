"""The workload benchmark through its command line (benchmarks/workloads): the scenarios are seeded and exactly the
sizes they name; the offline driver serves every scenario with every method on the tiny and the shipped model, each
request getting exactly the tokens it asked for, each turn of a conversation carrying the turns before it; and the
figures it reports are those of the token timings it recorded, with the time between the engine's steps apart."""
import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from benchmarks.workloads.offline import EngineTrace, OfflineRun, StepRecord
from benchmarks.workloads.scenarios import Conversation, Turn
from shadowkv_core import EngineConfig
from support.cli import ROOT, run_module
from support.workloads import METHODS, SCENARIOS, SMALL, check_run, dump

K = 1024


@pytest.fixture(scope="module")
def full_size(tmp_path_factory):
    return dump(tmp_path_factory.mktemp("dump"), "--seed", "3")


def within(values, low, high):
    return all(low <= v <= high for v in values)


def test_scenarios_are_the_sizes_they_name(full_size):
    d = full_size
    assert [len(d[s]) for s in ("doc_qa", "long_output", "multi_turn", "shared_doc", "mixed")] == [16, 16, 8, 32, 32]
    for name, answers in (("doc_qa", (128, 1024)), ("long_output", (4 * K, 8 * K))):
        assert within([c["document_tokens"] for c in d[name]], 32 * K, 120 * K)
        assert all(len(c["turns"]) == 1 and c["turns"][0]["question_tokens"] == 0 for c in d[name])
        assert within([c["turns"][0]["max_tokens"] for c in d[name]], *answers)
    multi = d["multi_turn"]
    assert within([c["document_tokens"] for c in multi], 64 * K, 120 * K) and {len(c["turns"]) for c in multi} == {6}
    turns = [t for c in multi for t in c["turns"]]
    assert within([t["question_tokens"] for t in turns], 50, 200) and {t["max_tokens"] for t in turns} == {256}
    shared = d["shared_doc"]
    assert {(c["document_tokens"], c["document_fingerprint"]) for c in shared} == \
        {(120 * K, shared[0]["document_fingerprint"])}  # one document for every user
    assert within([c["turns"][0]["question_tokens"] for c in shared], 50, 200)
    docs = [c["document_tokens"] for c in d["mixed"]]
    assert all(1 * K <= n <= 8 * K or 32 * K <= n <= 120 * K for n in docs)
    assert 0.4 < sum(n <= 8 * K for n in docs) / len(docs) < 0.95  # about 70 % short
    assert {c["arrival_s"] for s in d for c in d[s]} == {0.0}  # offline: everything at t=0
    assert len({c["document_fingerprint"] for c in d["doc_qa"]}) == 16  # distinct prompts


def test_workloads_are_seeded(full_size, tmp_path):
    assert dump(tmp_path, "--seed", "3", "--scenarios", "multi_turn") == {"multi_turn": full_size["multi_turn"]}
    assert dump(tmp_path, "--seed", "4", "--scenarios", "multi_turn") != {"multi_turn": full_size["multi_turn"]}


def test_online_arrivals_are_a_poisson_process_of_the_rate(tmp_path):
    d = dump(tmp_path, "--scenarios", "doc_qa", "--scale", "0.001", "--count-scale", "40", "--rate", "2.0")
    arrivals = [c["arrival_s"] for c in d["doc_qa"]]
    gaps = np.diff([0.0, *arrivals])
    assert len(arrivals) == 640 and (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.5, rel=0.1) and gaps.std() == pytest.approx(0.5, rel=0.15)  # exponential
    at_t0 = dump(tmp_path, "--scenarios", "doc_qa", "--scale", "0.001", "--count-scale", "40")
    assert [{**c, "arrival_s": 0.0} for c in d["doc_qa"]] == at_t0["doc_qa"]  # the same conversations at any rate


@pytest.mark.parametrize("model, isolate", [("tiny", "--isolate"), ("models/shadowkv-small", "--no-isolate")])
def test_the_offline_driver_serves_every_scenario(tmp_path, model, isolate):
    """Each run in a fresh process (as on CUDA) for the tiny model, in this one for the shipped model."""
    out = tmp_path / "workloads.json"
    run_module("benchmarks.workloads", "--config", "configs/local.yaml", "--model", model, *SMALL, "--events",
               isolate, "--out", str(out), timeout_s=900)
    saved = json.loads(out.read_text())
    assert not saved["failures"] and saved["environment"]["command"]
    workloads = dump(tmp_path, "--config", "configs/local.yaml", "--model", model, *SMALL)
    check_run(saved["rows"], [(s, m) for s in SCENARIOS for m in METHODS], workloads)


def test_prefix_caching_can_be_turned_off_for_a_run(tmp_path):
    """--no-prefix-caching overrides the config: later turns of a conversation then prefill their whole prompt (no
    hit tokens), where with the cache on they adopt the turns before them; the row says which it was."""
    rows = {}
    for flag in ("--prefix-caching", "--no-prefix-caching"):
        out = tmp_path / f"{flag}.json"
        run_module("benchmarks.workloads", "--config", "configs/local.yaml", "--model", "tiny", *SMALL, "--events",
                   "--scenarios", "multi_turn", "--methods", "dense", "shadowkv", "--no-isolate", flag,
                   "--out", str(out), timeout_s=600)
        rows[flag] = json.loads(out.read_text())["rows"]
        check_run(rows[flag], [("multi_turn", m) for m in ("dense", "shadowkv")])
    assert all(r["max_num_seqs"] == 4 for r in rows["--prefix-caching"])  # configs/local.yaml's
    for on, off in zip(rows["--prefix-caching"], rows["--no-prefix-caching"]):
        assert on["prefix_caching"] is True and off["prefix_caching"] is False
        assert on["prefix_hit_tokens"] > 0 and off["prefix_hit_tokens"] == 0 and off["prefix_cached_bytes"] == 0
        assert on["later_turns_ttft_p50_s"] is not None


def test_a_scenario_warm_up_leaves_the_timed_run_its_own_counts(tmp_path):
    """--warm-up scenario serves the scenario once with another seed before the timed run, then clears the prefix
    cache: the timed run's prefix counts are the same as after the engine's warm-up alone or none, not the two runs'
    sum."""
    rows = {}
    for mode in ("engine", "scenario", "none"):
        out = tmp_path / f"{mode}.json"
        run_module("benchmarks.workloads", "--config", "configs/local.yaml", "--model", "tiny", *SMALL,
                   "--events", "--scenarios", "shared_doc", "--methods", "shadowkv", "--no-isolate", "--warm-up", mode,
                   "--out", str(out), timeout_s=600)
        (rows[mode],) = json.loads(out.read_text())["rows"]
        check_run([rows[mode]], [("shared_doc", "shadowkv")])
    assert [rows[mode]["warm_up"] for mode in rows] == list(rows)
    assert rows["engine"]["warm_up_s"] > 0 and rows["none"]["warm_up_s"] is None
    counts = ("prefix_hit_tokens", "prefix_query_tokens", "prefix_evictions")
    assert rows["engine"]["prefix_hit_tokens"] > 0
    assert len({tuple(rows[mode][k] for k in counts) for mode in rows}) == 1


def test_max_num_seqs_overrides_the_config(tmp_path):
    """--max-num-seqs 2: the engine runs two of shared_doc's readers at a time, never three; the prefill step
    overrides reach the engine."""
    out = tmp_path / "two.json"
    run_module("benchmarks.workloads", "--config", "configs/local.yaml", "--model", "tiny", *SMALL, "--events",
               "--scenarios", "shared_doc", "--methods", "dense", "--no-isolate", "--max-num-seqs", "2",
               "--prefill-step-tflop", "0.5", "--prefill-step-ms", "25",
               "--out", str(out), timeout_s=600)
    (row,) = json.loads(out.read_text())["rows"]
    check_run([row], [("shared_doc", "dense")])
    spans = [(q["events"][0][0], q["events"][-1][0]) for q in row["request_records"]]  # first token to last
    busiest = max(sum(first <= t < last for first, last in spans) for t, _ in spans)
    assert row["max_num_seqs"] == 2 and busiest == 2 and len(spans) > 2
    assert (row["prefill_step_tflop"], row["prefill_step_ms"]) == (0.5, 25)


def test_a_replica_of_two_ranks_serves_each_request_whole(tmp_path):
    """A config whose replica is a tensor-parallel group of 2 (gloo on the CPU): every request of a single-turn and a
    multi-turn scenario gets its tokens from the group, for dense and ShadowKV; --host-cache-gib is each rank's."""
    config = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())
    config["applications"][0]["args"]["tensor_parallel_size"] = 2
    path = tmp_path / "tp2.yaml"
    path.write_text(yaml.safe_dump(config))
    out = tmp_path / "tp2.json"
    run_module("benchmarks.workloads", "--config", str(path), "--model", "tiny", *SMALL, "--events",
               "--scenarios", "doc_qa", "multi_turn", "--methods", "dense", "shadowkv", "--no-isolate",
               "--host-cache-gib", "0.2", "--out", str(out), timeout_s=900)
    rows = json.loads(out.read_text())["rows"]
    check_run(rows, [(s, m) for s in ("doc_qa", "multi_turn") for m in ("dense", "shadowkv")])
    assert {(r["tensor_parallel_size"], r["host_cache_gib"]) for r in rows} == {(2, 0.2)}


def test_prefill_step_none_prefills_whole_prompts(tmp_path):
    """--prefill-step-tflop none: the engine runs without a step budget (each prompt prefilled whole), where the
    config's engine left to itself has one."""
    out = tmp_path / "whole.json"
    run_module("benchmarks.workloads", "--config", "configs/local.yaml", "--model", "tiny", *SMALL,
               "--events", "--scenarios", "doc_qa", "--methods", "dense", "--no-isolate", "--warm-up", "none",
               "--prefill-step-tflop", "none", "--out", str(out), timeout_s=600)
    (row,) = json.loads(out.read_text())["rows"]
    check_run([row], [("doc_qa", "dense")])
    assert row["prefill_step_tflop"] is None and EngineConfig(model="x").prefill_step_tflop is not None


def test_shadowkv_set_changes_the_configs_shadowkv_fields(tmp_path):
    """--shadowkv-set FIELD=VALUE: the shadowkv engine runs with those fields changed and the config's others kept;
    an unknown field or a refused value stops the command before any engine starts."""
    out = tmp_path / "fp8.json"
    run_module("benchmarks.workloads", "--config", "configs/local.yaml", "--model", "tiny", *SMALL,
               "--events", "--scenarios", "doc_qa", "--methods", "shadowkv", "--no-isolate", "--warm-up",
               "none", "--shadowkv-set", "value_format=fp8", "sparse_budget=64", "--out", str(out), timeout_s=600)
    (row,) = json.loads(out.read_text())["rows"]
    check_run([row], [("doc_qa", "shadowkv")])
    configured = yaml.safe_load((ROOT / "configs" / "local.yaml").read_text())["applications"][0]["args"]["shadowkv"]
    assert configured.get("value_format", "model") == "model" and configured["sparse_budget"] != 64
    assert (row["shadowkv"]["value_format"], row["shadowkv"]["sparse_budget"]) == ("fp8", 64)
    assert row["shadowkv"]["rank"] == configured["rank"]
    for setting, message in (("ranks=20", "FIELD one of"), ("value_format=fp4", "value_format must be one of")):
        done = run_module("benchmarks.workloads", "--config", "configs/local.yaml", "--model", "tiny", *SMALL,
                          "--scenarios", "doc_qa", "--methods", "shadowkv", "--shadowkv-set", setting,
                          "--out", str(tmp_path / "refused.json"), timeout_s=120, check=False)
        assert done.returncode != 0 and message in done.stderr, done.stderr[-2000:]
    assert not (tmp_path / "refused.json").exists()


def test_hugging_face_serves_the_workload(tmp_path):
    """transformers' generate, static cache and dynamic, one request at a time: every request gets exactly its tokens
    and every turn carries the conversation, as the engines' runs do."""
    out = tmp_path / "hf.json"
    scenario = ["--scenarios", "doc_qa", "multi_turn"]
    run_module("benchmarks.workloads", "--config", "configs/local.yaml", "--model", "tiny", *SMALL, *scenario,
               "--methods", "hf_static", "hf_dynamic", "--events", "--no-isolate", "--out", str(out), timeout_s=900)
    saved = json.loads(out.read_text())
    assert not saved["failures"]
    workloads = dump(tmp_path, "--config", "configs/local.yaml", "--model", "tiny", *SMALL, *scenario)
    check_run(saved["rows"], [(s, m) for s in ("doc_qa", "multi_turn") for m in ("hf_static", "hf_dynamic")],
              workloads)
    for row in saved["rows"]:  # every first turn sent at t=0; served one at a time, in the order sent
        records = row["request_records"]
        assert {q["sent_s"] for q in records if q["request_id"].endswith("-t0")} == {0.0}
        spans = sorted((q["events"][0][0], q["events"][-1][0]) for q in records)
        assert all(end <= first for (_, end), (first, _) in zip(spans, spans[1:]))


def test_a_run_past_its_time_limit_reports_what_it_finished(tmp_path):
    """A zero time limit stops the run after its first step: what is open then is an error ("unfinished"), and the
    figures count only what finished."""
    out = tmp_path / "cut.json"
    run_module("benchmarks.workloads", "--config", "configs/local.yaml", "--model", "tiny", *SMALL,
               "--scenarios", "long_output", "--methods", "dense", "hf_dynamic", "--time-limit-s", "0",
               "--no-isolate", "--out", str(out), timeout_s=900)
    rows = json.loads(out.read_text())["rows"]
    assert [r["method"] for r in rows] == ["dense", "hf_dynamic"]
    for row in rows:
        unfinished = [q for q in row["request_records"] if q["error"] == "unfinished at the run's time limit"]
        assert row["time_limit_s"] == 0 and row["unfinished"] == row["errors"] == len(unfinished) > 0
        assert row["requests_per_min"] == pytest.approx(60 * (row["requests"] - len(unfinished)) / row["wall_s"])


def test_figures_from_known_timings(tmp_path):
    """A hand-made run: two requests sent at 0 and 1 s, whose token events (some bringing several tokens, as a
    streamed server's do) give figures worked out by hand; goodput under two sets of bounds. A third, cut at the
    time limit, counts only in the tokens streamed."""
    records = [
        {"request_id": "c0-t0", "conversation": 0, "turn": 0, "sent_s": 0.0, "prompt_tokens": 10,
         "events": [[0.5, 1], [0.6, 1], [0.9, 3]], "finish_reason": "length", "error": None},
        {"request_id": "c1-t0", "conversation": 1, "turn": 0, "sent_s": 1.0, "prompt_tokens": 20,
         "events": [[3.0, 2], [3.4, 2]], "finish_reason": "length", "error": None},
        {"request_id": "c2-t0", "conversation": 2, "turn": 0, "sent_s": 0.0, "prompt_tokens": 30,
         "events": [[0.2, 1], [3.9, 3]], "finish_reason": None, "error": "unfinished at the run's time limit"},
    ]
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"rows": [{"scenario": "doc_qa", "method": "dense", "wall_s": 4.0,
                                         "ttft_bound_s": 1.0, "itl_bound_ms": 150.0, "request_records": records}]}))
    out = tmp_path / "again.json"
    run_module("benchmarks.workloads", "--resummarize", str(run), "--out", str(out), timeout_s=120)
    (row,) = json.loads(out.read_text())["rows"]
    # TTFT 0.5 and 2.0 s; ITL gaps: 0.1, then 0.3 s shared by 3 tokens (0.1 each), and 0.4 s by 2 (0.2 each)
    assert row["ttft_p50_s"] == pytest.approx(1.25) and row["ttft_p99_s"] == pytest.approx(0.5 + 1.5 * 0.99)
    assert row["itl_p50_ms"] == pytest.approx(100) and row["itl_p99_ms"] == pytest.approx(200)
    assert row["e2e_p50_s"] == pytest.approx((0.9 + 2.4) / 2)
    assert (row["output_tok_s"], row["total_tok_s"], row["streamed_tok_s"]) == pytest.approx((9 / 4, 39 / 4, 13 / 4))
    assert (row["requests"], row["errors"]) == (3, 1)
    assert row["requests_per_min"] == pytest.approx(30) and row["goodput_per_min"] == pytest.approx(15)  # only c0
    for bounds, goodput in (((3, 250), 30), ((3, 150), 15), ((3, 50), 0)):  # ITL p99: c0 100 ms, c1 200 ms
        run_module("benchmarks.workloads", "--resummarize", str(run), "--ttft-bound-s", str(bounds[0]),
                   "--itl-bound-ms", str(bounds[1]), "--out", str(out), timeout_s=120)
        assert json.loads(out.read_text())["rows"][0]["goodput_per_min"] == pytest.approx(goodput), bounds


class _SlowStatsEngine:
    """Answers one token per request per step at once; its statistics take STATS_S a call, as a bookkeeping cost
    between steps would."""
    STATS_S = 0.02
    last_step_prefilled = False
    express_job = None
    runner = SimpleNamespace(graphs=None)

    def __init__(self):
        self.left: dict[str, int] = {}

    def add_request(self, request_id, prompt, params):
        self.left[request_id] = params.max_tokens

    def has_unfinished_requests(self):
        return bool(self.left)

    def step(self):
        outputs = []
        for rid in list(self.left):
            self.left[rid] -= 1
            done = self.left[rid] == 0
            outputs.append(SimpleNamespace(request_id=rid, new_token_ids=[7], finished=done, token_ids=[7],
                                           finish_reason="length" if done else None, error=None))
            if done:
                del self.left[rid]
        return outputs

    def stats(self):
        time.sleep(self.STATS_S)
        return {"host_bytes_in_use": 0}


def test_time_between_the_engines_steps_is_reported_apart_from_the_steps():
    """What the engine's statistics cost between steps shows in outside_steps_s, not in the steps' times."""
    workload = [Conversation(i, 0.0, (1, 2, 3), (Turn((4,), 3), Turn((5,), 2))) for i in range(2)]
    records, trace, wall = OfflineRun(_SlowStatsEngine(), workload).run()
    summary = trace.summary(wall, 100.0)
    steps = summary["steps"]
    assert steps == 5 and all(r.finish_reason == "length" for r in records) and len(records) == 4
    assert summary["outside_steps_s"] >= steps * _SlowStatsEngine.STATS_S
    assert summary["outside_steps_s"] > summary["prefill_step_s"] + summary["decode_only_step_s"]


def test_slow_steps_are_counted_by_what_they_held():
    """Only steps that gave a running request its next token count (one that only ended prefills is no inter-token
    gap); those over the bound are counted by the first of: a graph capture, a prefill that ended, an express
    prefill, other prefill slices, the decode alone."""
    steps = [StepRecord(0.020, False, 4, 0, False, 0), StepRecord(0.030, True, 4, 0, False, 0),
             StepRecord(0.250, True, 5, 1, True, 1), StepRecord(0.180, True, 5, 1, True, 0),
             StepRecord(0.150, True, 4, 0, True, 0), StepRecord(0.120, True, 4, 0, False, 0),
             StepRecord(0.110, False, 4, 0, False, 0), StepRecord(0.500, True, 1, 1, False, 0)]
    summary = EngineTrace(steps).summary(2.0, 100.0)
    assert summary["slow_steps"] == {"graph_capture": 1, "first_token": 1, "express": 1, "prefill": 1,
                                     "decode_only": 1}
    gaps = [20, 30, 250, 180, 150, 120, 110]  # the last step gave no running request a token
    assert summary["decode_step_p50_ms"] == pytest.approx(np.percentile(gaps, 50))
    assert summary["decode_step_p99_ms"] == pytest.approx(np.percentile(gaps, 99))
    assert EngineTrace(steps).summary(2.0, 200.0)["slow_steps"] == {"graph_capture": 1}
