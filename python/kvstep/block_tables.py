"""The client's copy of its sequences' block tables (client/block_tables.h).

AllocateBlocks with omit_appended_tables leaves out each table the call only
appended to; BlockTables rebuilds it from the table it had and the reply's
new_block_ids, checked against num_blocks.
"""

from kvstep.v1 import kvstep_pb2 as pb


class TableMismatch(RuntimeError):
    """A reply left a table out, but this copy's table plus the reply's new
    blocks does not make the server's length: a reply was missed. Ask again
    without omit_appended_tables (a full reply resynchronizes)."""

    def __init__(self, seq_id, message):
        super().__init__(message)
        self.seq_id = seq_id


class BlockTables:
    """seq_id -> block table (a list of block ids), kept from replies."""

    def __init__(self):
        self._tables = {}

    def _apply_one(self, s):
        if not s.block_table_omitted:
            self._tables[s.seq_id] = list(s.block_table)
            return
        known = self._tables.get(s.seq_id)
        if known is None or len(known) + len(s.new_block_ids) != s.num_blocks:
            have = ("does not know the sequence" if known is None else
                    f"has {len(known)} blocks")
            raise TableMismatch(
                s.seq_id,
                f"seq {s.seq_id}: the reply left its table out and appended "
                f"{len(s.new_block_ids)} blocks to a table of {s.num_blocks}, "
                f"but this copy {have}: ask again without "
                "omit_appended_tables")
        known.extend(s.new_block_ids)

    def apply(self, reply):
        """An AllocateBlocksResponse (or a ForkSequenceResponse's children).

        Sequences are applied in order; on TableMismatch the ones before it
        are applied and that one is left as it was.
        """
        items = (reply.children if isinstance(reply, pb.ForkSequenceResponse)
                 else reply.sequences)
        for s in items:
            self._apply_one(s)

    def apply_swap(self, reply, seq_ids):
        """A SwapOut or SwapIn reply for `seq_ids`: their blocks renamed by
        its copies (blocks shared between them were copied once)."""
        missing = [i for i in seq_ids if i not in self._tables]
        if missing:
            raise KeyError(f"seq {missing[0]}: this copy does not know its "
                           "table")
        moved = {c.src: c.dst for c in reply.copies}
        for i in seq_ids:
            self._tables[i] = [moved.get(b, b) for b in self._tables[i]]

    def forget(self, seq_ids):
        for i in seq_ids:
            self._tables.pop(i, None)

    def find(self, seq_id):
        """The table (a list; do not modify it), or None."""
        return self._tables.get(seq_id)

    def matches_row(self, seq_id, row):
        """Whether a batch's block_tables row (zero-padded to its width) is
        this copy's table of seq_id."""
        known = self._tables.get(seq_id)
        row = [int(x) for x in row]
        return (known is not None and len(known) <= len(row)
                and row[:len(known)] == known
                and all(x == 0 for x in row[len(known):]))

    def __len__(self):
        return len(self._tables)

    def __contains__(self, seq_id):
        return seq_id in self._tables
