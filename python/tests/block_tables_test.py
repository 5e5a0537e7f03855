"""kvstep.BlockTables on replies made here (the service test drives it
against a server: client_test.py)."""

import unittest

import kvstep
from kvstep import pb


def seq(seq_id, new, table=None, num_blocks=None):
    s = pb.SequenceBlocks(seq_id=seq_id, new_block_ids=new)
    if table is None:
        s.block_table_omitted = True
        s.num_blocks = num_blocks
    else:
        s.block_table.extend(table)
        s.num_blocks = len(table)
    return s


class BlockTablesTest(unittest.TestCase):

    def test_omitted_tables_are_rebuilt_by_appending(self):
        t = kvstep.BlockTables()
        t.apply(pb.AllocateBlocksResponse(
            sequences=[seq(1, [9, 8], [9, 8]), seq(2, [7], [7])]))
        t.apply(pb.AllocateBlocksResponse(
            sequences=[seq(1, [5], num_blocks=3), seq(2, [], num_blocks=1)]))
        self.assertEqual(t.find(1), [9, 8, 5])
        self.assertEqual(t.find(2), [7])
        self.assertTrue(t.matches_row(1, [9, 8, 5, 0, 0]))
        self.assertFalse(t.matches_row(1, [9, 8, 5, 4]))
        self.assertFalse(t.matches_row(1, [9, 8]))
        self.assertFalse(t.matches_row(3, [0]))

    def test_a_missed_reply_is_refused_and_changes_nothing(self):
        t = kvstep.BlockTables()
        t.apply(pb.AllocateBlocksResponse(sequences=[seq(1, [9], [9])]))
        with self.assertRaisesRegex(kvstep.TableMismatch,
                                    "seq 1: .* table of 3, but this copy has "
                                    "1 blocks") as e:
            t.apply(pb.AllocateBlocksResponse(
                sequences=[seq(1, [4], num_blocks=3)]))
        self.assertEqual(e.exception.seq_id, 1)
        self.assertEqual(t.find(1), [9])
        with self.assertRaisesRegex(kvstep.TableMismatch,
                                    "does not know the sequence"):
            t.apply(pb.AllocateBlocksResponse(
                sequences=[seq(5, [4], num_blocks=1)]))
        # A full reply resynchronizes.
        t.apply(pb.AllocateBlocksResponse(
            sequences=[seq(1, [4], [9, 3, 4])]))
        self.assertEqual(t.find(1), [9, 3, 4])

    def test_forks_swaps_and_forget(self):
        t = kvstep.BlockTables()
        t.apply(pb.AllocateBlocksResponse(sequences=[seq(1, [9, 8], [9, 8])]))
        t.apply(pb.ForkSequenceResponse(children=[seq(2, [], [9, 8])]))
        self.assertEqual(t.find(2), [9, 8])
        # Shared block 9 was copied once for both sequences.
        t.apply_swap(pb.SwapResponse(copies=[pb.BlockCopy(src=9, dst=0),
                                             pb.BlockCopy(src=8, dst=1)]),
                     [1, 2])
        self.assertEqual(t.find(1), [0, 1])
        self.assertEqual(t.find(2), [0, 1])
        with self.assertRaises(KeyError):
            t.apply_swap(pb.SwapResponse(), [3])
        t.forget([1, 3])
        self.assertNotIn(1, t)
        self.assertEqual(len(t), 1)


if __name__ == "__main__":
    unittest.main()
