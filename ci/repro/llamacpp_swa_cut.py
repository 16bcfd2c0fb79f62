"""llama.cpp (llama-cpp-python 0.3.36's vendored tree): a sliding-window model's sequence cut back
with llama_memory_seq_rm silently loses rows its window still needs.

    ci/llama-cpp ci/repro/llamacpp_swa_cut.py [GGUF]    (default: Gemma 3 270M with F32 weights,
                                                         made by ci/llama-cpp --setup gemma3)

An iSWA memory (llama-kv-cache-iswa.cpp: a base cache for the global layers, a window cache for
the sliding ones) keeps in its window cache only what a sequence's *next* token attends to:
llama_state_seq_get_data(ctx, seq) leaves out every cell outside the window of the sequence's
last position (llama_kv_cache::state_write, is_masked_swa), and with swa_full off find_slot
overwrites such cells once the window cache is full. Cut the sequence back (llama_memory_seq_rm,
p0 > 0) and its new last position's window reaches rows that are gone. seq_rm returns true, as
for a cut it can do, and llama_decode attends to what is left of the window, with no error or
warning; only llama_memory_seq_pos_min says so (llama-server checks it, server-context.cpp
pos_min_thold, and reprocesses the prompt). llama.h promises seq_rm "returns false if a partial
sequence cannot be removed", as recurrent memories do.

Everything in float32 (F32 weights, f32 K and V, flash attention off), so that a correct cut is
bit-identical to a fresh prefill and any difference is the missing rows. Measured (2 cores, a few
minutes):

    state of sequence  0 from 700 rows, seq_rm(599, -1) returned True: seq_pos_min 188 (position 599's window starts at 88); ... rel RMS 1.3e-02
    state of sequence -1 from 700 rows, seq_rm(599, -1) returned True: seq_pos_min 0 ...; ... rel RMS 0.0e+00
    swa_full on : 900 rows, seq_rm(500, -1) returned True: seq_pos_min 0 ...; ... rel RMS 0.0e+00
    swa_full off: 900 rows, seq_rm(500, -1) returned True: seq_pos_min 132 (position 500's window starts at 0); ... rel RMS 9.9e-02
"""

import ctypes
import os
import sys

import numpy as np

import llama_cpp as L

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
GGUF = sys.argv[1] if len(sys.argv) > 1 else os.path.join(ROOT, ".deps/gemma3-270m-1.0.0/gemma-3-270m-f32.gguf")

QUIET = L.llama_log_callback(lambda level, text, user: None)  # kept: ctypes frees a collected callback
L.llama_log_set(QUIET, None)
L.llama_backend_init()
mp = L.llama_model_default_params()
model = L.llama_model_load_from_file(GGUF.encode(), mp)
assert model, f"cannot load {GGUF}"
n_swa = L.llama_model_n_swa(model)
assert n_swa > 0, "not a sliding-window model"
vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))


def context(swa_full=True, ubatch=1024):
    p = L.llama_context_default_params()
    p.n_ctx = p.n_batch = 1024
    p.n_ubatch = ubatch
    p.n_seq_max = 1
    p.swa_full = swa_full
    p.flash_attn_type = 0
    p.type_k = p.type_v = 0  # f32
    p.n_threads = p.n_threads_batch = 2
    ctx = L.llama_init_from_model(model, p)
    assert ctx
    return ctx


batch = L.llama_batch_init(1024, 0, 1)


def decode(ctx, tokens, start):
    """Tokens at positions start.. of sequence 0; the last one's logits."""
    for i, t in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, start + i, 1
        batch.seq_id[i][0] = 0
        batch.logits[i] = i == len(tokens) - 1
    batch.n_tokens = len(tokens)
    assert L.llama_decode(ctx, batch) == 0
    return np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, len(tokens) - 1), shape=(vocab,)).copy()


def rel(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b**2)))


rng = np.random.default_rng(0)
ids = [2] + [int(t) for t in rng.integers(1000, 20000, 899)]
mem = lambda ctx: L.llama_get_memory(ctx)

print(f"{os.path.basename(GGUF)}: window {n_swa}")

# 1. A sequence state saved when the sequence was 700 rows long, restored and cut back to 599.
cut, tail = 599, [1000, 2000, 3000]
fresh = context()
ref = decode(fresh, ids[:cut] + tail, 0)
donor = context()
decode(donor, ids[:700], 0)
for which in (0, -1):
    n = L.llama_state_seq_get_size(donor, which)
    buf = (ctypes.c_uint8 * n)()
    assert L.llama_state_seq_get_data(donor, buf, n, which) == n
    ctx = context()
    assert L.llama_state_seq_set_data(ctx, buf, n, 0) == n
    ok = L.llama_memory_seq_rm(mem(ctx), 0, cut, -1)
    pos_min = L.llama_memory_seq_pos_min(mem(ctx), 0)
    got = decode(ctx, tail, cut)
    print(
        f"state of sequence {which:2d} from 700 rows, seq_rm({cut}, -1) returned {ok}: seq_pos_min {pos_min} "
        f"(position {cut}'s window starts at {max(0, cut - n_swa + 1)}); logits vs a fresh prefill: rel RMS {rel(got, ref):.1e}"
    )

# 2. One context, swa_full off (llama-server's default): 900 rows in ubatches of 64 leave a
#    window cache of 768 cells; a rollback to 500 rows needs rows it has overwritten.
for swa_full in (True, False):
    ctx = context(swa_full=swa_full, ubatch=64)
    decode(ctx, ids[:900], 0)
    ok = L.llama_memory_seq_rm(mem(ctx), 0, 500, -1)
    pos_min = L.llama_memory_seq_pos_min(mem(ctx), 0)
    got = decode(ctx, [1000], 500)
    fresh = context(swa_full=True, ubatch=64)
    decode(fresh, ids[:500], 0)
    ref = decode(fresh, [1000], 500)
    print(
        f"swa_full {'on ' if swa_full else 'off'}: 900 rows, seq_rm(500, -1) returned {ok}: seq_pos_min {pos_min} "
        f"(position 500's window starts at {max(0, 500 - n_swa + 1)}); logits vs a fresh prefill: rel RMS {rel(got, ref):.1e}"
    )
