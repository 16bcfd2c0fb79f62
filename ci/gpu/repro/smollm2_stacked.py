#!/usr/bin/env python3
"""SmolLM2-135M-Instruct (4-bit) greedy decode in ~100 lines of plain MLX, three ways:

  separate        q, k, v (and gate, up) each their own quantized matmul (mlx-lm's layout)
  stacked         q|k|v stacked into one quantized matmul and cut with mx.split, gate|up too
                  (parity's `Stacked`, src/model/layers.rs), then reshape + transpose + rope
  stacked-ropefix stacked, but the q and k pieces made contiguous (mx.contiguous) before rope

Same weights, same ops otherwise, float32 compute. On MLX's CPU backend all three give the same
tokens ("The capital of France is Paris, France."). On CUDA (mlx-cuda-13 0.32.2, H200) `separate`
and `stacked-ropefix` give those tokens too and `stacked` (parity's layout) gives garbage: the
RoPE of an `mx.split` output writes past its buffer (see rope_split.py; docs/gpu.md).

Usage: python3 smollm2_stacked.py CHECKPOINT_DIR [--device gpu|cpu] [--variant NAME ...]
       [--max-tokens 12] [--json out.json]
The prompt is the 37-token chat rendering of "What is the capital of France?" that parity
produces (`parity generate ... --chat --json`: prompt_ids), so no tokenizer package is needed;
output ids are decoded with the checkpoint's tokenizer.json (byte-level BPE).
Exit 77 with "SKIP(no-gpu)" when --device gpu is asked for and MLX has no GPU.
"""

import argparse
import json
import sys
import time

import mlx.core as mx

PROMPT_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
              19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
VARIANTS = ["separate", "stacked", "stacked-ropefix"]


def byte_decoder():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def detok(ckpt, ids):
    tj = json.load(open(f"{ckpt}/tokenizer.json"))
    inv = {v: k for k, v in tj["model"]["vocab"].items()}
    for t in tj.get("added_tokens", []):
        inv[t["id"]] = t["content"]
    bd = byte_decoder()
    out = bytearray()
    for i in ids:
        tok = inv.get(i, f"<{i}>")
        if all(c in bd for c in tok):
            out.extend(bd[c] for c in tok)
        else:
            out.extend(tok.encode())
    return out.decode("utf-8", errors="replace")


class Model:
    def __init__(self, ckpt, variant):
        cfg = json.load(open(f"{ckpt}/config.json"))
        self.c = cfg
        self.variant = variant
        self.q = cfg["quantization"]
        w = mx.load(f"{ckpt}/model.safetensors")
        # float32 compute, as parity's suites run it (scales, biases and norms cast at load)
        w = {n: (a if a.dtype == mx.uint32 else a.astype(mx.float32)) for n, a in w.items()}
        self.w = w
        self.H, self.K, self.D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.L = cfg["num_hidden_layers"]
        if variant.startswith("stacked"):
            for i in range(self.L):
                p = f"model.layers.{i}"
                for name, parts in (("self_attn.qkv", ["q", "k", "v"]), ("mlp.gate_up", ["gate", "up"])):
                    mod = name.split(".")[0]
                    for t in ("weight", "scales", "biases"):
                        w[f"{p}.{name}.{t}"] = mx.concatenate([w[f"{p}.{mod}.{x}_proj.{t}"] for x in parts], 0)
            mx.eval(w)

    def lin(self, x, path):
        w = self.w
        return mx.quantized_matmul(x, w[f"{path}.weight"], w[f"{path}.scales"], w[f"{path}.biases"],
                                   transpose=True, group_size=self.q["group_size"], bits=self.q["bits"])

    def forward(self, ids, cache):
        w, c = self.w, self.c
        H, K, D = self.H, self.K, self.D
        e = "model.embed_tokens"
        x = mx.dequantize(w[f"{e}.weight"][ids], w[f"{e}.scales"][ids], w[f"{e}.biases"][ids],
                          group_size=self.q["group_size"], bits=self.q["bits"])  # [1, T, hidden]
        B, T = ids.shape
        off = cache[0][0].shape[2] if cache[0] else 0
        for i in range(self.L):
            p = f"model.layers.{i}"
            h = mx.fast.rms_norm(x, w[f"{p}.input_layernorm.weight"], c["rms_norm_eps"])
            if self.variant == "separate":
                q, k, v = (self.lin(h, f"{p}.self_attn.{n}_proj") for n in "qkv")
            else:
                q, k, v = mx.split(self.lin(h, f"{p}.self_attn.qkv"), [H * D, (H + K) * D], axis=-1)
                if self.variant == "stacked-ropefix":
                    q, k = mx.contiguous(q), mx.contiguous(k)
            q = q.reshape(B, T, H, D).transpose(0, 2, 1, 3)
            k = k.reshape(B, T, K, D).transpose(0, 2, 1, 3)
            v = v.reshape(B, T, K, D).transpose(0, 2, 1, 3)
            # parity's batched attention: a [B] int32 offsets array
            offs = mx.array([off] * B, dtype=mx.int32)
            q = mx.fast.rope(q, D, traditional=False, base=c["rope_theta"], scale=1.0, offset=offs)
            k = mx.fast.rope(k, D, traditional=False, base=c["rope_theta"], scale=1.0, offset=offs)
            if cache[i]:
                k = mx.concatenate([cache[i][0], k], 2)
                v = mx.concatenate([cache[i][1], v], 2)
            cache[i] = (k, v)
            a = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask="causal" if T > 1 else None)
            a = a.transpose(0, 2, 1, 3).reshape(B, T, H * D)
            x = x + self.lin(a, f"{p}.self_attn.o_proj")
            h = mx.fast.rms_norm(x, w[f"{p}.post_attention_layernorm.weight"], c["rms_norm_eps"])
            if self.variant == "separate":
                g, u = self.lin(h, f"{p}.mlp.gate_proj"), self.lin(h, f"{p}.mlp.up_proj")
            else:
                g, u = mx.split(self.lin(h, f"{p}.mlp.gate_up"), 2, axis=-1)
            x = x + self.lin(mx.sigmoid(g) * g * u, f"{p}.mlp.down_proj")
        x = mx.fast.rms_norm(x[:, -1, :], w["model.norm.weight"], c["rms_norm_eps"])
        return self.lin(x, e)  # tied head


def generate(ckpt, variant, device, max_tokens):
    with mx.stream(device):
        m = Model(ckpt, variant)
        cache = [None] * m.L
        ids = mx.array([PROMPT_IDS], dtype=mx.int32)
        out = []
        t0 = time.time()
        for _ in range(max_tokens):
            logits = m.forward(ids, cache)
            nxt = mx.argmax(logits, axis=-1)
            tok = nxt.item()
            out.append(tok)
            if tok == 2:
                break
            ids = nxt.reshape(1, 1).astype(mx.int32)
        finite = bool(mx.isfinite(logits).all().item())
    return out, time.time() - t0, finite


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint")
    ap.add_argument("--device", action="append", choices=["cpu", "gpu"])
    ap.add_argument("--variant", action="append", choices=VARIANTS)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--json")
    a = ap.parse_args()
    devices = a.device or ["cpu", "gpu"]
    if "gpu" in devices and not (mx.cuda.is_available() or mx.metal.is_available()):
        print("SKIP(no-gpu): MLX sees no GPU; run with --device cpu for the CPU half")
        return 77
    results = []
    for dev in devices:
        for variant in a.variant or VARIANTS:
            try:
                ids, secs, finite = generate(a.checkpoint, variant, mx.gpu if dev == "gpu" else mx.cpu, a.max_tokens)
                r = {"device": dev, "variant": variant, "tokens": ids, "text": detok(a.checkpoint, ids),
                     "seconds": round(secs, 2), "last_logits_finite": finite}
            except Exception as e:
                r = {"device": dev, "variant": variant, "error": f"{type(e).__name__}: {e}"}
            results.append(r)
            print(f"{dev:3s} {variant:16s} " + (repr(r["text"]) if "text" in r else "ERROR " + r["error"]), flush=True)
    if a.json:
        json.dump({"mlx": mx.__version__, "prompt_ids": PROMPT_IDS, "results": results}, open(a.json, "w"), indent=1)
    ref = next((r.get("tokens") for r in results if r["device"] == "cpu" and r["variant"] == "separate"), None)
    if ref is None:
        return 0
    differ = [f"{r['device']}/{r['variant']}" for r in results if r.get("tokens") != ref]
    print("tokens as the CPU's separate: " + ("all" if not differ else "all but " + ", ".join(differ)))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
