"""tokengym on a GPU: stepwise collection against a hand-written KV-cache loop and ``generate``, host syncs per env
step, peak memory and one GRPO iteration, in one run; writes ``OUT/gpu_bench.md`` and ``OUT/gpu_bench.json``.

    python benchmarks/gpu/bench.py --device cuda --size real --out DIR [--quick] [--sections throughput,syncs]
    python benchmarks/gpu/bench.py --device cpu --size tiny --out DIR      # the dry run (CUDA-only numbers: n/a)

Every contestant samples the full vocabulary at temperature 1 with tokengym's ``sample_tokens`` and counts only
real tokens. Contestants run interleaved (every round runs each once, order rotated per round; one warm-up round
not counted); tokens/s is the median over the rounds, a ratio the median of the per-round ratios. Each section
records its error in the table instead of stopping the run, and the files are rewritten after every section.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import _contestants as cs  # this folder is sys.path[0] when run as a script
import torch

SIZES = {  # B of the throughput runs (the first is the main one), new tokens, GRPO and sync-count shapes
    "real": {"batch_sizes": (64, 8, 256), "wave_sizes": (64, 256), "new_tokens": 128,
             "grpo": (8, 8, 256), "syncs": (64, 64, 8), "budget_s": 230.0,
             # rows, new tokens, token budget per micro-batch (None: whole batch), checkpointing, whole logits too
             "train_memory": ((64, 256, None, False, True), (64, 256, 4096, True, False),
                              (64, 4096, 16384, True, False)),
             "fsdp2": (64, 256)},
    "tiny": {"batch_sizes": (8, 4), "wave_sizes": (8,), "new_tokens": 16,
             "grpo": (2, 4, 16), "syncs": (8, 32, 4), "budget_s": None,
             "train_memory": ((8, 16, None, False, True), (8, 16, 64, True, False)), "fsdp2": (8, 16)},
}  # fmt: skip
QUICK = {"real": {"batch_sizes": (64,), "wave_sizes": (64,), "grpo": (8, 8, 64)}, "tiny": {}}
SECTIONS = ("throughput", "syncs", "memory", "grpo", "train_memory", "fsdp2", "compile")
T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench {time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


class Context:
    """The run's settings, model and results; ``sync()`` waits for the device before a clock is read."""

    def __init__(self, args) -> None:
        self.args, self.device = args, torch.device(args.device)
        self.is_cuda = self.device.type == "cuda"
        plan = {**SIZES[args.size], **(QUICK[args.size] if args.quick else {})}
        if args.batch_sizes:
            plan["batch_sizes"] = tuple(int(b) for b in args.batch_sizes.split(","))
        self.plan, self.rounds = plan, args.rounds
        self.new_tokens = args.new_tokens or plan["new_tokens"]
        budget = args.budget_s if args.budget_s is not None else plan["budget_s"]
        self.deadline = None if budget is None else T0 + budget
        self.rows: list[dict] = []
        self.raw: dict = {}
        self.times: dict[str, float] = {}
        self.run_seconds: float | None = None  # seconds of one contestant run at the main B (for the budget)
        self.header: dict = {}
        self.tok = self.model = None

    def sync(self) -> None:
        if self.is_cuda:
            torch.cuda.synchronize(self.device)

    def job(self, B: int, new_tokens: int | None = None) -> cs.Job:
        return cs.Job(self.tok, self.model, self.device, B, new_tokens or self.new_tokens)

    def add(self, section: str, measure: str, B=None, value=None, baseline=None, ratio=None, goal: str = "",
            met: bool | None = None, note: str = "") -> None:  # fmt: skip
        self.rows.append({"section": section, "measure": measure, "B": B, "value": value, "baseline": baseline,
                          "ratio": ratio, "goal": goal, "met": met, "note": note})  # fmt: skip

    def free(self) -> None:
        gc.collect()
        if self.is_cuda:
            torch.cuda.empty_cache()


def _cell(x) -> str:
    if x is None:
        return ""
    if isinstance(x, float):
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"
    return str(x)


def markdown(ctx: Context) -> str:
    h = ctx.header
    lines = ["# tokengym GPU benchmark", ""] + [f"- {k}: {v}" for k, v in h.items()] + [""]
    lines += ["| section | measure | B | value | baseline | ratio | goal |", "|---|---|---|---|---|---|---|"]
    order = {s: i for i, s in enumerate(("build", *SECTIONS))}
    for r in sorted(ctx.rows, key=lambda r: (order.get(r["section"], 9), r["B"] or 0)):
        goal = r["goal"] + ("" if r["met"] is None else (" (met)" if r["met"] else " (MISSED)"))
        value = _cell(r["value"]) + (f" {r['note']}" if r["note"] else "")
        lines.append(f"| {r['section']} | {r['measure']} | {_cell(r['B'])} | {value} | {_cell(r['baseline'])} "
                     f"| {_cell(r['ratio'])} | {goal} |")  # fmt: skip
    lines += ["", "Section times (s): " + ", ".join(f"{k} {v:.1f}" for k, v in ctx.times.items()), ""]
    return "\n".join(lines)


def write(ctx: Context) -> str:
    out = Path(ctx.args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(ctx)
    (out / "gpu_bench.md").write_text(md)
    data = {"header": ctx.header, "rows": ctx.rows, "section_seconds": ctx.times, "raw": ctx.raw}
    (out / "gpu_bench.json").write_text(json.dumps(data, indent=1, default=str))
    return md


def header(ctx: Context, model_text: str) -> dict:
    import tensordict
    import torchrl
    import transformers

    gpu, driver = "none (CPU)", "n/a"
    if ctx.is_cuda:
        gpu = torch.cuda.get_device_name(ctx.device)
        try:
            driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                    capture_output=True, text=True, timeout=20).stdout.strip().splitlines()[0]  # fmt: skip
        except (OSError, IndexError, subprocess.SubprocessError) as err:
            driver = f"unknown ({type(err).__name__})"
    p = ctx.plan
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"), "GPU": gpu, "driver": driver,
        "versions": f"python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
                    f"transformers {transformers.__version__}, tensordict {tensordict.__version__}, "
                    f"torchrl {torchrl.__version__}",
        "model": model_text, "dtype": str(next(ctx.model.parameters()).dtype).removeprefix("torch."),
        "sizes": f"B {list(p['batch_sizes'])} (waves at {list(p['wave_sizes'])}), {ctx.new_tokens} new tokens, "
                 f"prompts ~{cs.PROMPT_TOKENS} tokens, {ctx.rounds} rounds + 1 warm-up, interleaved; "
                 f"GRPO {p['grpo'][0]} prompts x {p['grpo'][1]}, {p['grpo'][2]} new tokens; syncs B {p['syncs'][0]}, "
                 f"{p['syncs'][1]} steps, max_new_tokens {p['syncs'][2]}",
        "sampling": "temperature 1, full vocabulary, tokengym sample_tokens (every contestant)",
        "command": " ".join(sys.argv), "quick": ctx.args.quick, "threads": torch.get_num_threads(),
    }  # fmt: skip


def run_section(ctx: Context, name: str, fn, *args) -> None:
    """Run one section; its error becomes a row, and the files are written whatever happened."""
    log(f"section {name}: start")
    t = time.perf_counter()
    try:
        fn(ctx, *args)
    except Exception as err:  # one section's failure must not lose the others' numbers
        traceback.print_exc()
        ctx.add(name.split()[0], "error", B=args[0] if args else None, value=cs.error_text(err))
    finally:
        ctx.free()
    ctx.times[name] = time.perf_counter() - t
    log(f"section {name}: {ctx.times[name]:.1f} s")
    write(ctx)


# -- sections: each adds rows to ctx --
# the baseline is the graph loop (the same model in one CUDA graph); the eager hand loop and generate beside it
PAIRS = [("stepwise graph", "graph loop"), ("stepwise", "graph loop"), ("waves", "graph loop"),
         ("generate", "graph loop"), ("hand loop", "graph loop"), ("stepwise graph", "stepwise"),
         ("stepwise", "hand loop"), ("waves", "generate"), ("waves graph", "graph loop"),
         ("waves graph", "waves")]  # fmt: skip
GOALS = {("stepwise graph", "graph loop"): ">= 0.8", ("waves graph", "graph loop"): ">= 0.8",
         ("stepwise graph", "stepwise"): ">= 3"}  # fmt: skip
GIB = 2**30


def contest(ctx: Context, section: str, B: int, names: list[str], pairs, goals: dict):
    """Run the contestants ``names`` at batch size B, interleaved, and add a row per pair of ``pairs`` (its goal from
    ``goals``, on CUDA at B = 64 and 256); returns the contestants' runs and the seconds of every run."""
    job, runs, errors = ctx.job(B), {}, {}
    for name in names:
        try:
            runs[name] = cs.CONTESTANTS[name](job)
        except Exception as err:
            traceback.print_exc()
            errors[name] = cs.error_text(err)
    rates, run_errors, seconds = cs.interleaved(runs, ctx.rounds, ctx.sync, log)
    errors.update(run_errors)
    ctx.raw[f"{section} B={B}"] = {"tokens_per_s": rates, "errors": errors, "run_seconds": seconds}
    med = {n: statistics.median(v) for n, v in rates.items() if v}
    for a, b in pairs:
        if a not in names or b not in names:
            continue
        goal = goals.get((a, b), "") if ctx.is_cuda and B in (64, 256) else ""
        if a in med and b in med:
            ratio = statistics.median(x / y for x, y in zip(rates[a], rates[b], strict=False))
            met = ratio >= float(goal.split()[-1]) if goal else None
            ctx.add(section, f"{a} / {b} (tok/s)", B, med[a], med[b], ratio, goal, met)
        else:
            why = "; ".join(f"{n}: {errors[n]}" for n in (a, b) if n in errors) or "no timed round"
            ctx.add(section, f"{a} / {b} (tok/s)", B, "error", goal=goal, note=why)
    return runs, seconds


def throughput(ctx: Context, B: int) -> None:
    """Tokens/s of the contestants at batch size B, interleaved, and the ratios of the pairs."""
    names = ["graph loop", "stepwise graph", "hand loop", "stepwise", "generate"]
    names += ["waves", "waves graph"] if B in ctx.plan["wave_sizes"] else []
    runs, seconds = contest(ctx, "throughput", B, names, PAIRS, GOALS)
    if B == ctx.plan["batch_sizes"][0] and seconds:
        ctx.run_seconds = statistics.median(seconds)
    captured = getattr(runs.get("stepwise graph"), "capture_seconds", None)
    if captured is not None:
        ctx.add("throughput", "stepwise graph: capture seconds (warm-up steps included)", B, captured)


COMPILE_PAIRS = [("stepwise compile", "graph loop"), ("stepwise compile", "stepwise graph"),
                 ("waves compile", "graph loop"), ("waves compile", "waves graph")]  # fmt: skip
COMPILE_GOALS = {("stepwise compile", "graph loop"): ">= 0.8", ("waves compile", "graph loop"): ">= 0.8"}
COMPILE_MIN_S = 120.0  # the compile section needs about this much of the budget left (a compile per contestant)


def compile_step(ctx: Context, B: int) -> None:
    """decode="compile" (torch.compile, mode="reduce-overhead") against the graph loop and decode="graph" (the step
    captured by hand), interleaved at B, and the seconds of the compiled policy's first step (the compile)."""
    left = None if ctx.deadline is None else ctx.deadline - time.perf_counter()
    if left is not None and left < COMPILE_MIN_S:
        log(f"compile skipped: {left:.0f} s left of the budget, needs ~{COMPILE_MIN_S:.0f}")
        ctx.add("compile", "skipped (time budget)", B, f"{max(left, 0):.0f} s left; run --sections compile alone")
        return
    names = ["graph loop", "stepwise graph", "stepwise compile"]
    names += ["waves graph", "waves compile"] if B in ctx.plan["wave_sizes"] else []
    runs, _ = contest(ctx, "compile", B, names, COMPILE_PAIRS, COMPILE_GOALS)
    first = getattr(runs.get("stepwise compile"), "capture_seconds", None)
    if first is not None:
        ctx.add("compile", "stepwise compile: seconds of its first step (the compile)", B, first)


def syncs(ctx: Context, B: int) -> None:
    """Synchronizing CUDA operations per env step of a hand-driven env + policy (refill steps apart)."""
    B_, steps, max_new = ctx.plan["syncs"]
    out = cs.count_syncs(ctx.job(B_, max_new), steps)
    ctx.raw["syncs"] = out
    for kind, goal in (("no_refill", "<= 1"), ("refill", "")):
        s = out[kind]
        what = f"host syncs / env step, {kind.replace('_', '-')} steps (n={s['steps']})"
        if not ctx.is_cuda:
            ctx.add("syncs", what, B_, "n/a", goal=goal, note="(CPU)")
        elif s["median"] is None:
            ctx.add("syncs", what, B_, "none", goal=goal)
        else:
            where = ", ".join(f"{site} x{n}" for site, n in out.get(f"sites_{kind}", [])[:3])
            note = f"(policy {s['median_policy']:g} + env {s['median_env']:g}; max {s['max']}; at {where or '-'})"
            ctx.add("syncs", what, B_, float(s["median"]), goal=goal,
                    met=(s["median"] <= 1) if goal else None, note=note)  # fmt: skip
    hand = out["hand_loop"]
    what = f"host syncs / step, hand loop reference ({hand['steps']} steps, prefill included)"
    if ctx.is_cuda:
        ctx.add("syncs", what, B_, hand["syncs"] / max(hand["steps"], 1), note=f"({hand['syncs']} in all)")
    else:
        ctx.add("syncs", what, B_, "n/a", note="(CPU)")


def memory(ctx: Context, B: int) -> None:
    """Peak GPU memory of one stepwise batch (env, policy and collector built fresh) against one hand-loop run."""
    job, peaks = ctx.job(B), {}
    for name in ("graph loop", "stepwise graph", "hand loop", "stepwise"):
        peaks[name] = cs.peak_memory(cs.CONTESTANTS[name], job, ctx.sync)
        ctx.free()
    ctx.raw["memory"] = peaks
    if not ctx.is_cuda:
        ctx.add("memory", "peak memory stepwise / hand loop", B, "n/a", goal="<= 1.10", note="(CPU)")
        return
    (sp, sb), (hp, hb) = peaks["stepwise"], peaks["hand loop"]
    ctx.add("memory", "peak allocated, GiB: stepwise / hand loop", B, sp / GIB, hp / GIB, sp / hp, "<= 1.10",
            sp / hp <= 1.10)  # fmt: skip
    ctx.add("memory", "peak above the weights, GiB: stepwise / hand loop", B, (sp - sb) / GIB, (hp - hb) / GIB,
            (sp - sb) / max(hp - hb, 1), "<= 1.10", (sp - sb) / max(hp - hb, 1) <= 1.10)  # fmt: skip
    (gp, gb), (lp, lb) = peaks["stepwise graph"], peaks["graph loop"]
    ratio = (gp - gb) / max(lp - lb, 1)
    ctx.add("memory", "peak above the weights, GiB: stepwise graph / graph loop", B, (gp - gb) / GIB, (lp - lb) / GIB,
            ratio, "<= 1.10", ratio <= 1.10)  # fmt: skip


def grpo(ctx: Context, B: int) -> None:
    """One GRPO iteration: collect seconds, train seconds, peak memory."""
    n_prompts, group, new_tokens = ctx.plan["grpo"]
    out = None
    try:
        out = cs.grpo_iteration(ctx.job(n_prompts * group, new_tokens), group, ctx.sync)
    except torch.OutOfMemoryError as err:  # the numbers of a shorter iteration say more than the error alone
        if new_tokens <= 64:
            raise
        traceback.print_exc()
        ctx.add("grpo", f"error ({new_tokens} new tokens)", n_prompts * group, cs.error_text(err))
    if out is None:  # retried here, not in the except block: its traceback would hold the tensors that filled memory
        ctx.free()
        new_tokens = 64
        log("grpo: out of memory; again with 64 new tokens")
        out = cs.grpo_iteration(ctx.job(n_prompts * group, new_tokens), group, ctx.sync)
    ctx.raw["grpo"] = out
    shape = f"({n_prompts} x {group}, {new_tokens} new tokens)"
    ctx.add("grpo", f"collect s {shape}", n_prompts * group, out["collect_s"], note=f"({out['tokens']} tokens)")
    ctx.add("grpo", "train s (advantage, to_padded, to device, GRPOLoss, backward, AdamW, update)", n_prompts * group,
            out["train_s"], note=f"(padded {out['padded_shape']}, loss {out['loss']:.3g}, "
            f"train(device=) {'yes' if out['train_has_device'] else 'no: moved in prepare'})")  # fmt: skip
    peak = "n/a" if out["peak_bytes"] is None else out["peak_bytes"] / GIB
    ctx.add("grpo", "peak allocated, GiB", n_prompts * group, peak)


def train_memory(ctx: Context, B: int) -> None:
    """One GRPO training step on synthetic batches: peak allocated above the weights and seconds. Where a plan row asks,
    whole logits against chunked log-probs at the same (no) micro-batches first; then the recommended settings (a token
    budget, checkpointing). Goals: [64, 288] <= 8 GiB; [64, 4128] fits in 40 GiB; chunked / whole <= 1.15."""
    for rows, new_tokens, budget, checkpointing, compare in ctx.plan["train_memory"]:
        runs = [(True, None, False), (False, None, False)] if compare else []
        if (budget, checkpointing) != (None, False) or not compare:
            runs.append((False, budget, checkpointing))  # the recommended settings, unless the pair already ran them
        whole_s = None
        for full, b, ckpt in runs:
            name = (f"{'whole logits' if full else 'chunked'}, budget {b or '-'}, checkpointing {'on' if ckpt else 'off'}"
                    f" [{rows}, {32 + new_tokens}]: s per step")  # fmt: skip
            try:
                out = cs.train_step_memory(ctx.model, ctx.device, rows, new_tokens, full_logits=full, max_tokens=b,
                                           checkpointing=ckpt, sync=ctx.sync)  # fmt: skip
            except torch.OutOfMemoryError as err:
                ctx.add("train_memory", name, rows, cs.error_text(err))
                ctx.free()
                continue
            peak = "n/a" if out["peak_above_bytes"] is None else f"{out['peak_above_bytes'] / GIB:.2f}"
            is_pair = compare and not full and b is None and whole_s is not None
            ratio = out["s"] / whole_s if is_pair else None
            ctx.add("train_memory", name, rows, out["s"], whole_s if is_pair else None, ratio,
                    "chunked / whole <= 1.15" if is_pair else "", (ratio <= 1.15) if is_pair else None,
                    note=f"(peak {peak} GiB above the weights; padded {out['shape']})")  # fmt: skip
            whole_s = out["s"] if full else whole_s
            ctx.free()


def fsdp2(ctx: Context, B: int) -> None:
    """The 1-rank FSDP2 path of train() under torch.distributed: one GRPO step with the model sharded by
    tokengym.distributed.shard_model against the same step whole (seconds, peak memory, parameters after)."""
    rows, new_tokens = ctx.plan["fsdp2"]
    out = cs.fsdp_step(ctx.model, ctx.device, rows, new_tokens, ctx.sync)
    ctx.raw["fsdp2"] = out
    shape = f"[{rows}, {32 + new_tokens}]"
    ratio = out["fsdp2_s"] / out["whole_s"]
    ctx.add("fsdp2", f"1 rank, shard_model vs whole {shape}: s per step", rows, out["fsdp2_s"], out["whole_s"], ratio,
            note=f"(padded {out['shape']}, {out['dtype']})")  # fmt: skip
    for name in ("whole", "fsdp2"):
        peak = out[f"{name}_peak_above_bytes"]
        ctx.add("fsdp2", f"{name}: peak allocated above the weights, GiB", rows, "n/a" if peak is None else peak / GIB)
    tolerance = 1e-5 if out["dtype"] == "torch.float32" else 1e-2
    ctx.add("fsdp2", "max |parameter difference| after the steps", rows, out["max_param_diff"],
            goal=f"<= {tolerance:g}", met=out["max_param_diff"] <= tolerance)  # fmt: skip


def fits_budget(ctx: Context, B: int) -> bool:
    """Whether a throughput run at B would end before the deadline (estimated from the main B's runs)."""
    if ctx.deadline is None or ctx.run_seconds is None:
        return True
    runs = (ctx.rounds + 1) * (6 if B in ctx.plan["wave_sizes"] else 5)
    need = ctx.run_seconds * runs * (1.5 if B > ctx.plan["batch_sizes"][0] else 1.0)
    left = ctx.deadline - time.perf_counter()
    if need <= left:
        return True
    log(f"throughput B={B} skipped: needs ~{need:.0f} s, {left:.0f} s left of the budget")
    ctx.add("throughput", "skipped (time budget)", B, f"needs ~{need:.0f} s, {max(left, 0):.0f} s left")
    return False


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--size", choices=sorted(SIZES), default="real")
    parser.add_argument("--out", required=True, help="folder for gpu_bench.md and gpu_bench.json")
    parser.add_argument("--quick", action="store_true", help="B=64 only and a shorter GRPO iteration")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per throughput B (>= 3 for a median)")
    parser.add_argument("--batch-sizes", default=None, help="throughput B list, the main one first (e.g. 64,8,256)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per sequence in throughput runs")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="skip the throughput runs at extra B that would end past this many seconds")  # fmt: skip
    args = parser.parse_args(argv)
    unknown = set(args.sections.split(",")) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; pick from {SECTIONS}")
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx = Context(args)
    if not ctx.is_cuda:
        torch.set_num_threads(1)
    wanted = args.sections.split(",")
    t = time.perf_counter()
    ctx.tok, ctx.model, model_text = cs.build_model(args.size, ctx.device)
    ctx.sync()
    ctx.times["build"] = time.perf_counter() - t
    ctx.header = header(ctx, model_text)
    log(f"model built in {ctx.times['build']:.1f} s: {model_text} on {ctx.header['GPU']}")
    write(ctx)
    main_b, *extra_b = ctx.plan["batch_sizes"]
    if "throughput" in wanted:
        run_section(ctx, f"throughput B={main_b}", throughput, main_b)
    sections = {"syncs": syncs, "memory": memory, "grpo": grpo, "train_memory": train_memory, "fsdp2": fsdp2}
    for name in ("syncs", "memory", "grpo", "train_memory", "fsdp2"):
        if name in wanted:
            run_section(ctx, name, sections[name], main_b)
    for B in extra_b if "throughput" in wanted else ():
        if fits_budget(ctx, B):
            run_section(ctx, f"throughput B={B}", throughput, B)
    if "compile" in wanted:  # last: its compiles take time the goals' sections come first for
        run_section(ctx, "compile", compile_step, main_b)
    md = write(ctx)
    print(md)
    log(f"done in {time.perf_counter() - T0:.1f} s; wrote {Path(args.out) / 'gpu_bench.md'} and gpu_bench.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
