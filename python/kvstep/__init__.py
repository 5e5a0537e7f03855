"""kvstep's Python client: the KvStep service's stubs (kvstep.v1, generated
from protos/kvstep/v1/kvstep.proto at build time), a client that carries
the token, session and timeouts (Client), tensors to and from numpy
(to_tensor, from_tensor), the client's copy of the block tables
(BlockTables) and shared memory for PagedAttention's tensors
(SharedMemory). docs/python.md has the details."""

from kvstep.v1 import kvstep_pb2 as pb
from kvstep.v1 import kvstep_pb2_grpc as pb_grpc
from kvstep.block_tables import BlockTables, TableMismatch
from kvstep.client import Client
from kvstep.shared_memory import SharedMemory
from kvstep.tensors import (bf16_bits_from_float32, float32_from_bf16_bits,
                            from_tensor, to_tensor)

__all__ = [
    "BlockTables", "Client", "SharedMemory", "TableMismatch", "bf16_bits_from_float32",
    "float32_from_bf16_bits", "from_tensor", "pb", "pb_grpc", "to_tensor",
]
