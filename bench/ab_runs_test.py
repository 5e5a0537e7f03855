#!/usr/bin/python3
"""Tests of ab_runs.py against fake bench binaries (small scripts)."""

import os
import stat
import subprocess
import sys
import tempfile
import textwrap
import unittest

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                      "ab_runs.py")

# A fake attention_bench: prints a header, a "#" line and one case line per
# context in FAKE_CONTEXTS (default 1024) whose best us is FAKE_US (or, if
# FAKE_US_FILE is set, the next number of that file, consumed), and
# appends its name and its FAKE_TAG to FAKE_LOG.
FAKE = textwrap.dedent("""\
    #!{python}
    import os, sys
    log = os.environ.get("FAKE_LOG")
    if log:
        with open(log, "a") as f:
            f.write(os.path.basename(sys.argv[0]) + " " +
                    os.environ.get("FAKE_TAG", "-") + " " +
                    " ".join(sys.argv[1:]) + "\\n")
    if os.environ.get("FAKE_FAIL"):
        sys.exit(3)
    us = os.environ.get("FAKE_US", "100")
    path = os.environ.get("FAKE_US_FILE")
    if path:
        with open(path) as f:
            values = f.read().split()
        us = values[0]
        with open(path, "w") as f:
            f.write(" ".join(values[1:]))
    print("# layout vllm, a comment")
    print("dtype     context  batch  threads    us/call    best us mean GB/s")
    for ctx in os.environ.get("FAKE_CONTEXTS", "1024").split(","):
        print(f"bfloat16 {{ctx}} 16 1 {{float(us) * 1.1:.1f}} {{us}} 12.0 13.0 "
              "15.0 87% 85%")
    """)


class AbRunsTest(unittest.TestCase):

    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.log = os.path.join(self.dir.name, "log")

    def tearDown(self):
        self.dir.cleanup()

    def fake(self, name):
        path = os.path.join(self.dir.name, name)
        with open(path, "w") as f:
            f.write(FAKE.format(python=sys.executable))
        os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
        return path

    def run_script(self, *args, env=None):
        full = dict(os.environ, FAKE_LOG=self.log)
        full.update(env or {})
        return subprocess.run([sys.executable, SCRIPT, *args], env=full,
                              capture_output=True, text=True, check=False)

    def log_lines(self):
        with open(self.log) as f:
            return f.read().splitlines()

    def us_file(self, values):
        path = os.path.join(self.dir.name, "us")
        with open(path, "w") as f:
            f.write(" ".join(map(str, values)))
        return path

    def test_ratios_median_and_alternating_order(self):
        a, b = self.fake("a_bin"), self.fake("b_bin")
        # Runs in order: round 1 A, B; round 2 B, A; round 3 A, B.
        path = self.us_file([100, 90, 80, 100, 200, 220])
        p = self.run_script("--rounds=3", a, b, "--", "--context=1024",
                            env={"FAKE_US_FILE": path})
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual([l.split()[0] for l in self.log_lines()],
                         ["a_bin", "b_bin", "b_bin", "a_bin", "a_bin",
                          "b_bin"])
        # The bench args reach both binaries.
        for line in self.log_lines():
            self.assertTrue(line.endswith("--context=1024"), line)
        self.assertIn("round 1 bfloat16 1024 16 1: A 100.0 us, B 90.0 us, "
                      "B/A 0.900", p.stdout)
        self.assertIn("round 2 bfloat16 1024 16 1: A 100.0 us, B 80.0 us, "
                      "B/A 0.800", p.stdout)
        self.assertIn("bfloat16 1024 16 1: B/A median 0.900 (min 0.800, "
                      "max 1.100) over 3 rounds", p.stdout)

    def test_every_case_of_a_run(self):
        a, b = self.fake("a_bin"), self.fake("b_bin")
        p = self.run_script("--rounds=2", a, b,
                            env={"FAKE_CONTEXTS": "1024,4096"})
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertIn("bfloat16 1024 16 1: B/A median 1.000", p.stdout)
        self.assertIn("bfloat16 4096 16 1: B/A median 1.000", p.stdout)

    def test_one_binary_two_environments(self):
        a = self.fake("a_bin")
        p = self.run_script("--rounds=2", "--env_a=FAKE_TAG=x",
                            "--env_b=FAKE_TAG=y", a)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertEqual([l.split()[:2] for l in self.log_lines()],
                         [["a_bin", "x"], ["a_bin", "y"], ["a_bin", "y"],
                          ["a_bin", "x"]])

    def test_nothing_to_compare(self):
        a = self.fake("a_bin")
        p = self.run_script(a)
        self.assertEqual(p.returncode, 1)
        self.assertIn("same binary in the same environment", p.stderr)

    def test_failed_run(self):
        a, b = self.fake("a_bin"), self.fake("b_bin")
        p = self.run_script(a, b, env={"FAKE_FAIL": "1"})
        self.assertEqual(p.returncode, 1)
        self.assertIn("exited with status 3", p.stderr)

    def test_no_case_line(self):
        a, b = self.fake("a_bin"), self.fake("b_bin")
        p = self.run_script(a, b, env={"FAKE_CONTEXTS": ""})
        # An empty context list still prints a bfloat16 line, but with no
        # context its fields shift ("bfloat16 16 1 110.0 ..."), so its
        # threads field is not a whole number: no case line.
        self.assertEqual(p.returncode, 1)
        self.assertIn("printed no case line", p.stderr)

    def test_bad_env_and_rounds(self):
        a = self.fake("a_bin")
        p = self.run_script("--env_b=NOVALUE", a)
        self.assertEqual(p.returncode, 1)
        self.assertIn("expected VAR=VALUE", p.stderr)
        p = self.run_script("--rounds=0", "--env_b=X=1", a)
        self.assertEqual(p.returncode, 1)
        self.assertIn("--rounds must be 1 or more", p.stderr)


if __name__ == "__main__":
    unittest.main()
