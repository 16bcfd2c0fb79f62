"""Convert a Gemma 3 GGUF (llama.cpp's layout) into the checkpoint parity and mlx-lm load: a
Hugging Face config.json, model.safetensors (every weight dequantized to float32, exactly: a
quantized block is d * q (+ m), which float32 holds) and tokenizer.json, with PROVENANCE.json
saying what was done. Run by ci/gemma3-270m in its venv.

    python gguf_to_checkpoint.py MODEL.gguf OUT_DIR

What llama.cpp's conversion (conversion/gemma.py, Gemma3Model) did to the Hugging Face
checkpoint, undone here:
- every `*norm.weight` was shifted by +1 (Gemma3RMSNorm multiplies by 1 + w; ggml by w):
  1 is subtracted back;
- tensor names: llama.cpp's (`blk.N.attn_q`) back to Hugging Face's
  (`model.layers.N.self_attn.q_proj`).
What the GGUF does not carry is Gemma 3's, as llama.cpp also assumes it for this
architecture (models/gemma3.cpp, llama-hparams.h): one global layer in 6 (`sliding_window_pattern`), local RoPE
base 10000, no RoPE scaling on the 270M. The tokenizer is rebuilt from the GGUF's vocabulary
by transformers' GGUF tokenizer mapping, plus the BOS llama.cpp adds (its tokenization of
plain text, spaces, tabs, emoji and code matched this one token for token when written).
"""

import hashlib
import json
import os
import sys

import gguf
import numpy as np
from safetensors.numpy import save_file

NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def hf_name(name):
    if name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if name == "output_norm.weight":
        return "model.norm.weight"
    if name == "output.weight":
        return "lm_head.weight"
    parts = name.split(".")
    if parts[0] != "blk" or len(parts) != 4 or parts[3] != "weight" or parts[2] not in NAMES:
        sys.exit(f"unexpected GGUF tensor {name}")
    return f"model.layers.{parts[1]}.{NAMES[parts[2]]}.weight"


def field(reader, key, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def write_tokenizer(r, out):
    """tokenizer.json from the GGUF's vocabulary, by transformers' GGUF tokenizer mapping (its
    Gemma builder: merges rebuilt from the vocabulary's order, runs of spaces respelled), fed
    from gguf's reader: transformers' own GGUF reader needs PyTorch, its tokenizer mapping does
    not."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    d = {}
    for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
        f = r.fields.get("tokenizer." + key)
        if f is not None:
            v = f.contents()
            d[name] = list(v) if isinstance(v, (list, tuple)) else v
    backend, _ = convert_gguf_tokenizer("gemma3", d)
    tokens = d["tokens"]
    if field(r, "tokenizer.ggml.add_bos_token", True):
        # llama.cpp starts every text with BOS (add_bos_token); the mapping leaves that to a
        # Python tokenizer's setting, which parity's tokenizer.json reader never sees.
        from tokenizers import processors

        bos = tokens[d["bos_token_id"]]
        backend.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, d["bos_token_id"])]
        )
    backend.save(os.path.join(out, "tokenizer.json"))
    config = {
        "bos_token": tokens[d["bos_token_id"]],
        "eos_token": tokens[d["eos_token_id"]],
        "unk_token": tokens[d["unk_token_id"]],
        "pad_token": tokens[d["pad_token_id"]],
        "add_bos_token": bool(field(r, "tokenizer.ggml.add_bos_token", True)),
        "add_eos_token": bool(field(r, "tokenizer.ggml.add_eos_token", False)),
        "tokenizer_class": "GemmaTokenizer",
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def main():
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    r = gguf.GGUFReader(src)
    arch = field(r, "general.architecture")
    if arch != "gemma3":
        sys.exit(f"{src}: general.architecture is {arch!r}, this converter reads gemma3")

    tensors, kinds = {}, {}
    for t in r.tensors:
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        shape = [int(n) for n in reversed(t.shape)]
        w = w.reshape(shape)
        name = hf_name(t.name)
        if name.endswith("norm.weight"):
            w = w - np.float32(1.0)
        tensors[name] = np.ascontiguousarray(w)
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})

    p = "gemma3."
    head_dim = int(field(r, p + "attention.key_length"))
    vocab = len(r.fields["tokenizer.ggml.tokens"].data)
    if tensors["model.embed_tokens.weight"].shape[0] != vocab:
        sys.exit(f"embedding has {tensors['model.embed_tokens.weight'].shape[0]} rows, the vocabulary {vocab}")
    config = {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "hidden_size": int(field(r, p + "embedding_length")),
        "num_hidden_layers": int(field(r, p + "block_count")),
        "intermediate_size": int(field(r, p + "feed_forward_length")),
        "num_attention_heads": int(field(r, p + "attention.head_count")),
        "num_key_value_heads": int(field(r, p + "attention.head_count_kv")),
        "head_dim": head_dim,
        "vocab_size": vocab,
        "rms_norm_eps": float(np.float32(field(r, p + "attention.layer_norm_rms_epsilon"))),
        "rope_theta": float(field(r, p + "rope.freq_base")),
        "rope_local_base_freq": 10000.0,
        "sliding_window": int(field(r, p + "attention.sliding_window")),
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": head_dim,
        "max_position_embeddings": int(field(r, p + "context_length")),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": int(field(r, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(field(r, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(field(r, "tokenizer.ggml.padding_token_id")),
        "torch_dtype": "float32",
    }
    if any(k.startswith(p + "rope.scaling") for k in r.fields):
        sys.exit(f"{src} carries RoPE scaling; this converter writes none")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    write_tokenizer(r, out)

    digest = hashlib.sha256()
    with open(src, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    provenance = {
        "source": os.path.basename(src),
        "source_sha256": digest.hexdigest(),
        "gguf_package": gguf.__version__ if hasattr(gguf, "__version__") else "gguf",
        "general.name": field(r, "general.name"),
        "general.license": field(r, "general.license"),
        "stored_types": kinds,
        "weights": "every tensor dequantized to float32 by gguf.quants.dequantize; norm weights minus 1",
        "assumed": {"sliding_window_pattern": 6, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": head_dim},
        "tokenizer": "transformers' GGUF tokenizer mapping (convert_gguf_tokenizer, gemma3) on the GGUF's vocabulary",
    }
    with open(os.path.join(out, "PROVENANCE.json"), "w") as f:
        json.dump(provenance, f, indent=2)
    print(f"{out}: {len(tensors)} tensors ({kinds}), vocab {vocab}")


if __name__ == "__main__":
    main()
