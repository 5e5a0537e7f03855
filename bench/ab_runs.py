#!/usr/bin/python3
"""Times two attention_bench builds (or one build in two environments)
against each other, run by run, as docs/attention.md's "separate runs
alternated" figures are measured.

    bench/ab_runs.py [--rounds=5] [--env_a=VAR=VALUE ...]
        [--env_b=VAR=VALUE ...] A_BIN [B_BIN] [-- bench args ...]

Each round runs A and B once each with the same bench args, A first in odd
rounds and B first in even ones, so that a drift of this shared VM's speed
over a round does not favour either. From each run it takes every case
line (dtype, context, batch, threads, ..., "best us" in the sixth column:
the decode and the prefill tables alike) and prints, per case, each
round's best us of A and of B and their ratio B/A, then the median, min
and max of those ratios: below 1, B took less time. Medians, since a
neighbour's burst on this VM moves single runs by 10-20% (two builds
that behave the same have read 0.80x in a 3-round median). Without
B_BIN, B is A_BIN run under --env_b (which must then be given): a
throwaway knob read from the environment compares two variants of one
build. --vs runs (their own A/B, call by call) are not case lines and are
not read.

Exits with status 1, having printed what it has, if a run fails or prints
no case line, or if A and B print different cases.
"""

import argparse
import os
import statistics
import subprocess
import sys

# Case lines recognised as grid_table.py (beside this script) recognises them.
from grid_table import case_key


def cases(text):
    """Returns {(dtype, context, batch, threads): best us} of a run's output."""
    out = {}
    for line in text.splitlines():
        fields = line.split()
        key = case_key(fields) if len(fields) >= 6 else None
        if key is None:
            continue
        try:
            best = float(fields[5])
        except ValueError:
            continue
        out[key] = best
    return out


def env_pairs(items, flag):
    env = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            sys.exit(f"{flag}={item}: expected VAR=VALUE")
        env[name] = value
    return env


def run(binary, args, extra_env):
    env = dict(os.environ)
    env.update(extra_env)
    try:
        p = subprocess.run([binary, *args], capture_output=True, text=True,
                           env=env, check=False)
    except OSError as e:
        sys.exit(f"{binary}: {e.strerror}")
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        sys.exit(f"{binary} exited with status {p.returncode}")
    found = cases(p.stdout)
    if not found:
        sys.exit(f"{binary} printed no case line")
    return found


def main():
    argv = sys.argv[1:]
    bench_args = []
    if "--" in argv:
        k = argv.index("--")
        argv, bench_args = argv[:k], argv[k + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a_bin")
    parser.add_argument("b_bin", nargs="?")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--env_a", action="append", default=[])
    parser.add_argument("--env_b", action="append", default=[])
    opts = parser.parse_args(argv)
    if opts.rounds < 1:
        sys.exit("--rounds must be 1 or more")
    env_a = env_pairs(opts.env_a, "--env_a")
    env_b = env_pairs(opts.env_b, "--env_b")
    b_bin = opts.b_bin or opts.a_bin
    if b_bin == opts.a_bin and env_a == env_b:
        sys.exit("A and B are the same binary in the same environment: "
                 "give B_BIN or --env_b")

    ratios = {}
    for rnd in range(1, opts.rounds + 1):
        order = [("A", opts.a_bin, env_a), ("B", b_bin, env_b)]
        if rnd % 2 == 0:
            order.reverse()
        got = {name: run(binary, bench_args, env)
               for name, binary, env in order}
        if got["A"].keys() != got["B"].keys():
            sys.exit(f"round {rnd}: A and B printed different cases")
        for key in sorted(got["A"]):
            a, b = got["A"][key], got["B"][key]
            ratios.setdefault(key, []).append(b / a)
            print(f"round {rnd} {' '.join(map(str, key))}: A {a:.1f} us, "
                  f"B {b:.1f} us, B/A {b / a:.3f}")
    for key, rs in sorted(ratios.items()):
        print(f"{' '.join(map(str, key))}: B/A median "
              f"{statistics.median(rs):.3f} (min {min(rs):.3f}, "
              f"max {max(rs):.3f}) over {len(rs)} rounds")


if __name__ == "__main__":
    main()
