#!/usr/bin/python3
"""Tests of grid_table.py: one run's table, and the medians of several."""

import os
import subprocess
import sys
import tempfile
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "grid_table.py")
HEADER = ("dtype     context  batch  threads    us/call    best us mean GB/s "
          "best GB/s read GB/s  of read median of\n")


def row(dtype, ctx, batch, threads, of, median, read):
    # Only the fields grid_table.py reads need be consistent.
    return (f"{dtype} {ctx} {batch} {threads} 100.0 90.0 10.00 11.00 "
            f"{read:.2f} {of}% {median}%\n")


class GridTableTest(unittest.TestCase):

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.dir.cleanup()

    def write(self, name, rows, cpu=None, build=None):
        path = os.path.join(self.dir.name, name)
        with open(path, "w") as f:
            if cpu is not None:
                f.write(f"cpu: {cpu}\n")
            if build is not None:
                f.write(f"build: {build}\n")
            f.write("# a comment line\n" + HEADER + "".join(rows))
        return path

    def run_script(self, *args):
        return subprocess.run([sys.executable, SCRIPT, *args],
                              capture_output=True, text=True, check=False)

    def run_table(self, *args):
        done = self.run_script(*args)
        self.assertEqual(done.returncode, 0, done.stderr)
        return done.stdout

    def cell(self, out, label, batch, column):
        # The Markdown row "| label | batch | c1 | c2 |"'s column-th cell.
        for line in out.splitlines():
            parts = [p.strip() for p in line.strip().strip("|").split("|")]
            if len(parts) > 2 and parts[0] == label and parts[1] == str(batch):
                return parts[2 + column]
        self.fail(f"no row {label} batch {batch} in:\n{out}")

    def test_one_run(self):
        path = self.write("a.txt", [
            row("bfloat16", 512, 16, 1, 50, 50, 15.0),  # under min_context
            row("bfloat16", 1024, 1, 1, 85, 80, 15.0),
            row("bfloat16", 1024, 16, 1, 78, 77, 15.0),
            row("bfloat16", 2048, 16, 1, 82, 81, 16.0),
            row("bfloat16", 2048, 16, 2, 90, 88, 30.0),
        ])
        out = self.run_table(path)
        self.assertNotIn("512", out)
        self.assertNotIn("Medians", out)
        self.assertEqual(self.cell(out, "bf16, 1", 16, 0), "78% / 77%")
        self.assertEqual(self.cell(out, "bf16, 2", 16, 1), "90% / 88% (30)")
        self.assertIn("1 thread: batch 1 85% (0 of 1 under 80%); "
                      "batches 16+ 78-82% (1 of 2 under 80%)", out)

    def test_medians_of_runs(self):
        # fp16 4096 x 16 is disturbed in run b (its read under half the
        # run's median read), so its medians are of runs a and c alone
        # (81 and 80: 80.5, rounded half up to 81; 84 and 79: 82).
        runs = {
            "a": [(81, 80, 15.0), (79, 78, 15.0), (81, 84, 15.0)],
            "b": [(70, 60, 15.0), (83, 82, 15.0), (40, 41, 6.0)],
            "c": [(85, 84, 15.0), (81, 80, 15.0), (80, 79, 15.0)],
        }
        paths = []
        for name, cells in runs.items():
            paths.append(self.write(name + ".txt", [
                row("float16", 1024, 16, 1, *cells[0]),
                row("float16", 2048, 16, 1, *cells[1]),
                row("float16", 4096, 16, 1, *cells[2]),
                row("float16", 1024, 64, 1, 90, 90, 15.0),
            ]))
        out = self.run_table(*paths)
        self.assertIn("Medians of 3 runs", out)
        self.assertEqual(self.cell(out, "fp16, 1", 16, 0), "81% / 80% [70-85]")
        self.assertEqual(self.cell(out, "fp16, 1", 16, 1), "81% / 80% [79-83]")
        self.assertEqual(self.cell(out, "fp16, 1", 16, 2), "81% / 82% [80-81]")
        self.assertEqual(self.cell(out, "fp16, 1", 64, 0), "90% / 90%")
        self.assertIn("batches 16+ 81-90% (0 of 4 under 80%)", out)

    def test_read_trend(self):
        # fp16 1024 x 16 and 2048 x 16 move 2 points of "of read" a GB/s
        # of read from run to run, at levels of their own. Batch 1, whose
        # figures jump, is not counted; nor are 4096 x 16's run 1 and
        # 8192 x 16's runs 1 and 2 (reads under half their run's median:
        # disturbed), which leaves 8192 x 16 one run and so no pairs, and
        # 4096 x 16 two pairs at the same read, 60% and 61%. So dx is
        # -1 0 1 -1 0 1 0 0 and dy -2 0 2 -2 0 2 -0.5 0.5: slope 8 / 4,
        # correlation 8 / sqrt(4 * 16.5) = 0.985. The eight reads' lower
        # quartile is 15.0: below it only the pair at 14 (78%); the rest's
        # median is that of 60 61 80 82 84 86 88.
        runs = [
            [(78, 14.0), (84, 15.0), (50, 15.0), (60, 15.0), (70, 15.0)],
            [(80, 15.0), (86, 16.0), (99, 15.0), (40, 5.0), (71, 5.0)],
            [(82, 16.0), (88, 17.0), (70, 15.0), (61, 15.0), (72, 5.0)],
        ]
        paths = []
        for i, (a, b, one, c, d) in enumerate(runs):
            paths.append(self.write(f"{i}.txt", [
                row("float16", 1024, 16, 1, a[0], a[0], a[1]),
                row("float16", 2048, 16, 1, b[0], b[0], b[1]),
                row("float16", 1024, 1, 1, one[0], one[0], one[1]),
                row("float16", 4096, 16, 1, c[0], c[0], c[1]),
                row("float16", 8192, 16, 1, d[0], d[0], d[1]),
            ]))
        out = self.run_table(*paths)
        self.assertIn(
            "1 thread, batches 16+, run by run (8 pairs): \"of read\" "
            "against the read, each less its cell's mean: correlation 0.98, "
            "2.0 points a GB/s; median \"of read\" 78% where the read was "
            "in its lowest quarter (under 15.0 GB/s), 82% in the rest", out)
        one = self.run_table(paths[0])
        self.assertNotIn("run by run", one)

    def test_cell_disturbed_in_every_run(self):
        paths = [
            self.write(f"{i}.txt", [
                row("float32", 1024, 16, 1, 82, 82, 15.0),
                row("float32", 2048, 16, 1, 82, 82, 15.0),
                row("float32", 4096, 16, 1, 30, 30, 5.0),
            ]) for i in range(2)
        ]
        out = self.run_table(*paths)
        self.assertEqual(self.cell(out, "fp32, 1", 16, 2), "30% / 30% *")
        self.assertIn("batches 16+ 82% (0 of 2 under 80%; 1 disturbed, left out)",
                      out)

    def test_cpus(self):
        rows = [row("bfloat16", 1024, 16, 1, 80, 80, 40.0)]
        zen = "AMD EPYC (AuthenticAMD family 26 model 2), 2 CPUs"
        xeon = "Intel Xeon (GenuineIntel family 6 model 207), 2 CPUs"
        a = self.write("a.txt", rows, zen)
        b = self.write("b.txt", rows, zen)
        old = self.write("old.txt", rows)  # from before the cpu line
        other = self.write("x.txt", rows, xeon)
        self.assertTrue(self.run_table(a).startswith(f"CPU: {zen}\n"))
        self.assertTrue(self.run_table(a, b).startswith(f"CPU: {zen}\n"))
        self.assertIn(f"CPU: {zen} (not recorded in 1 of 2 runs)",
                      self.run_table(a, old))
        self.assertNotIn("CPU", self.run_table(old))
        done = self.run_script(a, other)
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("runs of different CPUs", done.stderr)
        self.assertIn(xeon, done.stderr)
        self.assertIn(f"CPUs: {zen}; {xeon}",
                      self.run_table(a, other, "--mixed_cpus"))

    def test_builds(self):
        rows = [row("bfloat16", 1024, 16, 1, 80, 80, 40.0)]
        zen = "AMD EPYC (AuthenticAMD family 26 model 2), 2 CPUs"
        a = self.write("a.txt", rows, zen, "clang 14.0.6")
        b = self.write("b.txt", rows, zen, "clang 14.0.6")
        old = self.write("old.txt", rows, zen)  # from before the build line
        gcc = self.write("g.txt", rows, zen, "gcc 12.2.0")
        self.assertTrue(self.run_table(a, b).startswith(
            f"CPU: {zen}\nBuild: clang 14.0.6\n\n"))
        self.assertIn("Build: clang 14.0.6 (not recorded in 1 of 2 runs)",
                      self.run_table(a, old))
        self.assertNotIn("Build", self.run_table(old))
        done = self.run_script(a, gcc)
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("runs of different builds", done.stderr)
        self.assertIn("gcc 12.2.0", done.stderr)
        # --mixed_cpus does not pool two builds; --mixed_builds does.
        self.assertNotEqual(self.run_script(a, gcc, "--mixed_cpus").returncode,
                            0)
        self.assertIn("Builds: clang 14.0.6; gcc 12.2.0",
                      self.run_table(a, gcc, "--mixed_builds"))

    def test_no_rows(self):
        path = self.write("empty.txt", [])
        done = self.run_script(path)
        self.assertNotEqual(done.returncode, 0)
        self.assertIn("no grid rows", done.stderr)


if __name__ == "__main__":
    unittest.main()
