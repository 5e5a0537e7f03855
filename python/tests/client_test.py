"""kvstep.Client against a kvstep-server process ($KVSTEP_SERVER): a
scheduler's loop from Python (allocate, prefill, decode steps with
AdvanceStep and PagedAttention) checked against dense attention computed
here, the explicit mode, errors, sessions, the token, and a restart."""

import os
import shutil
import subprocess
import tempfile
import unittest
import zlib

import grpc
import numpy as np

import kvstep
from kvstep import pb

SERVER = os.environ.get("KVSTEP_SERVER", "build/kvstep-server")
NUM_BLOCKS = 64
BLOCK = 16
KV_HEADS = 2
HEADS = 4  # GQA: two query heads a KV head
HEAD = 64
LAYERS = 2


class Server:
    """A kvstep-server on a unix socket in a temporary directory."""

    def __init__(self, extra=(), directory=None):
        self.dir = directory or tempfile.mkdtemp(prefix="kvstep-py-")
        self.target = "unix:" + os.path.join(self.dir, "kvstep.sock")
        self.log_path = os.path.join(self.dir, "server.log")
        self.extra = list(extra)
        self.proc = None

    def start(self):
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [SERVER, "--listen=" + self.target,
                 f"--num_blocks={NUM_BLOCKS}", f"--block_size={BLOCK}",
                 f"--num_layers={LAYERS}", f"--num_kv_heads={KV_HEADS}",
                 f"--head_size={HEAD}", "--cache_dtype=float32",
                 "--attention_threads=1", "--shutdown_grace=0s"] + self.extra,
                stdout=log, stderr=subprocess.STDOUT)
        return self

    def stop(self):
        """Stops the server (SIGTERM: a graceful shutdown) and checks that
        it exited cleanly: a sanitizer build's report, a leak included,
        makes the exit status nonzero."""
        if self.proc is None:
            return
        self.proc.terminate()
        code = self.proc.wait(timeout=60)
        self.proc = None
        if code != 0:
            raise AssertionError(
                f"kvstep-server exited with {code}:\n" + self.log())

    def log(self):
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def cleanup(self):
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)


def ready_client(server, **kw):
    """A client of `server` once it answers (at most a minute: sanitizer
    builds start slowly); fails at once with the log if the server exited."""
    c = kvstep.Client(server.target, **kw)
    for _ in range(120):
        if server.proc.poll() is not None:
            break
        try:
            c.wait_for_ready(timeout=0.5)
            return c
        except grpc.FutureTimeoutError:
            pass
    c.close()
    raise AssertionError("the server did not come up:\n" + server.log())


def dense_attention(q, k, v, first_pos):
    """fp64 causal attention with GQA: q [n, HEADS, HEAD] at positions
    first_pos .. first_pos + n - 1 over k, v [len, KV_HEADS, HEAD]."""
    q = q.astype(np.float64)
    k = k.astype(np.float64)
    v = v.astype(np.float64)
    out = np.zeros(q.shape)
    group = HEADS // KV_HEADS
    for t in range(q.shape[0]):
        seen = first_pos + t + 1
        for h in range(HEADS):
            logits = k[:seen, h // group] @ q[t, h] / np.sqrt(HEAD)
            w = np.exp(logits - logits.max())
            out[t, h] = (w / w.sum()) @ v[:seen, h // group]
    return out


def assert_close(test, got, want, what):
    # fp32 cache and fp32 accumulation against fp64: vLLM's bounds.
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4,
                               err_msg=what)
    test.assertEqual(got.dtype, np.float32)


class ClientTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.server = Server().start()
        cls.client = ready_client(cls.server)

    @classmethod
    def tearDownClass(cls):
        cls.client.close()
        cls.server.cleanup()

    def setUp(self):
        self.rng = np.random.default_rng(zlib.crc32(self.id().encode()))

    def tearDown(self):
        # Every test gives back what it took.
        self.assertEqual(self.client.server_info().free_blocks, NUM_BLOCKS)

    def activations(self, n, heads):
        return self.rng.uniform(-1, 1, (n, heads, HEAD)).astype(np.float32)

    def test_server_info_reports_the_geometry(self):
        info = self.client.server_info()
        g = info.geometry
        self.assertEqual((g.num_blocks, g.block_size, g.num_layers,
                          g.num_kv_heads, g.head_size),
                         (NUM_BLOCKS, BLOCK, LAYERS, KV_HEADS, HEAD))
        self.assertEqual(info.free_blocks, NUM_BLOCKS)
        self.assertTrue(self.client.instance_id)
        self.assertEqual(self.client.instance_id, info.server_instance_id)
        self.assertFalse(self.client.server_restarted)

    def test_decode_steps_match_dense_attention(self):
        c = self.client
        prompts = {1: 5, 2: 19}
        steps = 20
        vocab = 1000
        tokens = {s: list(self.rng.integers(0, vocab, n))
                  for s, n in prompts.items()}
        reply = c.allocate_blocks(
            [dict(seq_id=s, num_tokens=n + 1, prompt_token_ids=tokens[s])
             for s, n in prompts.items()])
        tables = kvstep.BlockTables()
        tables.apply(reply)
        batch = c.create_batch(
            [dict(seq_id=s, token_ids=tokens[s]) for s in prompts],
            return_tensors=True,
            block_table_width=(max(prompts.values()) + steps) // BLOCK + 1)
        bt = batch.tensors
        self.assertEqual(bt.num_prefills, 2)
        np.testing.assert_array_equal(kvstep.from_tensor(bt.seq_lens), [5, 19])

        # K and V of every token so far, by layer and sequence.
        keys = {(l, s): [] for l in range(LAYERS) for s in prompts}
        values = {(l, s): [] for l in range(LAYERS) for s in prompts}
        n = sum(prompts.values())
        for layer in range(LAYERS):
            q = self.activations(n, HEADS)
            k = self.activations(n, KV_HEADS)
            v = self.activations(n, KV_HEADS)
            out = c.paged_attention(layer, q, k, v,
                                    batch_id=batch.batch_id)
            self.assertEqual(out.shape, (n, HEADS, HEAD))
            start = 0
            for s, plen in prompts.items():
                rows = slice(start, start + plen)
                keys[layer, s].extend(k[rows])
                values[layer, s].extend(v[rows])
                assert_close(self, out[rows],
                             dense_attention(q[rows], k[rows], v[rows], 0),
                             f"layer {layer} seq {s} prefill")
                start += plen

        lens = dict(prompts)
        for step in range(1, steps + 1):
            reply = c.allocate_blocks(
                [(s, lens[s] + 1) for s in prompts], omit_appended_tables=True)
            tables.apply(reply)
            sampled = self.rng.integers(0, vocab, len(prompts))
            r = c.advance_step(batch.batch_id, sampled, step=step,
                               return_tensors=True)
            self.assertEqual(r.step, step)
            t = r.tensors
            np.testing.assert_array_equal(kvstep.from_tensor(t.input_tokens),
                                          sampled)
            np.testing.assert_array_equal(
                kvstep.from_tensor(t.input_positions),
                [lens[s] for s in prompts])
            np.testing.assert_array_equal(kvstep.from_tensor(t.seq_lens),
                                          [lens[s] + 1 for s in prompts])
            table_rows = kvstep.from_tensor(t.block_tables)
            for i, s in enumerate(prompts):
                self.assertTrue(tables.matches_row(s, table_rows[i]),
                                f"step {step} seq {s}: {table_rows[i]} is not "
                                f"{tables.find(s)}")
            for layer in range(LAYERS):
                q = self.activations(len(prompts), HEADS)
                k = self.activations(len(prompts), KV_HEADS)
                v = self.activations(len(prompts), KV_HEADS)
                out = c.paged_attention(layer, q, k, v,
                                        batch_id=batch.batch_id)
                for i, s in enumerate(prompts):
                    keys[layer, s].append(k[i])
                    values[layer, s].append(v[i])
                    assert_close(
                        self, out[i:i + 1],
                        dense_attention(q[i:i + 1],
                                        np.array(keys[layer, s]),
                                        np.array(values[layer, s]), lens[s]),
                        f"layer {layer} seq {s} step {step}")
            for s in prompts:
                lens[s] += 1
        self.assertEqual(lens, {1: 25, 2: 39})
        self.assertEqual([len(tables.find(s)) for s in prompts], [2, 3])

        c.release_batches([batch.batch_id])
        freed = c.free_sequences(list(prompts))
        self.assertEqual(sorted(freed.freed_seq_ids), [1, 2])
        tables.forget(prompts)

    def test_explicit_mode_takes_the_tables_in_the_request(self):
        c = self.client
        reply = c.allocate_blocks([(10, 40)])
        table = list(reply.sequences[0].block_table)
        self.assertEqual(len(table), 3)
        n = 40
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(n)]
        q = self.activations(n, HEADS)
        k = self.activations(n, KV_HEADS)
        v = self.activations(n, KV_HEADS)
        out = c.paged_attention(
            1, q, k, v, block_tables=np.array([table], dtype=np.int32),
            seq_lens=np.array([n], dtype=np.int32),
            slot_mapping=np.array(slots, dtype=np.int64),
            query_start_loc=np.array([0, n], dtype=np.int32))
        assert_close(self, out, dense_attention(q, k, v, 0), "explicit")
        # One decode token more over the same cache: slot -1 skips the
        # write, so the cache keeps the 40 tokens and position 39 is
        # recomputed from them.
        q1 = self.activations(1, HEADS)
        out = c.paged_attention(
            1, q1, k[-1:], v[-1:], block_tables=np.array([table], np.int32),
            seq_lens=np.array([n], np.int32),
            slot_mapping=np.array([-1], np.int64))
        assert_close(self, out, dense_attention(q1, k, v, n - 1),
                     "explicit decode")
        c.free_sequences([10])

    def test_shared_memory_gives_the_bytes_results(self):
        c = self.client
        c.allocate_blocks([(40, 30)])
        batch = c.create_batch([dict(seq_id=40, token_ids=list(range(30)))])
        q = self.activations(30, HEADS)
        k = self.activations(30, KV_HEADS)
        v = self.activations(30, KV_HEADS)
        by_bytes = c.paged_attention(0, q, k, v, batch_id=batch.batch_id)
        with kvstep.SharedMemory(1 << 20) as shm:
            with self.assertRaisesRegex(ValueError, "not registered"):
                c.paged_attention(1, q, k, v, batch_id=batch.batch_id,
                                  shm=shm)
            c.register_shared_memory(shm)
            self.assertGreater(shm.region_id, 0)
            # Layer 1 through shared memory: the same bytes.
            by_shm = c.paged_attention(1, q, k, v, batch_id=batch.batch_id,
                                       shm=shm)
            np.testing.assert_array_equal(by_shm, by_bytes)
            # The region holds the output after the inputs.
            n = q.nbytes + 2 * ((k.nbytes + 63) // 64 * 64)
            np.testing.assert_array_equal(
                shm.array(n, q.shape, np.float32), by_bytes)
            # A region too small for the output is refused before any call.
            with kvstep.SharedMemory(q.nbytes + 2 * k.nbytes) as small:
                small.region_id = shm.region_id  # never sent
                with self.assertRaisesRegex(ValueError, "do not fit"):
                    c.paged_attention(1, q, k, v, batch_id=batch.batch_id,
                                      shm=small)
            region = shm.region_id
            c.unregister_shared_memory(shm)
            self.assertEqual(shm.region_id, 0)
            with self.assertRaises(grpc.RpcError) as e:
                c.unregister_shared_memory(region)
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        c.release_batches([batch.batch_id])
        c.free_sequences([40])

    def test_refusals_name_the_field_and_change_nothing(self):
        c = self.client
        c.allocate_blocks([(20, 8)])
        batch = c.create_batch([dict(seq_id=20, token_ids=list(range(8)))])
        # A query with the wrong number of heads.
        with self.assertRaises(grpc.RpcError) as e:
            c.paged_attention(0, self.activations(8, HEADS + 1),
                              self.activations(8, KV_HEADS),
                              self.activations(8, KV_HEADS),
                              batch_id=batch.batch_id)
        self.assertEqual(e.exception.code(), grpc.StatusCode.INVALID_ARGUMENT)
        self.assertIn("query", e.exception.details())
        with self.assertRaises(grpc.RpcError) as e:
            c.get_batch(batch.batch_id + 1000)
        self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
        # A skipped step number.
        with self.assertRaises(grpc.RpcError) as e:
            c.advance_step(batch.batch_id, [1], step=2)
        self.assertEqual(e.exception.code(),
                         grpc.StatusCode.FAILED_PRECONDITION)
        self.assertEqual(c.get_batch(batch.batch_id).step, 0)
        # More than the pool, all or nothing: seq 21 is not created.
        with self.assertRaises(grpc.RpcError) as e:
            c.allocate_blocks([(21, 16), (22, NUM_BLOCKS * BLOCK)])
        self.assertIn(e.exception.code(),
                      (grpc.StatusCode.RESOURCE_EXHAUSTED,
                       grpc.StatusCode.OUT_OF_RANGE))
        self.assertEqual(c.free_sequences([21]).unknown_seq_ids, [21])
        # Client-side checks come before any call.
        with self.assertRaisesRegex(ValueError, "integers"):
            c.advance_step(batch.batch_id, [1.5])
        c.release_batches([batch.batch_id])
        c.free_sequences([20])

    def test_closing_a_session_frees_what_it_made(self):
        c = kvstep.Client(self.server.target)
        try:
            opened = c.open_session(ttl_seconds=30, name="client_test")
            self.assertEqual(c.session_id, opened.session_id)
            c.allocate_blocks([(30, 100), (31, 20)])
            c.create_batch([dict(seq_id=30, token_ids=[1, 2, 3])])
            c.keep_alive()
            # Another client, in no session, may not touch them.
            with self.assertRaises(grpc.RpcError) as e:
                self.client.free_sequences([30])
            self.assertEqual(e.exception.code(),
                             grpc.StatusCode.PERMISSION_DENIED)
            closed = c.close_session()
            self.assertEqual(closed.sequences_freed, 2)
            self.assertEqual(closed.blocks_freed, 7 + 2)
            self.assertEqual(closed.batches_released, 1)
            self.assertEqual(c.session_id, 0)
        finally:
            c.close()

    def test_close_session_drops_an_id_the_server_no_longer_knows(self):
        c = kvstep.Client(self.server.target)
        try:
            sid = c.open_session(ttl_seconds=30).session_id
            # Closed behind the client's back (as a lapse or a restart
            # would leave it).
            self.client.stub.CloseSession(
                pb.CloseSessionRequest(session_id=sid))
            with self.assertRaises(grpc.RpcError) as e:
                c.close_session()
            self.assertEqual(e.exception.code(), grpc.StatusCode.NOT_FOUND)
            self.assertEqual(c.session_id, 0)
            # Later calls are in no session, not refused for the dead id.
            self.assertEqual(c.allocate_blocks([(40, 1)]).free_blocks,
                             NUM_BLOCKS - 1)
            c.free_sequences([40])
        finally:
            c.close()

    def test_kv_events_report_the_blocks_a_prefill_stores(self):
        c = self.client
        prompt = [int(t) for t in self.rng.integers(0, 1000, 2 * BLOCK + 1)]
        c.allocate_blocks([dict(seq_id=50, num_tokens=len(prompt),
                                prompt_token_ids=prompt,
                                adapter_id="events-test")])
        batch = c.create_batch([dict(seq_id=50, token_ids=prompt,
                                     prefill=True)])
        c.release_batches([batch.batch_id])
        c.free_sequences([50])
        c.reset_prefix_cache()
        # From the log's start: this test's events are the last ones there
        # (the test server's log holds far more than the tests make), and
        # the stream's deadline keeps a missing one from hanging the test.
        stream = c.subscribe_kv_events(from_seq_no=0, timeout=30)
        stored = []
        try:
            for reply in stream:
                self.assertEqual(reply.server_instance_id, c.instance_id)
                for e in reply.events:
                    if (e.HasField("block_stored") and
                            e.block_stored.adapter_id == "events-test"):
                        stored.append(e)
                    elif e.HasField("all_blocks_cleared") and stored:
                        cleared = e
                        break
                else:
                    continue
                break
        finally:
            stream.cancel()
        # Two full blocks of the 33-token prompt, chained; the third holds
        # one token and is not stored.
        self.assertEqual(len(stored), 2)
        first, second = stored[0].block_stored, stored[1].block_stored
        self.assertEqual(list(first.token_ids), prompt[:BLOCK])
        self.assertEqual(list(second.token_ids), prompt[BLOCK:2 * BLOCK])
        self.assertEqual(first.block_size, BLOCK)
        self.assertEqual(first.parent_block_hash, b"")
        self.assertEqual(len(first.block_hashes[0]), 16)
        self.assertEqual(second.parent_block_hash, first.block_hashes[0])
        self.assertEqual(stored[1].seq_no, stored[0].seq_no + 1)
        self.assertGreater(cleared.seq_no, stored[1].seq_no)


class TokenAndRestartTest(unittest.TestCase):

    def test_the_token_is_sent_with_every_call(self):
        server = Server()
        try:
            token_file = os.path.join(server.dir, "token")
            with open(token_file, "w") as f:
                f.write("a-token-of-16-bytes-or-more\n")
            server.extra = ["--auth_token_file=" + token_file]
            server.start()
            with ready_client(server,
                              token="a-token-of-16-bytes-or-more") as c:
                self.assertEqual(c.allocate_blocks([(1, 1)]).free_blocks,
                                 NUM_BLOCKS - 1)
                c.free_sequences([1])
            with kvstep.Client(server.target) as c:
                with self.assertRaises(grpc.RpcError) as e:
                    c.allocate_blocks([(1, 1)])
                self.assertEqual(e.exception.code(),
                                 grpc.StatusCode.UNAUTHENTICATED)
        finally:
            server.cleanup()

    def test_a_restarted_server_is_noticed(self):
        server = Server().start()
        try:
            with ready_client(server) as c:
                first = c.instance_id
                c.allocate_blocks([(5, 10)])
                server.stop()
                server.start()
                c.wait_for_ready(timeout=60)
                self.assertNotEqual(c.instance_id, first)
                self.assertTrue(c.server_restarted)
                # The new instance does not know seq 5.
                self.assertEqual(c.free_sequences([5]).unknown_seq_ids, [5])
        finally:
            server.cleanup()


if __name__ == "__main__":
    unittest.main()
