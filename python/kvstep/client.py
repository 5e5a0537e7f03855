"""A Python client for kvstep's KvStep service (the C++ one: client/client.h).

    import kvstep
    with kvstep.Client("unix:/run/kvstep.sock") as c:
        info = c.server_info()
        reply = c.allocate_blocks([(7, 300)])       # seq 7 holds 300 tokens

Every method sends one RPC and returns its reply message (kvstep.v1 protos,
`kvstep.pb`), except paged_attention, which returns the output as a numpy
array. A failed call raises the grpc.RpcError gRPC gives: `e.code()` is the
canonical code and `e.details()` the server's message, which names the
field and row at fault (the server changes nothing on a refused request).
`client.stub` is the generated stub, for calls made by hand.

The client sends the bearer token (`token=`) and the session id (after
open_session) with every call, and notes the server's instance id from each
reply's trailing metadata: `server_restarted` turns true when it changes,
which means every sequence, batch and session on the server is gone.
"""

import threading

import grpc
import numpy as np

from kvstep import tensors
from kvstep.v1 import kvstep_pb2 as pb
from kvstep.v1 import kvstep_pb2_grpc as pb_grpc

# The server's default --max_message_bytes: PagedAttention carries a step's
# activations, far past gRPC's 4 MiB default.
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


def _sequence_allocation(s):
    if isinstance(s, pb.SequenceAllocation):
        return s
    if isinstance(s, dict):
        return pb.SequenceAllocation(**s)
    seq_id, num_tokens = s
    return pb.SequenceAllocation(seq_id=seq_id, num_tokens=num_tokens)


def _batch_row(r):
    if isinstance(r, pb.BatchRow):
        return r
    return pb.BatchRow(**r)


def _index_tensor(values, rows_of_one=False):
    a = np.asarray(values)
    if rows_of_one and a.ndim == 1:
        a = a.reshape(-1, 1)
    if a.dtype.kind not in "iu":
        raise ValueError(f"expected integers, got {a.dtype} values")
    return tensors.to_tensor(a, pb.DTYPE_INT64)


class Client:
    """One channel to a kvstep server; safe to share between threads."""

    def __init__(self, target, *, token=None, root_certificates=None,
                 private_key=None, certificate_chain=None, timeout=10.0,
                 max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES,
                 channel_options=()):
        """Connects lazily to `target` ("unix:/path" or "host:port").

        root_certificates (PEM bytes) makes it a TLS channel, with
        private_key and certificate_chain for mutual TLS. `timeout` (seconds,
        None for none) bounds each call unless the call names its own.
        """
        options = [("grpc.max_receive_message_length", max_message_bytes),
                   ("grpc.max_send_message_length", max_message_bytes)]
        options += list(channel_options)
        if root_certificates is not None:
            creds = grpc.ssl_channel_credentials(
                root_certificates=root_certificates, private_key=private_key,
                certificate_chain=certificate_chain)
            self.channel = grpc.secure_channel(target, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(target, options=options)
        self.stub = pb_grpc.KvStepStub(self.channel)
        self.timeout = timeout
        self._token = token
        self._lock = threading.Lock()
        self._session_id = 0
        self._instance_id = ""
        self._restarted = False

    def close(self):
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- instance and session ------------------------------------------------

    @property
    def instance_id(self):
        """The server instance id of the last reply ("" before any)."""
        with self._lock:
            return self._instance_id

    @property
    def server_restarted(self):
        """Whether a reply came from another server instance than an
        earlier one: the server restarted and lost every sequence, batch
        and session."""
        with self._lock:
            return self._restarted

    @property
    def session_id(self):
        with self._lock:
            return self._session_id

    @session_id.setter
    def session_id(self, value):
        with self._lock:
            self._session_id = int(value)

    def _note_instance(self, trailing):
        for key, value in trailing or ():
            if key == "kvstep-instance-id" and value:
                with self._lock:
                    if self._instance_id and value != self._instance_id:
                        self._restarted = True
                    self._instance_id = value

    def _metadata(self, session=True):
        """The bearer token, and the session id unless `session` is false."""
        metadata = []
        if self._token:
            metadata.append(("authorization", "Bearer " + self._token))
        sid = self.session_id
        if session and sid:
            metadata.append(("kvstep-session-id", str(sid)))
        return metadata

    def _call(self, name, request, timeout=None, session=True):
        metadata = self._metadata(session)
        method = getattr(self.stub, name)
        try:
            reply, call = method.with_call(
                request, timeout=self.timeout if timeout is None else timeout,
                metadata=metadata)
        except grpc.RpcError as e:
            if isinstance(e, grpc.Call):
                self._note_instance(e.trailing_metadata())
            raise
        self._note_instance(call.trailing_metadata())
        return reply

    def wait_for_ready(self, timeout=10.0):
        """Waits until the server answers (GetServerInfo, which it serves
        once its pool is allocated); raises grpc.FutureTimeoutError or the
        call's error."""
        grpc.channel_ready_future(self.channel).result(timeout=timeout)
        return self.server_info(timeout=timeout)

    def open_session(self, ttl_seconds=0.0, name=""):
        """Opens a session and makes the following calls part of it: what
        they create is freed when it is closed or lapses (no call for its
        TTL). 0: the server's default TTL."""
        reply = self._call("OpenSession", pb.OpenSessionRequest(
            ttl_ms=int(round(ttl_seconds * 1000)), name=name), session=False)
        self.session_id = reply.session_id
        return reply

    def keep_alive(self, timeout=None):
        return self._call("KeepAlive",
                          pb.KeepAliveRequest(session_id=self.session_id),
                          timeout)

    def close_session(self):
        """Closes this client's session (its batches released, its
        sequences freed); later calls are in no session. The session id is
        also dropped when the server no longer knows the session (NOT_FOUND:
        it lapsed, was closed elsewhere, or the server restarted), which is
        raised all the same; otherwise every later call would carry the dead
        id and fail NOT_FOUND too."""
        try:
            reply = self._call(
                "CloseSession",
                pb.CloseSessionRequest(session_id=self.session_id))
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.NOT_FOUND:
                self.session_id = 0
            raise
        self.session_id = 0
        return reply

    # ---- the block manager ---------------------------------------------------

    def server_info(self, timeout=None):
        return self._call("GetServerInfo", pb.GetServerInfoRequest(), timeout,
                          session=False)

    def allocate_blocks(self, sequences, omit_appended_tables=False):
        """Grows each sequence to hold its tokens, all or nothing.

        `sequences`: pb.SequenceAllocation messages, dicts of their fields,
        or (seq_id, num_tokens) pairs. See kvstep.BlockTables for keeping
        the tables when `omit_appended_tables` leaves them out.
        """
        return self._call("AllocateBlocks", pb.AllocateBlocksRequest(
            sequences=[_sequence_allocation(s) for s in sequences],
            omit_appended_tables=omit_appended_tables))

    def can_allocate(self, sequences):
        return self._call("CanAllocate", pb.AllocateBlocksRequest(
            sequences=[_sequence_allocation(s) for s in sequences]))

    def free_sequences(self, seq_ids):
        return self._call("FreeSequences",
                          pb.FreeSequencesRequest(seq_ids=list(seq_ids)))

    def fork_sequence(self, parent_seq_id, child_seq_ids):
        return self._call("ForkSequence", pb.ForkSequenceRequest(
            parent_seq_id=parent_seq_id, child_seq_ids=list(child_seq_ids)))

    def swap_out(self, seq_ids):
        return self._call("SwapOut", pb.SwapRequest(seq_ids=list(seq_ids)))

    def swap_in(self, seq_ids):
        return self._call("SwapIn", pb.SwapRequest(seq_ids=list(seq_ids)))

    def reset_prefix_cache(self):
        return self._call("ResetPrefixCache", pb.ResetPrefixCacheRequest())

    # ---- shared memory -------------------------------------------------------

    def register_shared_memory(self, shm):
        """Registers a kvstep.SharedMemory with the server (same host, unix
        socket) and notes its region id on it; returns the id."""
        reply = self._call("RegisterSharedMemory",
                           pb.RegisterSharedMemoryRequest(path=shm.path,
                                                          size=shm.size))
        shm.region_id = reply.region_id
        return reply.region_id

    def unregister_shared_memory(self, shm):
        """Unregisters a kvstep.SharedMemory (or a region id)."""
        region_id = getattr(shm, "region_id", shm)
        self._call("UnregisterSharedMemory",
                   pb.UnregisterSharedMemoryRequest(region_id=region_id))
        if hasattr(shm, "region_id"):
            shm.region_id = 0

    # ---- batches and steps ---------------------------------------------------

    def create_batch(self, rows, **fields):
        """Builds a batch's state tensors from `rows` (pb.BatchRow messages
        or dicts of their fields: seq_id, token_ids, num_cached_tokens, ...),
        prefill rows first. Other CreateBatchRequest fields by keyword
        (return_tensors=True, block_table_width=..., ...)."""
        return self._call("CreateBatch", pb.CreateBatchRequest(
            rows=[_batch_row(r) for r in rows], **fields))

    def get_batch(self, batch_id):
        return self._call("GetBatch", pb.GetBatchRequest(batch_id=batch_id))

    def release_batches(self, batch_ids):
        return self._call("ReleaseBatches",
                          pb.ReleaseBatchesRequest(batch_ids=list(batch_ids)))

    def advance_step(self, batch_id, sampled_token_ids, *, step=0,
                     return_tensors=False, flashinfer=False):
        """Advances a server-held batch by its sampled tokens (one a row,
        as a 1-D or [rows, 1] array). `step`: the step this call takes (1
        for a batch's first), for exactly-once retries; 0 skips the check.
        """
        return self._call("AdvanceStep", pb.AdvanceStepRequest(
            batch_id=batch_id,
            sampled_token_ids=_index_tensor(sampled_token_ids,
                                            rows_of_one=True),
            step=step, return_tensors=return_tensors, flashinfer=flashinfer))

    # ---- attention -----------------------------------------------------------

    def paged_attention(self, layer, query, key, value, *, batch_id=0,
                        dtype=None, scale=0.0, alibi_slopes=None,
                        sliding_window=0, k_scale=0.0, v_scale=0.0,
                        kernel=pb.PagedAttentionRequest.KERNEL_AUTO,
                        block_tables=None, seq_lens=None, slot_mapping=None,
                        query_start_loc=None, shm=None, timeout=None):
        """Writes the step's key and value into `layer`'s cache and returns
        the attention output, a numpy array [num_tokens, num_heads,
        head_size] of the query's dtype (bfloat16: its uint16 bits).

        query [num_tokens, num_heads, head_size] and key, value [num_tokens,
        num_kv_heads, head_size], float32 or float16 arrays, or bfloat16
        bits with dtype=kvstep.pb.DTYPE_BFLOAT16. With batch_id, the
        server-held batch's slot_mapping, seq_lens, block_tables and
        query_start_loc are used; without it (explicit mode) they are given
        here, as vLLM's op takes them.

        shm: a registered kvstep.SharedMemory. The query, key and value are
        copied into it (in that order, each at a 64-byte boundary from 0)
        and the output is written there by the server, instead of both
        travelling in the messages; the region must hold all four.
        """
        req = pb.PagedAttentionRequest(
            batch_id=batch_id, layer=layer, scale=scale,
            sliding_window=sliding_window, k_scale=k_scale, v_scale=v_scale,
            kernel=kernel)
        if shm is None:
            tensors.to_tensor(query, dtype, out=req.query)
            tensors.to_tensor(key, dtype, out=req.key)
            tensors.to_tensor(value, dtype, out=req.value)
        else:
            out_place = self._place_in_shm(
                shm, ((query, req.query), (key, req.key),
                      (value, req.value)), dtype)
            req.out_shm.region_id = shm.region_id
            req.out_shm.offset = out_place
        if alibi_slopes is not None:
            tensors.to_tensor(alibi_slopes, pb.DTYPE_FLOAT32,
                              out=req.alibi_slopes)
        for name, v in (("block_tables", block_tables), ("seq_lens", seq_lens),
                        ("slot_mapping", slot_mapping),
                        ("query_start_loc", query_start_loc)):
            if v is not None:
                tensors.to_tensor(v, out=getattr(req, name))
        out = self._call("PagedAttention", req, timeout).out
        if shm is None:
            return tensors.from_tensor(out)
        # A copy: the region is the next call's.
        return np.array(shm.array(out.shm.offset, tuple(out.shape),
                                  tensors.numpy_dtype(out.dtype)))

    @staticmethod
    def _place_in_shm(shm, items, dtype):
        """Copies each (array, Tensor field) into `shm`, 64-byte aligned from
        0, and points the field there; returns the offset after them, which
        is where the output goes (checked to fit: it is the first array's
        size)."""
        if not shm.region_id:
            raise ValueError("the SharedMemory is not registered "
                             "(Client.register_shared_memory)")
        offset = 0
        for array, field in items:
            wire_dtype, wire = tensors.to_wire(array, dtype)
            shm.array(offset, wire.shape, wire.dtype)[...] = wire
            field.dtype = wire_dtype
            field.shape.extend(wire.shape)
            field.shm.region_id = shm.region_id
            field.shm.offset = offset
            offset += (wire.nbytes + 63) // 64 * 64
        # The output takes the query's shape and dtype: check it fits.
        query = items[0][1]
        shm.array(offset, tuple(query.shape), tensors.numpy_dtype(query.dtype))
        return offset

    # ---- events --------------------------------------------------------------

    def subscribe_kv_events(self, from_seq_no=0, from_now=False,
                            timeout=None):
        """An iterator over KvEventBatch replies (cancel() on it stops the
        stream). No deadline unless `timeout` is given.

        The call does not carry the client's session id: the stream creates
        nothing a session would own, and with the id a subscription made
        after the session lapsed or closed would be refused NOT_FOUND."""
        return self.stub.SubscribeKvEvents(
            pb.SubscribeKvEventsRequest(from_seq_no=from_seq_no,
                                        from_now=from_now),
            timeout=timeout, metadata=self._metadata(session=False))
