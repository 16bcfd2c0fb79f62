"""Tests of the adapter kit (parity_adapter.py), standard library only:

    python3 adapters/test_parity_adapter.py

Each drives the kit's loop with request lines, as parity does, around the toy engine
(toy_adapter.py) or an engine that misbehaves, and checks the replies. That the kit and the
toy pass a whole suite under parity is tests/adapter_kit.rs.
"""

import io
import json
import os
import tempfile
import unittest

from parity_adapter import Engine, Server, capabilities, counters, decode_logits, encode_logits
from toy_adapter import Toy

VOCAB = 16


def session(engine):
    """A kit server after a good hello, and a function sending one request to it."""
    d = tempfile.mkdtemp()
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"vocab_size": VOCAB}, f)
    server = Server(engine)
    ids = iter(range(1, 1 << 30))

    def send(op, **fields):
        reply, _ = server.reply(json.dumps({"id": next(ids), "op": op, **fields}))
        return reply

    hello, _ = server.reply(json.dumps({"id": 0, "op": "hello", "protocol": 1, "model": d, "path": "p"}))
    assert hello["ok"], hello
    return send, hello


class Protocol(unittest.TestCase):
    def test_hello_declares_the_engine_and_its_capabilities(self):
        _, hello = session(Toy("batched"))
        self.assertEqual(hello["protocol"], 1)
        self.assertEqual(hello["vocab_size"], VOCAB)
        self.assertEqual(hello["engine"], {"name": "toy", "version": "1"})
        self.assertEqual(hello["capabilities"]["kv_row_bytes"], 8)
        self.assertIs(hello["capabilities"]["masked_prefix"], False)

    def test_hello_names_the_device_only_where_the_engine_says_it(self):
        # A reference pinned to a device (builtin:dense@cpu) is refused unless hello names it.
        toy = Toy("batched")
        toy.device = "gpu"
        _, hello = session(toy)
        self.assertEqual(hello["engine"], {"name": "toy", "version": "1", "device": "gpu"})

    def test_a_wrong_protocol_or_no_hello_is_an_error(self):
        server = Server(Toy("alone"))
        reply, _ = server.reply('{"id": 1, "op": "create", "masked_prefix": 0}')
        self.assertEqual((reply["ok"], reply["error"]), (False, "send hello first"))
        reply, _ = server.reply('{"id": 2, "op": "hello", "protocol": 2}')
        self.assertIn("speaks protocol 1", reply["error"])

    def test_replies_echo_ids_and_unreadable_lines_have_none(self):
        send, _ = session(Toy("alone"))
        self.assertEqual(send("reset")["ok"], True)
        reply, _ = Server(Toy("alone")).reply("not json")
        self.assertEqual((reply["id"], reply["ok"]), (None, False))

    def test_forward_rows_are_checked_before_the_engine_sees_them(self):
        send, _ = session(Toy("batched"))
        a = send("create", masked_prefix=0)["seq"]
        b = send("create", masked_prefix=0)["seq"]
        bad = [
            ([], "non-empty list of rows"),
            ([{"seq": 9, "tokens": [1], "logits_at": 0}], "no sequence 9"),
            ([{"seq": a, "tokens": [VOCAB], "logits_at": 0}], "integer in 0..15"),
            ([{"seq": a, "tokens": [1, 2], "logits_at": 2}], "logits_at 2"),
            ([{"seq": a, "tokens": [1], "logits_at": 0}, {"seq": b, "tokens": [1, 2], "logits_at": 0}], "same number"),
            ([{"seq": a, "tokens": [1], "logits_at": 0}, {"seq": a, "tokens": [2], "logits_at": 0}], "twice"),
        ]
        for rows, says in bad:
            reply = send("forward", rows=rows)
            self.assertFalse(reply["ok"], rows)
            self.assertIn(says, reply["error"])
        self.assertEqual(send("stats")["stats"]["bytes_live"], 0, "nothing reached the engine")

    def test_logits_are_exact_float32_and_lengths_follow_the_rows(self):
        send, _ = session(Toy("batched"))
        a = send("create", masked_prefix=0)["seq"]
        reply = send("forward", rows=[{"seq": a, "tokens": [3, 4, 5], "logits_at": 2}])
        self.assertEqual(reply["lengths"], [3])
        self.assertEqual(reply["logits"]["shape"], [1, VOCAB])
        toy = Toy("alone")
        toy.vocab = VOCAB
        expected = toy.logits([3, 4, 5])
        # The same history fed whole gives the same logits, rounded to float32 once, exactly.
        self.assertEqual(decode_logits(reply["logits"])[0], decode_logits(encode_logits([expected]))[0])

    def test_trim_release_share_and_stats(self):
        send, _ = session(Toy("batched"))
        a = send("create", masked_prefix=0)["seq"]
        send("forward", rows=[{"seq": a, "tokens": [1, 2, 3, 4], "logits_at": 3}])
        trim = send("trim", seq=a, n=1)
        self.assertEqual((trim["removed"], trim["len"]), (1, 3))
        self.assertIn("integer >= 0", send("trim", seq=a, n=-1)["error"])
        shared = send("share_prefix", donor=a, rows=2)
        self.assertEqual(shared["mode"], "copy")
        stats = send("stats")["stats"]
        self.assertEqual(stats["sequences"], 2)
        self.assertEqual(stats["bytes_live"], 5 * 8)
        self.assertEqual(stats["counters"]["rows_copied"], 2)
        self.assertTrue(send("release", seq=a)["ok"])
        self.assertIn("no sequence", send("release", seq=a)["error"])
        self.assertEqual(send("stats")["stats"]["sequences"], 1)
        send("reset")
        self.assertEqual(send("stats")["stats"]["counters"]["forwards"], 0, "reset zeroes the counters")

    def test_unsupported_and_engine_failures_are_replies_not_crashes(self):
        class Broken(Engine):
            def describe(self):
                return {"vocab_size": VOCAB, "dtype": "float32", "capabilities": capabilities()}

            def create(self, masked_prefix):
                return 0

            def forward(self, rows):
                raise ZeroDivisionError("the kernel divided by zero")

            def trim(self, seq, n):
                return n + 1, 0

        send, _ = session(Broken())
        self.assertEqual(send("create", masked_prefix=0)["seq"], 0)
        reply = send("share_prefix", donor=0, rows=0)
        self.assertEqual((reply["ok"], reply.get("unsupported")), (False, True))
        self.assertIn("ZeroDivisionError", send("forward", rows=[{"seq": 0, "tokens": [1], "logits_at": 0}])["error"])
        self.assertIn("removed 2 rows when 1 were asked", send("trim", seq=0, n=1)["error"])
        self.assertIn("live", send("create", masked_prefix=0)["error"], "a reused id is refused")

    def test_counters_are_the_protocols_and_only_those_kept(self):
        self.assertEqual(counters(forwards=3, max_rows=None), {"forwards": 3})
        with self.assertRaises(ValueError):
            counters(forward=3)

    def test_serve_stops_at_shutdown(self):
        d = tempfile.mkdtemp()
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({"vocab_size": VOCAB}, f)
        lines = [
            json.dumps({"id": 0, "op": "hello", "protocol": 1, "model": d}),
            json.dumps({"id": 1, "op": "shutdown"}),
            json.dumps({"id": 2, "op": "reset"}),
        ]
        out = io.StringIO()
        Server(Toy("alone")).serve(io.StringIO("\n".join(lines) + "\n"), out)
        self.assertEqual([json.loads(l)["id"] for l in out.getvalue().splitlines()], [0, 1])


if __name__ == "__main__":
    unittest.main()
