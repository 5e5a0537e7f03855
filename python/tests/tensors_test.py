"""kvstep.tensors: numpy <-> kvstep.v1.Tensor, and bfloat16 bits."""

import struct
import unittest

import numpy as np

import kvstep
from kvstep import pb


class ToTensorTest(unittest.TestCase):

    def test_keeps_the_four_numpy_types(self):
        for np_type, wire in ((np.int32, pb.DTYPE_INT32),
                              (np.int64, pb.DTYPE_INT64),
                              (np.float32, pb.DTYPE_FLOAT32),
                              (np.float16, pb.DTYPE_FLOAT16)):
            a = (np.arange(24) - 5).astype(np_type).reshape(2, 3, 4)
            t = kvstep.to_tensor(a)
            self.assertEqual(t.dtype, wire)
            self.assertEqual(list(t.shape), [2, 3, 4])
            self.assertEqual(len(t.data), a.size * a.itemsize)
            back = kvstep.from_tensor(t)
            self.assertEqual(back.dtype, np_type)
            np.testing.assert_array_equal(back, a)

    def test_data_is_little_endian_and_row_major(self):
        t = kvstep.to_tensor(np.array([[1, 2], [3, 258]], dtype=np.int32))
        self.assertEqual(t.data, struct.pack("<4i", 1, 2, 3, 258))
        # A big-endian array and a transposed (non-contiguous) view go out
        # in the wire's order too.
        t = kvstep.to_tensor(np.array([1.5, -2.0], dtype=">f4"))
        self.assertEqual(t.data, struct.pack("<2f", 1.5, -2.0))
        m = np.arange(6, dtype=np.int64).reshape(2, 3).T
        t = kvstep.to_tensor(m)
        self.assertEqual(list(t.shape), [3, 2])
        self.assertEqual(t.data, struct.pack("<6q", 0, 3, 1, 4, 2, 5))

    def test_a_named_dtype_converts(self):
        t = kvstep.to_tensor([[1, 2, 3]], pb.DTYPE_INT32)
        self.assertEqual(t.data, struct.pack("<3i", 1, 2, 3))
        t = kvstep.to_tensor(np.array([0.1], dtype=np.float64),
                             pb.DTYPE_FLOAT32)
        self.assertEqual(t.data, struct.pack("<f", 0.1))

    def test_refuses_what_would_be_truncated(self):
        with self.assertRaisesRegex(ValueError, "needs a dtype"):
            kvstep.to_tensor(np.zeros(3, dtype=np.float64))
        with self.assertRaisesRegex(ValueError, "takes integers"):
            kvstep.to_tensor(np.array([1.5]), pb.DTYPE_INT64)
        with self.assertRaisesRegex(ValueError, "raw bits"):
            kvstep.to_tensor(np.array([1.0], dtype=np.float32),
                             pb.DTYPE_BFLOAT16)
        with self.assertRaisesRegex(ValueError, "range"):
            kvstep.to_tensor(np.array([2**31], dtype=np.int64),
                             pb.DTYPE_INT32)
        with self.assertRaisesRegex(ValueError, "range"):
            kvstep.to_tensor(np.array([-1]), pb.DTYPE_FP8_E4M3)

    def test_fills_a_request_field_in_place(self):
        req = pb.PagedAttentionRequest()
        req.query.shape.extend([9, 9])  # replaced, not appended to
        got = kvstep.to_tensor(np.ones((2, 3), np.float16), out=req.query)
        self.assertIs(got, req.query)
        self.assertEqual(req.query.dtype, pb.DTYPE_FLOAT16)
        self.assertEqual(list(req.query.shape), [2, 3])
        np.testing.assert_array_equal(kvstep.from_tensor(req.query),
                                      np.ones((2, 3)))

    def test_signed_bits_are_taken_as_bits(self):
        # torch's route for bfloat16: t.view(torch.int16).numpy().
        bits = np.array([0x3F80, 0xBF80, 0xFFC0], dtype=np.uint16)
        t = kvstep.to_tensor(bits.view(np.int16), pb.DTYPE_BFLOAT16)
        self.assertEqual(t.data, bits.tobytes())
        np.testing.assert_array_equal(
            kvstep.float32_from_bf16_bits(kvstep.from_tensor(t))[:2],
            [1.0, -1.0])
        t = kvstep.to_tensor(np.array([-1, 56], dtype=np.int8),
                             pb.DTYPE_FP8_E4M3)
        self.assertEqual(t.data, bytes([0xFF, 56]))
        # A wider signed array is values, checked against the range.
        with self.assertRaisesRegex(ValueError, "range"):
            kvstep.to_tensor(np.array([-1], dtype=np.int32),
                             pb.DTYPE_BFLOAT16)

    def test_bits_dtypes_round_trip(self):
        bits = np.array([[0x3F80, 0xC000, 0x7FC0]], dtype=np.uint16)
        t = kvstep.to_tensor(bits, pb.DTYPE_BFLOAT16)
        self.assertEqual(t.data, struct.pack("<3H", 0x3F80, 0xC000, 0x7FC0))
        np.testing.assert_array_equal(kvstep.from_tensor(t), bits)
        fp8 = np.array([0, 0x38, 0xFF], dtype=np.uint8)
        t = kvstep.to_tensor(fp8, pb.DTYPE_FP8_E5M2)
        self.assertEqual(t.data, bytes([0, 0x38, 0xFF]))
        np.testing.assert_array_equal(kvstep.from_tensor(t), fp8)


class FromTensorTest(unittest.TestCase):

    def test_refuses_data_that_does_not_match(self):
        t = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=[2, 3], data=bytes(20))
        with self.assertRaisesRegex(ValueError, "20 bytes .*24 expected"):
            kvstep.from_tensor(t)
        t = pb.Tensor(dtype=pb.DTYPE_UNSPECIFIED, shape=[1], data=bytes(4))
        with self.assertRaisesRegex(ValueError, "unknown dtype"):
            kvstep.from_tensor(t)
        t = pb.Tensor(dtype=pb.DTYPE_INT32, shape=[-1, 2], data=bytes(8))
        with self.assertRaisesRegex(ValueError, "negative"):
            kvstep.from_tensor(t)

    def test_returns_a_writable_copy(self):
        t = kvstep.to_tensor(np.array([1, 2], dtype=np.int64))
        a = kvstep.from_tensor(t)
        a[0] = 7
        self.assertEqual(kvstep.from_tensor(t)[0], 1)


class Bf16Test(unittest.TestCase):

    def test_rounds_to_nearest_even(self):
        x = np.array([1.0, 1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20,
                      -(1 + 2**-8), 3.0e38, np.finfo(np.float32).max, -np.inf, 0.0, -0.0],
                     dtype=np.float32)
        # 3.0e38 (0x7f61b1e6) is under bfloat16's largest (0x7f7f, 3.39e38)
        # and rounds up to 0x7f62; float32's largest is past the halfway
        # point from bfloat16's to 2^128, so it rounds to Inf.
        big = np.array([0x7F620000], dtype=np.uint32).view(np.float32)[0]
        want = np.array([1.0, 1.0, 1 + 2**-6, 1 + 2**-7, -1.0, big, np.inf,
                         -np.inf, 0.0, -0.0], dtype=np.float32)
        got = kvstep.float32_from_bf16_bits(kvstep.bf16_bits_from_float32(x))
        np.testing.assert_array_equal(got, want)
        self.assertTrue(np.signbit(got[-1]))

    def test_nan_stays_nan(self):
        # A NaN whose payload is all in the low half would round to Inf by
        # the add; it must stay NaN.
        x = np.array([0x7F800001, 0xFFFFFFFF, 0x7FC00000],
                     dtype=np.uint32).view(np.float32)
        got = kvstep.float32_from_bf16_bits(kvstep.bf16_bits_from_float32(x))
        self.assertTrue(np.isnan(got).all())

    def test_every_bf16_value_survives_the_round_trip(self):
        bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
        f = kvstep.float32_from_bf16_bits(bits)
        back = kvstep.bf16_bits_from_float32(f)
        finite = ~np.isnan(f)
        np.testing.assert_array_equal(back[finite], bits[finite])
        self.assertTrue(np.isnan(kvstep.float32_from_bf16_bits(
            back[~finite])).all())


if __name__ == "__main__":
    unittest.main()
