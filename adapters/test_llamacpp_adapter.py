"""Tests of what the llama.cpp adapter reads back from llama.cpp, on the real GGUF:
`ci/llama-cpp adapters/test_llamacpp_adapter.py GGUF` (tests/llamacpp.rs runs it).

The adapter's evidence is only as good as these readings: lengths from llama.cpp's memory,
KV cells and their stored row size from its state serialisation, model calls and rows from
the graphs it computed. Each test drives llama.cpp directly and checks a reading against what
the operations must have left. A sliding-window model's memory serialises as two caches: hand-
built states test the parser of sections and what the adapter reports of a window cache that
holds fewer rows than the sequence (Sections), and Gemma 3 270M, where ci/gemma3-270m has
assembled it, the same read back from llama.cpp (Gemma).
"""

import argparse
import os
import struct
import sys
import unittest

import llamacpp_adapter as A
from parity_adapter import RequestError, Row

GGUF = None
PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 1345]
# Gemma 3 270M (ci/gemma3-270m), where it has been assembled: a sliding-window model, whose
# memory llama.cpp serialises as two caches.
GEMMA = os.path.join(os.path.dirname(__file__), "..", ".deps", "gemma3-270m-1.0.0", "gemma-3-270m-q4_k_m.gguf")
GEMMA_PROMPT = [2, 818, 5279, 529, 7001, 563]


def cache(streams, layers, v_trans=False):
    """One KV cache as llama_kv_cache::state_write writes it: per stream its used cells (position,
    sequence ids), then per layer K's type, row size and rows, then V's (by element if transposed).
    `streams`: per stream a list of (pos, seq ids); `layers`: per layer ((K type, K row bytes),
    (V type, V row bytes))."""
    out = struct.pack("<I", len(streams))
    for cells in streams:
        out += struct.pack("<I", len(cells))
        if not cells:
            continue
        for pos, ids in cells:
            out += struct.pack(f"<iI{len(ids)}i", pos, len(ids), *ids)
        out += struct.pack("<II", int(v_trans), len(layers))
        for (kind, size), _ in layers:
            out += struct.pack("<iQ", kind, size) + b"\x11" * (size * len(cells))
        for _, (kind, size) in layers:
            if v_trans:
                out += struct.pack("<iII", kind, 2, size // 2) + b"\x22" * (size * len(cells))
            else:
                out += struct.pack("<iQ", kind, size) + b"\x22" * (size * len(cells))
    return out


def state(*caches):
    return struct.pack("<Ii", A.STATE_MAGIC, -1) + b"".join(caches)


F16 = A.KV_TYPES["f16"][0]
Q8 = A.KV_TYPES["q8_0"][0]


def engine(layout, type_k="f16", type_v="f16", flash="on", model=None, ctx=256, ubatch=0, swa_full="default"):
    args = argparse.Namespace(
        model=model or GGUF,
        layout=layout,
        flash_attn=flash,
        type_k=type_k,
        type_v=type_v,
        threads=2,
        n_seq=4,
        ctx=ctx,
        ubatch=ubatch,
        swa_full=swa_full,
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


class Sections(unittest.TestCase):
    """Hand-built states: llama.cpp's iSWA memory (Gemma 3) serialises a base cache (global
    layers) and then a window cache (sliding layers), with nothing between them."""

    # A base cache of 1 layer and a window cache of 2, f16 K and V of 8 values (16 bytes) each.
    LAYER = ((F16, 16), (F16, 16))

    def iswa(self, base_cells, window_cells, window_layers=2, v_trans=False):
        return state(
            cache([base_cells], [self.LAYER], v_trans),
            cache([window_cells], [self.LAYER] * window_layers, v_trans),
        )

    def test_two_caches_are_two_sections_each_with_its_cells_and_row(self):
        base = [(p, (0,)) for p in range(5)]
        # The window cache no longer holds positions 0 and 1 of the sequence.
        window = [(p, (0,)) for p in range(2, 5)]
        for v_trans in (False, True):
            c = A.Cells(self.iswa(base, window, v_trans=v_trans), ("base", "window"), n_layer=3)
            b, w = c.sections
            self.assertEqual((b.name, b.n_layer, b.row_bytes, b.seqs), ("base", 1, 32, [(0,)] * 5))
            self.assertEqual((w.name, w.n_layer, w.row_bytes, w.seqs), ("window", 2, 64, [(0,)] * 3))
            self.assertEqual(c.row_bytes, 96, "a row over every layer: both caches' rows")
            self.assertEqual(c.seqs, b.seqs, "the base cache holds every row")
            self.assertEqual(c.types, {("K", "f16"), ("V", "f16")})

    def test_every_byte_of_every_section_is_accounted_for(self):
        good = self.iswa([(0, (0,))], [(0, (0,))])
        A.Cells(good, ("base", "window"), n_layer=3)
        with self.assertRaisesRegex(RequestError, "does not know"):
            A.Cells(good + b"\x00", ("base", "window"), n_layer=3)  # a byte too many
        with self.assertRaisesRegex(RequestError, "does not know"):
            A.Cells(good, ("kv",))  # read as one cache, the window cache is left over
        with self.assertRaisesRegex(RequestError, "ends early"):
            A.Cells(good[:-1], ("base", "window"), n_layer=3)  # a window cache cut short
        with self.assertRaisesRegex(RequestError, "ends early"):
            A.Cells(state(cache([[(0, (0,))]], [self.LAYER])), ("base", "window"))  # no window cache
        with self.assertRaisesRegex(RequestError, "span"):
            A.Cells(good, ("base", "window"), n_layer=18)  # caches that do not span the model's layers
        # Streams of one cache that disagree on what a cell stores.
        A.Cells(state(cache([[(0, (0,))], [(0, (1,))]], [self.LAYER])), ("kv",))
        odd = struct.pack("<Ii", A.STATE_MAGIC, -1) + struct.pack("<I", 2)
        odd += cache([[(0, (0,))]], [self.LAYER])[4:] + cache([[(0, (1,))]], [((Q8, 34), (F16, 16))])[4:]
        with self.assertRaisesRegex(RequestError, "rows of 32 and 50 bytes"):
            A.Cells(odd, ("kv",))

    def test_empty_window_cache_section(self):
        # Nothing held: each cache writes its stream count and a zero cell count.
        c = A.Cells(state(cache([[]], []), cache([[]], [])), ("base", "window"), n_layer=18)
        self.assertEqual([(s.seqs, s.row_bytes) for s in c.sections], [([], 0), ([], 0)])

    def test_memory_counts_each_cache_at_its_row_and_a_window_short_of_rows(self):
        # What the adapter reports of a context whose window cache holds 3 of a sequence's 5
        # rows, and of a cell two sequences share: held bytes per cache, live rows at a whole
        # row's measured cost (docs/results.md).
        base = [(0, (0, 1)), (1, (0, 1)), (2, (0,)), (3, (0,)), (4, (0,))]
        window = [(2, (0,)), (3, (0,)), (4, (0,)), (1, (1,))]
        data = self.iswa(base, window)

        class Ctx:
            sections = ("base", "window")
            cells_made = [8, 6]
            layers_made = [1, 2]

            def cells(self):
                return A.Cells(data, self.sections, n_layer=3)

        e = A.LlamaCpp(argparse.Namespace(ctx=8))
        e.contexts, e.layer_bytes = [Ctx()], 32
        live, in_use, reserved, types = e.memory()
        self.assertEqual(live, 7 * (32 + 64), "7 live rows (5 + 2), each at the row of every layer")
        self.assertEqual(in_use, 5 * 32 + 4 * 64, "the cells each cache holds, once each")
        self.assertEqual(reserved, 8 * 32 + 6 * 64)
        self.assertEqual(types, {("K", "f16"), ("V", "f16")})


@unittest.skipUnless(os.path.exists(GEMMA), "Gemma 3 270M's GGUF is not assembled (ci/gemma3-270m)")
class Gemma(unittest.TestCase):
    """llama.cpp's own iSWA state on Gemma 3 270M: 3 global layers and 15 sliding ones, one KV
    head of 256."""

    def test_two_caches_read_back_from_llama_cpp(self):
        e = engine("per-seq", model=GEMMA, ctx=1024)
        self.assertEqual((e.sections, e.n_swa, e.kv_row_bytes), (("base", "window"), 512, 18 * 1024))
        s = e.create(0)
        e.forward([Row(s, GEMMA_PROMPT, len(GEMMA_PROMPT) - 1)])
        c = e.contexts[0].cells()
        self.assertEqual([(x.name, x.n_layer, x.row_bytes) for x in c.sections], [("base", 3, 3072), ("window", 15, 15360)])
        self.assertEqual([x.seqs for x in c.sections], [[(0,)] * 6] * 2)
        self.assertEqual(c.row_bytes, e.kv_row_bytes)
        # llama_context_default_params: swa_full on, the window cache as large as the base one;
        # off, window + ubatch cells padded to 256 (llama-kv-cache-iswa.cpp).
        self.assertEqual(e.contexts[0].cells_made, [1024, 1024])
        e = engine("per-seq", model=GEMMA, ctx=2048, ubatch=64, swa_full="off")
        e.create(0)
        self.assertEqual(e.contexts[0].cells_made, [2048, 768])

    def test_a_sequence_state_leaves_out_what_left_the_window(self):
        # llama_state_seq_get_data of one sequence writes no cell its window has left
        # (llama_kv_cache::state_write, is_masked_swa): a per-seq copy of a 600-row donor holds
        # every row in its base cache and only the last 512 in its window cache.
        e = engine("per-seq", model=GEMMA, ctx=1024)
        a = e.create(0)
        e.forward([Row(a, GEMMA_PROMPT * 100, 599)])
        b, mode = e.share_prefix(a, 600)
        self.assertEqual(mode, "copy")
        c = e.contexts[1].cells()
        self.assertEqual([len(x.seqs) for x in c.sections], [600, 512])
        live, in_use, _, _ = e.memory()
        self.assertEqual(live, 2 * 600 * 18 * 1024, "live rows at a whole row: the window's 512 do not lower it")
        self.assertEqual(in_use, 600 * 18 * 1024 + 600 * 3072 + 512 * 15360)
        # A donor 8 rows further on: its state's window cache starts at 96, and a copy cut back to
        # 599 rows would attend from 88. llama.cpp's seq_rm accepts the cut; the adapter refuses it.
        e.forward([Row(a, GEMMA_PROMPT, 5)])
        e.forward([Row(a, GEMMA_PROMPT[:2], 1)])
        with self.assertRaisesRegex(RequestError, "holds it from position 96, .* reaches back to 88"):
            e.share_prefix(a, 599)


if __name__ == "__main__":
    GGUF = sys.argv.pop(1)
    unittest.main()
