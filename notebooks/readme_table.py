"""The README's headline results table, generated from the paper's macros.

    python notebooks/readme_table.py           # rewrite the table in README.md
    python notebooks/readme_table.py --check   # exit 1 if README.md's table is out of date
    python notebooks/readme_table.py --readme build/quick/README.md   # a copy's table instead

The numbers are the macros that the notebooks write into paper/generated/*.tex from results/,
so the README, the paper and the results cannot disagree: a number has one source. Each row
names the device it was measured on and the results file behind it. Once a GPU's RQ1 macros
exist (paper/generated/devices.tex defines \\GpuSpeedup), a GPU row for RQ1 comes first, one
for each GPU (GPU_ROWS); without them the table is the CPU rows alone. Run by `make figures`
after the notebooks; the test suite runs --check. The macros are read from
$LONGFLASH_GENERATED when it is set, as the notebooks write them (a `make reproduce QUICK=1`).
"""

import argparse
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
GENERATED = os.environ.get("LONGFLASH_GENERATED") or os.path.join(ROOT, "paper", "generated")
START, END = "<!-- headline:start -->", "<!-- headline:end -->"

NO_GPU = "; no GPU comparison yet"  # said by the CPU row of RQ1 until a GPU row exists
NO_GPU_IO = "; no GPU DRAM measurement yet"  # said by the CPU row of RQ2 until a GPU row exists

# (part, claim with {Macro} placeholders, device macro or text, results file macro)
ROWS = [
    ("RQ1 speed and memory",
     "forward+backward at 16K tokens (batch 1, causal, d = {SpeedupCpuMemHeaddimSixteenK}): "
     "{SpeedupCpuMemLongflashSixteenK} MiB above the inputs vs {SpeedupCpuMemStandardSixteenK} "
     "MiB for standard attention ({SpeedupCpuMemSavedSixteenK}x less), which exceeds the "
     "{SpeedupCpuMemBudgetMiB} MiB budget at {SpeedupCpuStandardOomFwdBwd}; time: typically "
     "{SpeedupCpuOverStandardTypical}x as fast as standard attention, "
     "{SpeedupCpuOverSdpaCpuTypical}x as fast as PyTorch's fused CPU SDPA",
     "{SpeedupCpuDevice} CPU, {SpeedupCpuThreads} thread, {SpeedupCpuDtype}, blockwise PyTorch "
     f"path{NO_GPU}",
     "{SpeedupResultsFile}"),
    ("RQ2 IO complexity",
     "HBM traffic of the forward pass {IoRatioFwd}x below standard attention ({IoRatioCausalFwd}x "
     "causal) at N = {IoSweepN}, d = {IoSweepD}, M = {IoSweepM} elements; grows as "
     "N^{IoExpNFwd}, d^{IoExpDFwd}, M^{IoExpMFwd} (bound: N^2 d^2 / M); block-sparse, "
     "{IoSparseFracEighthFwd} of the dense bytes with 1/8 of the blocks kept, linear in the "
     "fraction kept",
     f"counted in the two-level memory model, checked by a simulator{NO_GPU_IO}",
     "{IoComplexityResultsFile}"),
    ("RQ3 sequence parallelism",
     "exact causal attention (forward) over {RingLongTokensExact} tokens through a ring of "
     "{RingLongRanks} ranks in {RingLongSeconds} s, {RingLongPeakMiB} MiB per rank, max error "
     "{RingLongMaxErr}; weak-scaling FLOP efficiency {RingWeakZigzagTwo} (zigzag) at 2 ranks",
     "{RingCpu} CPU, {RingCores} cores, gloo ranks emulated on one machine",
     "{ScalingResultsFile}"),
    ("RQ4 long-context training",
     "longest trainable context of a {LctModelA} GPT under {LctBudgetA} MiB: {LctMaxLfA} tokens "
     "with LongFlash vs {LctMaxStdA} with standard attention ({LctRatioStdA}x) and {LctMaxSdpaA} "
     "with PyTorch SDPA ({LctRatioSdpaA}x); projected, not measured: a 7B model on 80 GB GPUs "
     "with activation checkpointing reaches {LctProjLfCkpt} tokens vs {LctProjStdCkpt} with "
     "materialized attention",
     "{LctCpu} CPU, one full training step (forward, backward, AdamW) per probe",
     "{LongContextTrainingResultsFile}"),
]


# Rows shown first once a GPU's macros exist; "<G>" is the GPU's macro prefix (\GpuSpeedup in
# paper/generated/devices.tex: HOneZeroZero for h100). Kept out of ROWS on purpose:
# run_notebooks.write_not_measured stubs every macro of ROWS that no notebook defined with "not
# measured", which would make a CPU-only tree show an empty GPU row. RQ1's row needs its
# macros (a missing one is an error); the others (GPU_MORE_ROWS) appear where their RQ's GPU
# notebook wrote every macro they name (a partial campaign: no row), after RQ1's.
GPU_ROWS = [
    ("RQ1 speed on a GPU",
     "worst case at d = {Speedup<G>GoalHeaddim}, {Speedup<G>GoalTokensPerBatch} tokens per batch, "
     "N from {Speedup<G>GoalSeqlenMin}, non-causal: forward {Speedup<G>GoalFwdFlashValue} the "
     "speed of FlashAttention-2 ({Speedup<G>GoalFwdFlashWhere}; goal "
     "{Speedup<G>GoalFwdFlashTarget}: {Speedup<G>GoalFwdFlashVerdict}), forward+backward "
     "{Speedup<G>GoalFwdBwdFlashValue} ({Speedup<G>GoalFwdBwdFlashWhere}; goal "
     "{Speedup<G>GoalFwdBwdFlashTarget}: {Speedup<G>GoalFwdBwdFlashVerdict}); "
     "{Speedup<G>GoalsMet} of {Speedup<G>GoalsCount} kernel goals met, "
     "{Speedup<G>GoalsNotMeasured} not measured",
     "{Speedup<G>Device}, {Speedup<G>Dtype}, Triton kernels against SDPA's backends in the same "
     "run",
     "{<G>SpeedupResultsFile}"),
]
# (the devices.tex macro naming the RQ's GPU prefix, part, claim, where/how, results file)
GPU_MORE_ROWS = [
    ("GpuIoComplexity", "RQ2 HBM bytes on a GPU",
     "forward DRAM bytes over the model's: {<G>IoNcuRatios}; L2 bytes over the model's: "
     "{<G>IoNcuLtsRatios}; goal (DRAM within {<G>IoNcuGoalTolerance} of the model beyond L2): "
     "{<G>IoNcuGoal}",
     "{<G>IoNcuDevice}, Nsight Compute, {<G>IoNcuSetting}",
     "{<G>IoComplexityResultsFile}"),
    ("GpuScaling", "RQ3 1M tokens on one GPU",
     "exact causal attention (forward and backward) over {<G>RingOneGpuTokens} tokens in "
     "{<G>RingOneGpuTime} ({<G>RingOneGpuTflops}), peak {<G>RingOneGpuPeak}, the forward's max error on "
     "sampled rows {<G>RingOneGpuMaxErr} (bound {<G>RingOneGpuErrBound}); goal: "
     "{<G>RingOneGpuGoal}",
     "{<G>RingOneGpuDevice}, {<G>RingOneGpuSetup}; no multi-GPU ring measured",
     "{<G>ScalingResultsFile}"),
    ("GpuLongContextTraining", "RQ4 long-context training on a GPU",
     "longest trainable context of a {<G>LctModelB} GPT under {<G>LctBudgetB}: {<G>LctMaxLfB} "
     "tokens with LongFlash vs {<G>LctMaxStdB} with standard attention and {<G>LctMaxSdpaB} with "
     "SDPA's FlashAttention-2",
     "{<G>LctDevice}, {<G>LctDtype}, one full training step per probe",
     "{<G>LongContextTrainingResultsFile}"),
]


def gpu_rows(macros):
    """GPU_ROWS once for each GPU with RQ1 macros (\\GpuSpeedupAll, the first GPU's first), then
    GPU_MORE_ROWS; [] when no GPU's RQ1 macros exist."""
    gpus = macros.get("GpuSpeedupAll", macros.get("GpuSpeedup", "")).split(",")
    gpus = [gpu for gpu in gpus if gpu and f"Speedup{gpu}Device" in macros]
    rows = [tuple(cell.replace("<G>", gpu) for cell in row) for gpu in gpus for row in GPU_ROWS]
    if not rows:
        return []
    for prefix_macro, *row in GPU_MORE_ROWS:
        prefix = macros.get(prefix_macro)
        row = tuple(cell.replace("<G>", prefix or "") for cell in row)
        names = {n for cell in row for n in re.findall(r"\{(\w+)\}", cell)}
        if prefix and names <= set(macros):
            rows.append(row)
    return rows


def read_macros(paths):
    """{name: value} of every \\newcommand{\\Name}{value} in the given files."""
    macros = {}
    pattern = re.compile(r"\\newcommand\{\\(\w+)\}\{(.*)\}\s*$")
    for path in paths:
        with open(path) as f:
            for line in f:
                m = pattern.match(line.strip())
                if m:
                    macros[m.group(1)] = m.group(2)
    return macros


def latex_to_text(value):
    """The plain-text form of a macro's value: 2{,}048 -> 2,048; 101\\% -> 101%;
    3.3\\times 10^{-8} -> 3.3e-08 style; 2^{16} -> 2^16."""
    value = value.replace("{,}", ",").replace("\\%", "%").replace("\\,", " ")
    value = re.sub(r"\\([&#_])", r"\1", value)  # escaped characters: io\_complexity
    value = re.sub(r"\s*\\times\s*10\^\{(-?)(\d+)\}", lambda m: f"e{m.group(1) or '+'}"
                   f"{int(m.group(2)):02d}", value)
    value = re.sub(r"\^\{([^}]*)\}", r"^\1", value)
    value = value.replace("\\times", "x").replace("\\geq", ">=")
    return value.replace("$", "").strip()


def fill(template, macros):
    def sub(m):
        name = m.group(1)
        if name not in macros:
            raise KeyError(f"macro \\{name} is not defined in paper/generated/*.tex: rerun "
                           f"`make figures`")
        return latex_to_text(macros[name])
    return re.sub(r"\{(\w+)\}", sub, template)


def table(macros):
    lines = ["| part | headline (measured unless marked) | where, how | results |",
             "| --- | --- | --- | --- |"]
    gpu = gpu_rows(macros)
    for part, claim, device, source in gpu + ROWS:
        if gpu and part.startswith("RQ1"):  # the GPU row above is the GPU comparison
            device = device.replace(NO_GPU, "")
        if part.startswith("RQ2") and any(g[0].startswith("RQ2") for g in gpu):
            device = device.replace(NO_GPU_IO, "")
        lines.append(f"| {part} | {fill(claim, macros)} | {fill(device, macros)} | "
                     f"`{fill(source, macros)}` |")
    return "\n".join(lines)


def updated_readme(text, macros):
    if START not in text or END not in text:
        raise ValueError(f"README.md has no {START} ... {END} block")
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{START}\n{table(macros)}\n{END}{tail}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="do not write; exit 1 if README.md is out of date")
    parser.add_argument("--readme", default=README, help="the README to update (default: %(default)s)")
    args = parser.parse_args()
    macros = read_macros(sorted(glob.glob(os.path.join(GENERATED, "*.tex"))))
    with open(args.readme) as f:
        text = f.read()
    new = updated_readme(text, macros)
    if args.check:
        if new != text:
            print(f"{args.readme}'s headline table is out of date: run "
                  "`python notebooks/readme_table.py` (or `make figures`)", file=sys.stderr)
            return 1
        return 0
    if new != text:
        sys.path.insert(0, ROOT)
        from experiments.results import atomic_write
        def write(path):
            with open(path, "w") as f:
                f.write(new)
        atomic_write(args.readme, write)
    print(table(macros))
    return 0


if __name__ == "__main__":
    sys.exit(main())
