#!/usr/bin/python3
"""Summarises an attention_bench grid as docs/attention.md records it.

    build/bench/attention_bench --full --max_gb=9 > grid.txt
    bench/grid_table.py grid.txt [grid2.txt ...] [--min_context=1024]
        [--goal=80]

Prints a Markdown table of the goal's cells (contexts from --min_context,
every dtype, batch and thread count in the file): "of read" / "median of",
and for two threads the case's two-thread read in GB/s in brackets. Then,
per thread count, the range of batch 1 and of batches 16 and more, and how
many cells are under --goal percent.

Given several runs of the grid (each its own same-run baseline), each cell
is the median over the runs of each figure, with the range of "of read"
in square brackets, and the ranges and counts are of those medians. This
VM moves a cell by up to 10 points from run to run, mostly down (a
neighbour's burst during the case's calls but not its reads), so one run
cannot tell a cell that is under the goal from one that was disturbed;
the median of three or more runs can. Medians of an even count of runs
are rounded half up.

Given several runs, it also prints, per thread count, how the cells'
"of read" at batches 16+ moves with their read from run to run (each
less its cell's mean over the runs): the correlation and slope, and the
median "of read" of the (cell, run) pairs whose read was in the lowest
quarter against the rest's. On this VM a neighbour that loads the
memory slows the one-thread kernel more than the read (session 58).

The bench's first line names the CPU ("cpu: ..."), its second the
compiler ("build: ..."); the table starts with them. Runs of different
CPUs are not pooled (their figures differ by far: sessions 47-60 ran on
Intel Xeons, 61 on an AMD Zen 5) unless --mixed_cpus says so, nor runs
of different builds (GCC's kernel takes 0.97-1.12x clang's time, session
66) unless --mixed_builds does; a file from before the bench printed its
CPU or build counts as not recorded and pools with any.

A case whose best read pass is under half the median read of its thread
count (in its own run) was disturbed (a neighbour on this shared VM held
the core for the whole case): the read and the calls are both slow, so its
figure says nothing of the kernel. Such a run of a cell is left out of the
cell's medians; a cell disturbed in every run is marked `*` and left out
of the ranges and counts, which say how many were left out.
"""

import argparse
import statistics
import sys

DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32",
          "fp8_e4m3": "fp8 e4m3", "fp8_e5m2": "fp8 e5m2"}


def case_key(fields):
    """(dtype, context, batch, threads) of a bench case line's fields (the
    decode and the prefill tables alike), or None if they are not one."""
    if len(fields) < 4 or fields[0] not in DTYPES:
        return None
    if not all(f.isdigit() for f in fields[1:4]):
        return None
    return fields[0], int(fields[1]), int(fields[2]), int(fields[3])


# What the bench's first lines name, runs of two of which are not pooled:
# (kind, the line's prefix, the heading's label, the flag that pools them).
SETUP = (("CPU", "cpu: ", "CPU", "--mixed_cpus"),
         ("build", "build: ", "Build", "--mixed_builds"))


def parse(path, min_context):
    """Returns ({(dtype, threads, batch, context): (of, median, read)},
    {kind: what the bench named} for the SETUP kinds it named)."""
    cells = {}
    setup = {}
    try:
        f = open(path)
    except OSError as e:
        sys.exit(f"{path}: {e.strerror}")
    with f:
        for line in f:
            head = next(((k, p) for k, p, _, _ in SETUP
                         if line.startswith(p) and k not in setup), None)
            if head is not None:
                setup[head[0]] = line[len(head[1]):].strip()
                continue
            fields = line.split()
            # dtype context batch threads us/call best mean best read of median
            key = case_key(fields) if len(fields) >= 11 else None
            if key is None:
                continue
            _, ctx, batch, threads = key
            if ctx < min_context:
                continue
            try:
                of = int(fields[9].rstrip("%"))
                median = int(fields[10].rstrip("%"))
                read = float(fields[8])
            except ValueError:
                continue
            cells[(fields[0], threads, batch, ctx)] = (of, median, read)
    return cells, setup


def half_up(x):
    """x (a percentage, not negative) to the nearest int, .5 up."""
    return int(x + 0.5)


def disturbed_sets(runs):
    """Per run, the set of its keys that were disturbed (a best read pass
    under half the median read of its thread count in that run)."""
    disturbed_in = []
    for cells in runs:
        median_read = {}
        for t in {k[1] for k in cells}:
            median_read[t] = statistics.median(
                v[2] for k, v in cells.items() if k[1] == t)
        disturbed_in.append(
            {k for k, v in cells.items() if v[2] < 0.5 * median_read[k[1]]})
    return disturbed_in


def combine(runs, disturbed_in):
    """Returns {key: (of, median, read, (lo, hi) or None)} over the runs,
    given disturbed_sets(runs).

    Each figure is the median over the runs in which the cell was not
    disturbed (see the module's doc); (lo, hi) is the range of "of read"
    over them when there are several runs, and None marks a cell disturbed
    in every run (its figures are then the first run's).
    """
    out = {}
    for key in sorted({k for cells in runs for k in cells}):
        kept = [cells[key] for cells, bad in zip(runs, disturbed_in)
                if key in cells and key not in bad]
        if not kept:
            first = next(cells[key] for cells in runs if key in cells)
            out[key] = (*first, None)
            continue
        ofs = [v[0] for v in kept]
        out[key] = (half_up(statistics.median(ofs)),
                    half_up(statistics.median(v[1] for v in kept)),
                    statistics.median(v[2] for v in kept),
                    (min(ofs), max(ofs)))
    return out


def read_trend(runs, disturbed_in, threads):
    """How a run's "of read" moves with its read, for the cells of
    `threads` threads at batches 16 and more that were undisturbed
    (disturbed_sets(runs)) in two runs or more.

    Returns None if there are fewer than two such (cell, run) pairs, else
    (pairs, correlation, slope, split, above, below): the correlation and
    least-squares slope (points a GB/s) of each pair's "of read" less its
    cell's mean over the runs against its read less the cell's mean read
    (None where either does not vary), so that the cells' own levels do
    not count; and the median "of read" of the pairs whose read is at or
    above `split`, the lower quartile of all pairs' reads, and of those
    under it, the lowest quarter (None if there are none). A neighbour
    that loads the memory during a case lowers its read and, if the
    kernel suffers more than the read, its "of read" too
    (docs/attention.md, session 58).
    """
    by_cell = {}
    for cells, bad in zip(runs, disturbed_in):
        for k, v in cells.items():
            if k[1] == threads and k[2] >= 16 and k not in bad:
                by_cell.setdefault(k, []).append((v[2], v[0]))
    kept = [v for v in by_cell.values() if len(v) >= 2]
    pairs = [p for v in kept for p in v]
    if len(pairs) < 2:
        return None
    dx, dy = [], []
    for v in kept:
        mx = statistics.fmean(p[0] for p in v)
        my = statistics.fmean(p[1] for p in v)
        dx += [p[0] - mx for p in v]
        dy += [p[1] - my for p in v]
    sxx = sum(x * x for x in dx)
    syy = sum(y * y for y in dy)
    sxy = sum(x * y for x, y in zip(dx, dy))
    corr = sxy / (sxx * syy) ** 0.5 if sxx > 0 and syy > 0 else None
    slope = sxy / sxx if sxx > 0 else None
    split = statistics.quantiles((p[0] for p in pairs), n=4)[0]
    hi = [p[1] for p in pairs if p[0] >= split]
    lo = [p[1] for p in pairs if p[0] < split]
    return (len(pairs), corr, slope, split, statistics.median(hi),
            statistics.median(lo) if lo else None)


def threads_label(t):
    """"1 thread", "2 threads": the summary lines' thread counts."""
    return f"{t} thread{'s' if t > 1 else ''}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("grid", nargs="+", help="attention_bench output(s)")
    ap.add_argument("--min_context", type=int, default=1024)
    ap.add_argument("--goal", type=int, default=80)
    ap.add_argument("--mixed_cpus", action="store_true",
                    help="pool runs whose bench named different CPUs")
    ap.add_argument("--mixed_builds", action="store_true",
                    help="pool runs whose bench named different compilers")
    args = ap.parse_args()

    runs = []
    named = {kind: {} for kind, _, _, _ in SETUP}  # value -> files naming it
    for path in args.grid:
        cells, setup = parse(path, args.min_context)
        if not cells:
            sys.exit(f"{path}: no grid rows from context {args.min_context}")
        runs.append(cells)
        for kind, value in setup.items():
            named[kind].setdefault(value, []).append(path)
    heading = []
    for kind, _, label, flag in SETUP:
        values = named[kind]
        if len(values) > 1 and not getattr(args, flag[2:]):
            which = "; ".join(f"{v}: {', '.join(p)}" for v, p in values.items())
            sys.exit(f"runs of different {kind}s ({which}); {flag} pools "
                     "them anyway")
        if not values:
            continue
        text = label + ("s: " if len(values) > 1 else ": ") + "; ".join(values)
        unrecorded = len(runs) - sum(len(p) for p in values.values())
        if unrecorded:
            text += f" (not recorded in {unrecorded} of {len(runs)} runs)"
        heading.append(text)
    if heading:
        print("\n".join(heading))
        print()
    disturbed_in = disturbed_sets(runs)
    cells = combine(runs, disturbed_in)
    several = len(runs) > 1
    dtypes = [d for d in DTYPES if any(k[0] == d for k in cells)]
    threads = sorted({k[1] for k in cells})
    batches = sorted({k[2] for k in cells})
    contexts = sorted({k[3] for k in cells})

    def disturbed(key):
        return cells[key][3] is None

    heads = " | ".join(f"{c // 1024}k" if c % 1024 == 0 else str(c)
                       for c in contexts)
    if several:
        print(f"Medians of {len(runs)} runs; [the range of \"of read\"]")
        print()
    print(f"| cache, threads | batch | {heads} |")
    print("| --- | --- | " + " | ".join("---" for _ in contexts) + " |")
    for d in dtypes:
        for t in threads:
            for b in batches:
                row = []
                for c in contexts:
                    key = (d, t, b, c)
                    if key not in cells:
                        row.append("-")
                        continue
                    of, median, read, span = cells[key]
                    text = f"{of}% / {median}%"
                    if several and span is not None and span[0] != span[1]:
                        text += f" [{span[0]}-{span[1]}]"
                    if t > 1:
                        text += f" ({read:.0f})"
                    if disturbed(key):
                        text += " *"
                    row.append(text)
                if any(r != "-" for r in row):
                    print(f"| {DTYPES[d]}, {t} | {b} | " + " | ".join(row) + " |")
    print()
    for t in threads:
        reads = [v[2] for k, v in cells.items() if k[1] == t and not disturbed(k)]
        parts = []
        for name, pick in (("batch 1", lambda b: b == 1),
                           ("batches 16+", lambda b: b >= 16)):
            keys = [k for k in cells if k[1] == t and pick(k[2])]
            kept = [k for k in keys if not disturbed(k)]
            if not kept:
                continue
            ofs = [cells[k][0] for k in kept]
            under = sum(o < args.goal for o in ofs)
            span = (f"{min(ofs)}%" if min(ofs) == max(ofs)
                    else f"{min(ofs)}-{max(ofs)}%")
            text = (f"{name} {span} "
                    f"({under} of {len(kept)} under {args.goal}%")
            if len(kept) < len(keys):
                text += f"; {len(keys) - len(kept)} disturbed, left out"
            parts.append(text + ")")
        read = (f"{min(reads):.0f}" if round(min(reads)) == round(max(reads))
                else f"{min(reads):.0f}-{max(reads):.0f}")
        print(f"{threads_label(t)}: " + "; ".join(parts) +
              f"; read {read} GB/s")
    if not several:
        return
    print()
    for t in threads:
        trend = read_trend(runs, disturbed_in, t)
        if trend is None:
            continue
        n, corr, slope, split, above, below = trend
        text = (f"{threads_label(t)}, batches 16+, run by run "
                f"({n} pairs): \"of read\" against the read, each less its "
                f"cell's mean: ")
        text += ("no spread" if corr is None else
                 f"correlation {corr:.2f}, {slope:.1f} points a GB/s")
        text += "; median \"of read\" "
        if below is not None:
            text += (f"{half_up(below)}% where the read was in its lowest "
                     f"quarter (under {split:.1f} GB/s), ")
        text += f"{half_up(above)}% in the rest"
        print(text)


if __name__ == "__main__":
    main()
