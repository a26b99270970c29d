"""Accuracy of the shipped model through our engine: dense attention, ShadowKV, Quest and two eviction baselines.

RULER-style tasks (training/data.py, evaluation seeds) at several contexts, a needle-in-a-haystack grid (context x
depth), a needle asked after 2,048 decoded tokens (niah_longgen) and a five-turn conversation (niah_multiturn),
greedy; benchmarks/accuracy_runs.py says how each runs. --templates picks the words and the haystack: heldout (the
default: benchmarks/heldout.py, forms, keys, phrasings and text that training never sees), fresh (a second such set,
benchmarks/fresh.py, made after every choice the first one steered), varied or ruler (training's own,
training/templates.py; ruler is the one form the shipped model was trained on).
ShadowKV's rank is scaled to the model as 160 is to Llama-3-8B's 1024 (15.6 % of kv_heads*head_dim), chunk 8, sparse
budgets as fractions of the context. At the same budget: Quest selects chunks by per-chunk min/max key bounds
(shadowkv_core/shadowkv/quest.py), by default with the keys at full rank so the chunks it picks are exact, as Quest
reads them; streamingllm keeps the attention sinks and the newest chunks, snapkv the chunks the prompt's last window
attends to most (shadowkv_core/shadowkv/baselines.py), their keys exact too, as those methods keep the tokens they
keep (--baseline-rank-share puts the three on ShadowKV's low-rank keys).
chunk_oracle is ShadowKV (its rank, outliers, local chunks and budget) with each chunk scored by the largest logit any
of its exact keys gets: no method a server could run (it keeps every key), the ceiling of choosing chunks by keys.
shadowkv_fp8 is ShadowKV with its host values in fp8 (e4m3, a scale per chunk and KV head); shadowkv_fp8lm has its
landmarks in fp8 as well (ShadowKVConfig.landmark_format); shadowkv_timed is the configuration the throughput
benchmark times: the engine's defaults on the device (Triton kernels, CUDA graphs, async and pipelined decode on
CUDA), fp8 values and the device tier. ShadowKV's landmarks are its default bounds (ShadowKVConfig.landmark_kind:
each chunk's per-dimension centre and half-range of its keys, scored by the largest logit a key inside them could
reach); shadowkv_mean and shadowkv_timed_mean are shadowkv and shadowkv_timed with the paper's landmark, the keys'
mean. dense_fp8 is dense attention with its cache in fp8 (EngineConfig.kv_cache_dtype:
e4m3, a scale per token and KV head); dense_timed is dense on the engine's default decode path (on CUDA the paged
decode kernel, CUDA graphs and async decode), which long generation's thousands of steps need to finish in time.
shadowkv_prefix and dense_prefix are shadowkv and dense with one engine kept across a conversation's turns, so that
every turn after the first is served from the engine's prefix cache, where the other methods re-prefill each turn
cold (issue 30). They run niah_multiturn only (a single-prompt task would run them as their uncached method): their
cells of other tasks are skipped, with a note. Every niah_multiturn row records, per turn, the prefix cache's hit and
query tokens and evictions.
Every cell gets a 95 % interval, and each sparse method its paired difference to dense over the samples both scored
(benchmarks/accuracy_stats.py). Writes benchmarks/results/accuracy.json (a list of
rows, each with its per-sample scores), accuracy.meta.json (the runs: command, device, versions, timings; --merge
adds a run's rows and record to what is there), accuracy.md and one NIAH heatmap PNG per method. --shard i k
scores every k-th sample of each cell from the i-th, so that a cell too slow for one process runs as k side by side;
--combine joins the k shards' rows into whole cells.

    python -m benchmarks.accuracy --model models/shadowkv-small --device cuda
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from benchmarks.accuracy_runs import (BASELINES, CACHED, DENSE, DIAGNOSTIC, LONGGEN_TOKENS, MAX_TOKENS, METHODS, build,
                                      conversation, generate, longgen_parts)
from benchmarks.accuracy_stats import cell_interval, combined, fmt, fmt_difference, paired_difference, row_interval
from benchmarks.fresh import FRESH
from benchmarks.heldout import HELDOUT
from training.data import make_sample, score
from training.objectives import RANK_SHARE
from training.templates import MULTITURN, RULER, TASKS, VARIED

HEATMAP_BUDGET = 0.0156
LONGGEN = "niah_longgen"
ALL_TASKS = (*TASKS, LONGGEN, MULTITURN)
TEMPLATES = {t.name: t for t in (HELDOUT, FRESH, VARIED, RULER)}


def methods(budgets: list[float], chosen=METHODS) -> list[tuple[str, float]]:
    """The dense methods first, then the sparse ones per budget, the paper's 1.56 % (if asked for) first."""
    ordered = sorted(budgets, key=lambda b: b != HEATMAP_BUDGET)
    return [(m, 1.0) for m in DENSE if m in chosen] + \
        [(m, b) for b in ordered for m in METHODS if m not in DENSE and m in chosen]


def score_rows(args, groups: dict[tuple, list], save, log) -> list[dict]:
    """Rows of every (method, budget) over every group, saved as they come; stops starting runs past
    --max-minutes. Groups map (task, context) to samples; the NIAH grid's rows are per depth."""
    rows, start = [], time.time()
    for method, budget in methods(args.budgets, args.methods):
        cells = {key: samples for key, samples in groups.items() if method not in CACHED or key[0] == MULTITURN}
        if len(cells) < len(groups):
            log(f"{method} {budget}: runs {MULTITURN} only, skips {len(groups) - len(cells)} other cells")
        for (task, context), samples in cells.items():
            if time.time() - start > args.max_minutes * 60:
                log(f"time limit: stopped before {method} {budget} {task} {context}")
                return rows
            began = time.time()
            per_sample, hit_rates, extra = run_group(args, method, budget, task, context, samples)
            base = {"task": task, "context": context, "method": method, "budget": budget,
                    "templates": args.templates, "seconds": round(time.time() - began, 2), **extra}
            if args.shard:
                base["shard"] = list(args.shard)
            if hit_rates:
                base["hit_rate"] = round(sum(hit_rates) / len(hit_rates), 4)
            if args.calibrate_ranks and method not in DENSE and rank_share_of(args, method) < 1:  # else exact keys
                base["layer_ranks"] = "calibrated"
            if args.landmark_rebuild and method not in (*DENSE, *BASELINES):
                base["landmark_rebuild"] = True
            if args.rescore and method not in (*DENSE, *BASELINES):
                base["rescore"] = args.rescore
            for depth in args.niah_depths if task == "niah_grid" else [None]:
                chosen = [v for s, v in zip(samples, per_sample) if depth is None or _nearest(args, s) == depth]
                mean, low, high = cell_interval(chosen)
                row = {**base, "score": mean, "low": round(low, 2), "high": round(high, 2), "samples": len(chosen),
                       "scores": chosen}
                rows.append(row if depth is None else {**row, "depth": depth})
                where = "" if depth is None else depth
                log(f"{task:18s} {context:6d} {where:5} {method:14s} {budget:7.4f} {fmt((mean, low, high))} "
                    f"({base['seconds']:.1f}s)")
            save(rows)
    return rows


def rank_share_of(args, method: str) -> float:
    """The rank its keys are rebuilt at, as a share of kv_heads*head_dim: the baselines', by default every key
    exactly, as they read keys; ShadowKV's (and the chunk oracle's) its own."""
    return args.baseline_rank_share if method in BASELINES else args.rank_share


def run_group(args, method: str, budget: float, task: str, context: int, samples: list):
    """(per-sample scores, hit rates, extra row fields) of one method on one group of samples."""
    share = rank_share_of(args, method)

    def engine(max_model_len: int, forced: bool = False, conversations: int = 0):
        return build(args.model, method, context, budget, args.device, share, max_model_len, forced, conversations,
                     args.calibrate_ranks, args.landmark_rebuild, args.rescore)

    if task == MULTITURN:
        cached = method in CACHED
        per_turn, hit_rates, prefix = conversation(
            lambda longest: engine(longest + MAX_TOKENS, conversations=len(samples) if cached else 0), samples, cached)
        turns = [sum(t[i] for t in per_turn) / len(per_turn) for i in range(len(per_turn[0]))]
        return [sum(t) / len(t) for t in per_turn], hit_rates, {"turn_scores": turns, **{
            f"turn_prefix_{key}": counts for key, counts in prefix.items()}}
    if task == LONGGEN:
        text = TEMPLATES[args.templates].haystack("eval", args.haystack_file)
        parts = [longgen_parts(s, text, args.longgen_tokens) for s in samples]
        longest = max(len(p) + len(f) for p, f in parts)
        texts, hit_rates = generate(engine(longest + MAX_TOKENS, forced=True), [p for p, _ in parts],
                                    [f for _, f in parts])
        return [score(s, t) for s, t in zip(samples, texts)], hit_rates, {"decoded_before_question":
                                                                          args.longgen_tokens}
    texts, hit_rates = generate(engine(context + MAX_TOKENS), [s.prompt_ids for s in samples])
    return [score(s, t) for s, t in zip(samples, texts)], hit_rates, {}


def _nearest(args, sample) -> float:
    """The grid depth a sample was asked for (its needle moves back to a word boundary)."""
    return min(args.niah_depths, key=lambda d: abs(d - sample.depth))


def sample_groups(args) -> dict[tuple, list]:
    words = {"templates": TEMPLATES[args.templates], "corpus_file": args.haystack_file}
    made = {LONGGEN: "niah_multikey"}  # the long-generation task asks a needle among four
    groups = {(task, c): [make_sample(made.get(task, task), c, seed, turn=0 if task == MULTITURN else None, **words)
                          for seed in shard_seeds(args.samples, args.shard)]
              for c in args.contexts for task in args.tasks}
    for c in args.niah_contexts:  # depths as asked: the grid's needles sit where the table says
        groups[("niah_grid", c)] = [make_sample("niah_single", c, 10_000 + seed, depth=depth, **words)
                                    for depth in args.niah_depths
                                    for seed in shard_seeds(args.niah_samples, args.shard)]
    return groups


def shard_seeds(samples: int, shard: tuple[int, int] | None) -> list[int]:
    """The seeds a run scores: all of range(samples), or shard (i, k)'s, every k-th from i."""
    return list(range(samples)) if shard is None else list(range(shard[0], samples, shard[1]))


# what a row's shards add up, besides their scores: the rest of a row must be the same in each
SUMMED = ("seconds", "turn_prefix_hit_tokens", "turn_prefix_query_tokens", "turn_prefix_evictions")
WEIGHTED = ("hit_rate", "turn_scores")  # means over samples
SCORED = ("score", "low", "high", "samples", "scores", "shard")


def join_shards(rows: list[dict]) -> list[dict]:
    """Rows run in shards (--shard i k: every k-th sample from i) joined into one row per cell, its scores in seed
    order and its interval over all of them; rows run whole pass through. Raises if a cell lacks a shard or has one
    twice, or if its shards differ in anything but what they measured."""
    whole, parts = [], {}
    for r in rows:
        if "shard" not in r:
            whole.append(r)
            continue
        key = json.dumps({f: v for f, v in r.items() if f not in (*SCORED, *SUMMED, *WEIGHTED)}, sort_keys=True)
        parts.setdefault(key, []).append(r)
    for key, shards in parts.items():
        k = shards[0]["shard"][1]
        found = sorted(s["shard"][0] for s in shards)
        if found != list(range(k)) or any(s["shard"][1] != k for s in shards):
            raise ValueError(f"shards of {key} are {[s['shard'] for s in shards]}: need each of 0..{k - 1} of {k} "
                             "once")
        by_seed = {}
        for s in shards:
            by_seed.update(zip(range(s["shard"][0], s["shard"][0] + k * len(s["scores"]), k), s["scores"]))
        if sorted(by_seed) != list(range(len(by_seed))):
            raise ValueError(f"shards of {key} leave seeds out (run with different --samples?): "
                             f"{sorted(set(range(max(by_seed) + 1)) - set(by_seed))}")
        scores = [by_seed[seed] for seed in sorted(by_seed)]
        joined = {f: v for f, v in shards[0].items() if f not in (*SCORED, *SUMMED, *WEIGHTED)}
        for f in SUMMED:
            if all(f in s for s in shards):
                values = [s[f] for s in shards]
                joined[f] = round(sum(values), 2) if f == "seconds" else [sum(t) for t in zip(*values)]
        for f in WEIGHTED:
            if all(f in s for s in shards):
                values, n = [(s[f], s["samples"]) for s in shards], len(scores)
                joined[f] = (round(sum(v * w for v, w in values) / n, 4) if f == "hit_rate"
                             else [sum(v[i] * w for v, w in values) / n for i in range(len(values[0][0]))])
        mean, low, high = cell_interval(scores)
        whole.append({**joined, "score": mean, "low": round(low, 2), "high": round(high, 2), "samples": len(scores),
                      "scores": scores})
    return whole


def markdown(rows: list[dict]) -> str:
    """Per templates: tasks x methods averaged over the contexts, then every cell (task, context), each with its
    95 % interval."""
    out = []
    for templates in sorted({r.get("templates", "ruler") for r in rows}):
        chosen = [r for r in rows if r.get("templates", "ruler") == templates]
        budgets = sorted({r["budget"] for r in chosen if r["method"] not in DENSE})
        # a method run with calibrated layer ranks or keys moved onto their landmarks is a column of its own, after
        # the method
        cols = [(m, b, v) for m, b in methods(budgets, {r["method"] for r in chosen})
                for v in sorted({_column(r)[2] for r in chosen if _column(r)[:2] == (m, b)})]
        head = "| task | " + " | ".join(_label(col) for col in cols) + " |"
        rule = "|---" * (len(cols) + 1) + "|"
        tasks = [t for t in (*ALL_TASKS, "niah_grid") if any(r["task"] == t for r in chosen)]

        def cells(pick) -> list[str]:
            return [combined([r for r in chosen if pick(r) and _column(r) == col]) for col in cols]

        summary = [f"| {t} | " + " | ".join(cells(lambda r, t=t: r["task"] == t)) + " |" for t in tasks]
        summary.append("| **average (RULER tasks)** | " + " | ".join(cells(lambda r: r["task"] in TASKS)) + " |")
        every = [head.replace("| task |", "| task | context |"), rule + "---|"]
        for t in tasks:
            for c in sorted({r["context"] for r in chosen if r["task"] == t}):
                line = [_cell([r for r in chosen if r["task"] == t and r["context"] == c and _column(r) == col])
                        for col in cols]
                every.append(f"| {t} | {c} | " + " | ".join(line) + " |")
        out += [f"### templates: {templates}", "", head, rule, *summary, "", *_paired_to_dense(chosen, cols, tasks),
                "Every cell:", "", *every, ""]
    return "\n".join(out)


def _label(col: tuple[str, float, str]) -> str:
    m, b, v = col
    return (m if m in DENSE else f"{m} {b:.2%}") + (f", {v}" if v else "")


def _paired_to_dense(rows: list[dict], cols: list[tuple], tasks: list[str]) -> list[str]:
    """Each sparse column's paired difference to dense (accuracy_stats.paired_difference) per task and on the RULER
    task average, over the cells both scored on the same samples: each (task, context) against the first of DENSE
    that has it (dense; dense_timed where only it ran, as for long generation). Nothing without a dense cell."""
    whole = [r for r in rows if r.get("scores") and "depth" not in r]  # the NIAH grid's per-depth rows aside
    dense = {}
    for m in reversed(DENSE):
        dense.update({(r["task"], r["context"]): r for r in whole if r["method"] == m})
    sparse = [col for col in cols if col[0] not in DENSE]

    def pairs(col, pick) -> list[tuple[list[float], list[float]]]:  # cells of one sample have no interval
        return [(r["scores"], dense[(r["task"], r["context"])]["scores"]) for r in whole
                if _column(r) == col and pick(r) and (r["task"], r["context"]) in dense
                and len(dense[(r["task"], r["context"])]["scores"]) == len(r["scores"]) >= 2]

    picks = [(t, lambda r, t=t: r["task"] == t) for t in tasks if t != "niah_grid"]
    picks.append(("**average (RULER tasks)**", lambda r: r["task"] in TASKS))
    lines = []
    for label, pick in picks:
        found = [pairs(col, pick) for col in sparse]
        if any(found):
            lines.append(f"| {label} | " + " | ".join(fmt_difference(paired_difference(p) if p else None)
                                                       for p in found) + " |")
    if not lines:
        return []
    head = "| task | " + " | ".join(_label(col) for col in sparse) + " |"
    return ["Paired difference to dense (the same samples; 95 % interval of the mean difference):", "", head,
            "|---" * (len(sparse) + 1) + "|", *lines, ""]


def _column(row: dict) -> tuple[str, float, str]:
    """(method, budget, variant): the variant names what the run changed of the method ("" for nothing)."""
    variant = [label for label, on in (("calibrated ranks", row.get("layer_ranks") == "calibrated"),
                                       ("keys onto landmarks", row.get("landmark_rebuild", False)),
                                       (f"{row.get('rescore')}·k candidates rescored", row.get("rescore", 0))) if on]
    return row["method"], row["budget"], ", ".join(variant)


def _cell(rows: list[dict]) -> str:
    """One (task, context, method) cell; the grid's rows (one per depth) pooled."""
    if len(rows) == 1:
        return fmt(row_interval(rows[0]), rows[0])
    return combined(rows)


def heatmaps(rows: list[dict], out_dir: Path) -> list[Path]:
    grid = [r for r in rows if r["task"] == "niah_grid"]
    if not grid:  # a run without the NIAH grid (--niah-contexts with none) draws nothing
        return []
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for method, templates in sorted({(r["method"], r.get("templates", "ruler")) for r in grid}):
        cells = [r for r in grid if r["method"] == method and r.get("templates", "ruler") == templates
                 and (method in DENSE or r["budget"] == HEATMAP_BUDGET)]
        if not cells:
            continue
        contexts, depths = sorted({r["context"] for r in cells}), sorted({r["depth"] for r in cells})
        table = [[next(r["score"] for r in cells if r["context"] == c and r["depth"] == d) for c in contexts]
                 for d in depths]
        fig, ax = plt.subplots(figsize=(1.2 * len(contexts) + 2, 0.6 * len(depths) + 1.5))
        im = ax.imshow(table, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto")
        ax.set_xticks(range(len(contexts)), [f"{c // 1024}K" for c in contexts])
        ax.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths])
        for i, line in enumerate(table):
            for j, value in enumerate(line):
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=8)
        label = method if method in DENSE else f"{method}, budget {HEATMAP_BUDGET:.2%}"
        ax.set(xlabel="context (tokens)", ylabel="needle depth", title=f"NIAH, {label}, {templates} templates")
        fig.colorbar(im, ax=ax)
        fig.tight_layout()
        paths.append(out_dir / (f"niah_{method}.png" if templates == "ruler" else f"niah_{method}_{templates}.png"))
        fig.savefig(paths[-1], dpi=110)
        plt.close(fig)
    return paths


def arg_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="models/shadowkv-small")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tasks", nargs="+", default=list(ALL_TASKS), choices=ALL_TASKS)
    parser.add_argument("--templates", default="heldout", choices=sorted(TEMPLATES),
                        help="heldout: words and haystack training never sees; fresh: a second such set, made after "
                             "every choice the first steered (benchmarks/fresh.py); varied, ruler: training's own")
    parser.add_argument("--haystack-file", default=None,
                        help="the templates' frozen haystack (benchmarks.heldout or benchmarks.fresh --write-haystack, "
                             "or training.data --write-corpus for varied and ruler); default: read this machine's")
    parser.add_argument("--longgen-tokens", type=int, default=LONGGEN_TOKENS,
                        help="niah_longgen: tokens decoded between the needle's prompt and its question")
    parser.add_argument("--methods", nargs="+", default=[m for m in METHODS if m not in DIAGNOSTIC], choices=METHODS,
                        help=f"{', '.join(CACHED)}: {MULTITURN} only, every turn on one engine and its prefix cache "
                             f"(their cells of other tasks are skipped, with a note); {', '.join(DIAGNOSTIC)}: only "
                             "when named")
    parser.add_argument("--rank-share", type=float, default=RANK_SHARE, help="ShadowKV's rank / (kv_heads*head_dim)")
    parser.add_argument("--calibrate-ranks", metavar="TEXT_FILE", default=None,
                        help="keep each layer's keys at its own rank, chosen on this text's keys with the mean rank "
                             "the method's (ShadowKVConfig.layer_ranks, shadowkv.ranks); default: every layer at it")
    parser.add_argument("--landmark-rebuild", action="store_true",
                        help="ShadowKV's rebuilt keys moved onto their chunk's landmark "
                             "(ShadowKVConfig.landmark_rebuild); the baselines' keys never")
    parser.add_argument("--rescore", type=int, default=0, metavar="C",
                        help="ShadowKV's landmarks' C·k best chunks rescored by their rebuilt keys "
                             "(ShadowKVConfig.rescore); 0: the landmarks choose; the baselines never")
    parser.add_argument("--baseline-rank-share", "--quest-rank-share", type=float, default=1.0,
                        help="Quest's, StreamingLLM's and SnapKV's; 1.0 rebuilds their chunks' keys exactly, as "
                             "they read them (--quest-rank-share, its earlier name, when only Quest's was)")
    parser.add_argument("--contexts", type=int, nargs="*", default=[4096, 8192, 16384])
    parser.add_argument("--samples", type=int, default=50, help="per task and context")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.005, 0.0156, 0.03, 0.06])
    parser.add_argument("--niah-contexts", type=int, nargs="*", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--niah-depths", type=float, nargs="*", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    parser.add_argument("--niah-samples", type=int, default=10, help="per grid cell (context, depth)")
    parser.add_argument("--shard", type=int, nargs=2, metavar=("I", "K"), default=None,
                        help="score every K-th sample from the I-th (0-based) of each cell; --combine joins the K "
                             "shards' rows into whole cells")
    parser.add_argument("--out-dir", default="benchmarks/results")
    parser.add_argument("--max-minutes", type=float, default=60.0, help="start no run past this")
    parser.add_argument("--merge", action="store_true",
                        help="keep the rows of other (method, budget, templates) already in --out-dir's "
                             "accuracy.json")
    parser.add_argument("--combine", nargs="+", metavar="DIR",
                        help="run nothing: join the results of runs made side by side (each DIR an --out-dir) into "
                             "--out-dir")
    return parser


def main() -> None:
    parser = arg_parser()
    args = parser.parse_args()
    if args.shard and not 0 <= args.shard[0] < args.shard[1]:
        parser.error(f"--shard I K needs 0 <= I < K, got {args.shard[0]} {args.shard[1]}")
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.combine:
        rows = join_shards([r for d in args.combine for r in json.loads((Path(d) / "accuracy.json").read_text())])
        runs = [run for d in args.combine for run in earlier_runs(Path(d) / "accuracy.meta.json")]
        print(write_results(out_dir, rows, runs))
        return
    start = time.time()
    replaced = [(m, b, args.templates) for m, b in methods(args.budgets, args.methods)]
    kept = kept_rows(out_dir / "accuracy.json", replaced) if args.merge else []
    save = lambda rows: (out_dir / "accuracy.json").write_text(json.dumps(kept + rows, indent=1))  # noqa: E731
    rows = kept + score_rows(args, sample_groups(args), save, lambda msg: print(msg, flush=True))
    meta = {"command": "python -m benchmarks.accuracy " + " ".join(sys.argv[1:]), "device": device_name(args.device),
            "versions": {"python": platform.python_version(), "torch": torch.__version__},
            "seconds": round(time.time() - start, 1), "model": args.model}
    runs = earlier_runs(out_dir / "accuracy.meta.json") + [meta] if args.merge else [meta]
    print(write_results(out_dir, rows, runs))


def write_results(out_dir: Path, rows: list[dict], runs: list[dict]) -> str:
    """accuracy.json, accuracy.meta.json (the runs), accuracy.md and the heatmaps; returns the markdown table."""
    (out_dir / "accuracy.json").write_text(json.dumps(rows, indent=1))
    (out_dir / "accuracy.meta.json").write_text(json.dumps(runs, indent=1))
    table = markdown(rows)
    commands = "\n".join(f"`{run['command']}` on {run['device']}" for run in runs)
    (out_dir / "accuracy.md").write_text(f"{commands}\n\n{table}")
    heatmaps(rows, out_dir)
    return table


def kept_rows(path: Path, replaced: list[tuple[str, float, str]]) -> list[dict]:
    """The rows of an earlier accuracy.json whose (method, budget, templates) this run does not measure again (rows
    written before templates were named are ruler's)."""
    if not path.exists():
        return []
    return [r for r in json.loads(path.read_text())
            if (r["method"], r["budget"], r.get("templates", "ruler")) not in replaced]


def earlier_runs(path: Path) -> list[dict]:
    """The runs recorded in an earlier accuracy.meta.json (one run, or a list of them)."""
    if not path.exists():
        return []
    meta = json.loads(path.read_text())
    return meta if isinstance(meta, list) else [meta]


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name()
    return f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


if __name__ == "__main__":
    main()
