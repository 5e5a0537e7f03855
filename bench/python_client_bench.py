#!/usr/bin/python3
"""What the Python client (python/kvstep) costs a call, against the raw
generated stub's GetServerInfo in the same run: p50 and p90 of alternated
rounds (this machine is shared and noisy).

    PYTHONPATH=build/python /usr/bin/python3 bench/python_client_bench.py \
        [--server=build/kvstep-server] [--rounds=2000] [--rows=64]

It starts its own server (fp16 cache, 8 KV heads x 128, 32 query heads) on
a unix socket and times:
  stub ping            GetServerInfo through the generated stub;
  client ping          the same through kvstep.Client (metadata, the
                       instance id noted);
  stub attention       PagedAttention through the stub, its request built
                       once, for --rows one-token rows (each attends to its
                       own token: the call's cost, not the kernel's);
  client attention     Client.paged_attention for the same: numpy query, key
                       and value (float16) to the request, the output back
                       as a numpy array;
  client attention, shm  the same with shm=: the arrays copied into a
                       registered kvstep.SharedMemory and the output copied
                       out of it, nothing but the tensors' places in the
                       messages;
in a random order each round; then, alternated with a stub ping:
  client advance step  Client.advance_step for the --rows rows (a numpy
                       int64 array in, no tensors back).
Each ratio is to the stub call it is paired with.
"""

import argparse
import os
import shutil
import subprocess
import tempfile
import time

import numpy as np

import kvstep
from kvstep import pb


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", default="build/kvstep-server")
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=64)
    args = ap.parse_args()

    d = tempfile.mkdtemp(prefix="kvstep-pybench-")
    target = "unix:" + os.path.join(d, "s.sock")
    server = subprocess.Popen(
        [args.server, "--listen=" + target, "--num_blocks=4096",
         "--num_layers=1", "--cache_dtype=float16", "--log_level=warning"])
    try:
        c = kvstep.Client(target)
        for _ in range(100):
            try:
                c.wait_for_ready(timeout=0.5)
                break
            except Exception:
                pass
        rows = args.rows
        ids = list(range(1, rows + 1))
        c.allocate_blocks([(i, 512) for i in ids])
        batch = c.create_batch([dict(seq_id=i, token_ids=[1]) for i in ids])
        rng = np.random.default_rng(1)
        q = rng.standard_normal((rows, 32, 128)).astype(np.float16)
        kv = rng.standard_normal((rows, 8, 128)).astype(np.float16)
        # The batch's rows stay one-token prefills while attention is timed:
        # each row attends to its one token, so that the time is the call's
        # and the client's, not the kernel's.
        req = pb.PagedAttentionRequest(
            batch_id=batch.batch_id, layer=0, query=kvstep.to_tensor(q),
            key=kvstep.to_tensor(kv), value=kvstep.to_tensor(kv))
        shm = kvstep.SharedMemory(4 << 20)
        c.register_shared_memory(shm)
        calls = {
            "stub ping": lambda: c.stub.GetServerInfo(
                pb.GetServerInfoRequest(), timeout=10),
            "client ping": c.server_info,
            "stub attention": lambda: c.stub.PagedAttention(req, timeout=10),
            "client attention": lambda: c.paged_attention(
                0, q, kv, kv, batch_id=batch.batch_id),
            "client attention, shm": lambda: c.paged_attention(
                0, q, kv, kv, batch_id=batch.batch_id, shm=shm),
        }
        times = {k: [] for k in calls}
        names = list(calls)
        order_rng = np.random.default_rng(2)
        for r in range(args.rounds):
            # A new order each round: a rotation would keep each call after
            # the same one (an attention call's big messages leave the next
            # call slower).
            for name in order_rng.permutation(names):
                t = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - t)
        # Then AdvanceStep (it moves the rows on a token a call; 511 tokens
        # were allocated), alternated with the stub's ping.
        times["stub ping (with advance)"] = []
        times["client advance step"] = []
        sampled = np.ones(rows, np.int64)
        for r in range(min(args.rounds, 500)):
            order = [0, 1] if r % 2 else [1, 0]
            for o in order:
                t = time.perf_counter()
                if o == 0:
                    c.stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=10)
                    times["stub ping (with advance)"].append(
                        time.perf_counter() - t)
                else:
                    c.advance_step(batch.batch_id, sampled, step=r + 1)
                    times["client advance step"].append(
                        time.perf_counter() - t)
        print(f"{'call':<34}{'p50 us':>9}{'p90 us':>9}{'p50/stub':>10}")
        pairs = {"client ping": "stub ping", "stub ping": "stub ping",
                 "stub attention": "stub attention",
                 "client attention": "stub attention",
                 "client attention, shm": "stub attention",
                 "stub ping (with advance)": "stub ping (with advance)",
                 "client advance step": "stub ping (with advance)"}
        for name, v in times.items():
            base = np.median(times[pairs[name]])
            label = name + (f" ({rows} rows)" if "attention" in name or
                            "advance step" in name else "")
            print(f"{label:<34}{np.median(v) * 1e6:9.1f}"
                  f"{np.percentile(v, 90) * 1e6:9.1f}"
                  f"{np.median(v) / base:10.2f}")
        print(f"({args.rounds} rounds of the first five in random orders, then "
              f"{len(times['client advance step'])} of the last two; each "
              "ratio is to the stub's call above it)")
        shm.close()
        c.close()
    finally:
        server.terminate()
        server.wait()
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
