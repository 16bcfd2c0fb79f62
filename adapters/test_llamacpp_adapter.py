"""Tests of what the llama.cpp adapter reads back from llama.cpp, on the real GGUF:
`ci/llama-cpp adapters/test_llamacpp_adapter.py GGUF` (tests/llamacpp.rs runs it).

The adapter's evidence is only as good as these readings: lengths from llama.cpp's memory,
KV cells and their stored row size from its state serialisation, model calls and rows from
the graphs it computed. Each test drives llama.cpp directly and checks a reading against what
the operations must have left.
"""

import argparse
import sys
import unittest

import llamacpp_adapter as A
from parity_adapter import RequestError, Row

GGUF = None
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345]


def engine(layout, type_k="f16", type_v="f16", flash="on"):
    args = argparse.Namespace(
        model=GGUF, layout=layout, flash_attn=flash, type_k=type_k, type_v=type_v, threads=2, n_seq=4, ctx=256
    )
    e = A.LlamaCpp(args)
    e.load(None, layout, {})
    return e


class Readings(unittest.TestCase):
    def test_cells_and_row_bytes_of_f16_and_q8_0(self):
        # The trap this guards: a cache asked for q8_0 that stores f16 ("silent memory loss")
        # must read as f16's bytes, so the row size comes from the state, not from the ask.
        for type_k, k_row in (("f16", 384), ("q8_0", 204)):
            e = engine("per-seq", type_k=type_k)
            s = e.create(0)
            e.forward([Row(s, PROMPT, len(PROMPT) - 1)])
            cells = e.contexts[0].cells()
            self.assertEqual(cells.seqs, [(0,)] * len(PROMPT))
            self.assertEqual(cells.row_bytes, 30 * (k_row + 384), type_k)
            self.assertEqual(e.kv_row_bytes, cells.row_bytes)
            self.assertIn(("K", type_k), cells.types)

    def test_unified_prefix_shares_cells_and_streams_copy(self):
        e = engine("unified")
        a = e.create(0)
        e.forward([Row(a, PROMPT, len(PROMPT) - 1)])
        b, mode = e.share_prefix(a, 5)
        self.assertEqual(mode, "share")
        cells = e.contexts[0].cells()
        # Five cells now hold both sequences, three the donor alone: no row was copied.
        self.assertEqual(sorted(cells.seqs), sorted([(0, 1)] * 5 + [(0,)] * 3))
        live, in_use, _, _ = e.memory()
        self.assertEqual((live, in_use), (13 * cells.row_bytes, 8 * cells.row_bytes))

        e = engine("streams")
        a = e.create(0)
        e.forward([Row(a, PROMPT, len(PROMPT) - 1)])
        b, mode = e.share_prefix(a, 5)
        self.assertEqual(mode, "copy")
        self.assertEqual(e.length(b), 5)
        # The copy of a whole stream lands at the next update: decode through it.
        e.forward([Row(b, [PROMPT[5]], 0)])
        self.assertEqual(sorted(e.contexts[0].cells().seqs), sorted([(0,)] * 8 + [(1,)] * 6))

    def test_trim_reads_the_length_back(self):
        e = engine("unified")
        s = e.create(0)
        e.forward([Row(s, PROMPT, len(PROMPT) - 1)])
        self.assertEqual(e.trim(s, 3), (3, 5))
        self.assertEqual(e.stats()["counters"]["rows_trimmed"], 3)
        e.release(s)
        self.assertEqual(e.memory()[1], 0, "a released sequence holds no cells")

    def test_counters_come_from_the_graphs_computed(self):
        e = engine("streams")
        a, b = e.create(0), e.create(0)
        e.forward([Row(a, PROMPT, 7), Row(b, PROMPT, 7)])
        c = e.stats()["counters"]
        # One llama_decode of two streams: one graph, 16 tokens, two logits rows.
        self.assertEqual((c["forwards"], c["tokens"], c["max_rows"]), (1, 16, 2))
        e = engine("per-seq")
        a, b = e.create(0), e.create(0)
        e.forward([Row(a, PROMPT, 7), Row(b, PROMPT, 7)])
        c = e.stats()["counters"]
        self.assertEqual((c["forwards"], c["tokens"], c["max_rows"]), (2, 16, 1))

    def test_state_format_is_checked_not_trusted(self):
        with self.assertRaises(RequestError):
            A.Cells(b"\x00" * 12)
        e = engine("per-seq")
        s = e.create(0)
        e.forward([Row(s, PROMPT, 7)])
        n = A.L.llama_state_seq_get_size(e.contexts[0].ctx, -1)
        buf = (A.ctypes.c_uint8 * n)()
        A.L.llama_state_seq_get_data(e.contexts[0].ctx, buf, n, -1)
        with self.assertRaises(RequestError):
            A.Cells(bytes(buf) + b"\x00")  # a byte the format does not account for


if __name__ == "__main__":
    GGUF = sys.argv.pop(1)
    unittest.main()
