//! Tiny random-weight checkpoints, generated deterministically from a committed spec
//! (`fixtures/*.toml`), so tests and the fixture suite run in seconds with no network and no
//! large files in git.
//!
//! Determinism across machines: weights come from a seeded splitmix64 stream turned into
//! approximately normal values with integer arithmetic and additions only (no libm
//! transcendental functions, whose last bits vary by platform), and quantization is done on
//! the host in Rust, not by MLX, so macOS and Linux generate byte-identical files.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::json;

use crate::error::{Error, Result};
use crate::rng::{Rng, hash};

/// Bump when the generator's output changes for the same spec.
const GENERATOR_VERSION: u32 = 3;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureSpec {
    pub model_type: String,
    pub seed: u64,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub intermediate_size: usize,
    #[serde(default = "default_vocab")]
    pub vocab_size: usize,
    #[serde(default = "default_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub rope_scaling: Option<toml::Table>,
    #[serde(default = "default_ctx")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Storage dtype of float tensors: "float32" or "bfloat16".
    #[serde(default = "default_dtype")]
    pub dtype: String,
    /// Affine quantization of every linear and the embedding.
    #[serde(default)]
    pub quantization: Option<FixtureQuant>,
    /// Standard deviation of the output logits; large enough that greedy choices are not
    /// near-ties by accident.
    #[serde(default = "default_logit_scale")]
    pub logit_scale: f64,
    /// gemma3_text: positions a sliding layer attends to, and every how many layers one is
    /// global.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    #[serde(default)]
    pub sliding_window_pattern: Option<usize>,
    #[serde(default)]
    pub rope_local_base_freq: Option<f64>,
    #[serde(default)]
    pub query_pre_attn_scalar: Option<usize>,
}

#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FixtureQuant {
    pub group_size: usize,
    pub bits: usize,
}

fn default_vocab() -> usize {
    320
}
fn default_theta() -> f64 {
    10_000.0
}
fn default_ctx() -> usize {
    2048
}
fn default_dtype() -> String {
    "float32".into()
}
fn default_logit_scale() -> f64 {
    6.0
}

/// Special tokens of the fixture tokenizer, after the 256 byte tokens.
pub const ENDOFTEXT: u32 = 256;
pub const IM_START: u32 = 257;
pub const IM_END: u32 = 258;

/// Generate (once) the checkpoint described by `spec_path` and return its directory,
/// `<spec dir>/.generated/<stem>-<hash>/`.
pub fn materialize(spec_path: &Path) -> Result<PathBuf> {
    let text = std::fs::read_to_string(spec_path).map_err(|e| Error::io(spec_path, e))?;
    let spec: FixtureSpec = toml::from_str(&text).map_err(|e| Error::config(spec_path, e.to_string()))?;
    validate(&spec, spec_path)?;
    let stem = spec_path.file_stem().and_then(|s| s.to_str()).unwrap_or("fixture");
    let hash = hash(format!("{GENERATOR_VERSION}\n{text}").as_bytes());
    let base = spec_path.parent().unwrap_or(Path::new(".")).join(".generated");
    let dir = base.join(format!("{stem}-{hash:016x}"));
    if dir.join("config.json").is_file() {
        return Ok(dir);
    }
    // Unique per thread too: tests generate the same fixture from several threads of one
    // process, and a shared scratch directory was deleted under another thread's feet.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = base.join(format!(".tmp-{stem}-{}-{n}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    write_checkpoint(&spec, &tmp)?;
    // Another process may have won the race; either copy is identical.
    if std::fs::rename(&tmp, &dir).is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(dir)
}

fn validate(s: &FixtureSpec, file: &Path) -> Result<()> {
    let err = |m: String| Err(Error::config(file, m));
    if !["llama", "qwen3", "gemma3_text"].contains(&s.model_type.as_str()) {
        return err(format!("field `model_type`: unsupported `{}`", s.model_type));
    }
    let windowed = s.sliding_window.is_some() || s.sliding_window_pattern.is_some() || s.rope_local_base_freq.is_some();
    if windowed && s.model_type != "gemma3_text" {
        return err("fields `sliding_window*`, `rope_local_base_freq`: only for model_type gemma3_text".into());
    }
    if s.vocab_size < 259 {
        return err("field `vocab_size`: must be at least 259 (256 bytes + 3 special tokens)".into());
    }
    if !s.num_attention_heads.is_multiple_of(s.num_key_value_heads) {
        return err("field `num_key_value_heads`: must divide num_attention_heads".into());
    }
    if !["float32", "bfloat16"].contains(&s.dtype.as_str()) {
        return err(format!("field `dtype`: `{}`; expected float32 or bfloat16", s.dtype));
    }
    if let Some(q) = s.quantization {
        let dims = [s.hidden_size, s.intermediate_size, s.num_attention_heads * s.head_dim];
        if dims.iter().any(|d| d % q.group_size != 0) || 32 % q.bits != 0 {
            return err(
                "field `quantization`: group_size must divide every input dimension and bits must divide 32".into()
            );
        }
    }
    Ok(())
}

/// `n` values of N(0, `std`).
fn tensor(rng: &mut Rng, n: usize, std: f64) -> Vec<f32> {
    (0..n).map(|_| rng.normal() * std as f32).collect()
}

struct Tensor {
    dtype: safetensors::Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

struct Writer<'a> {
    spec: &'a FixtureSpec,
    tensors: BTreeMap<String, Tensor>,
}

impl Writer<'_> {
    fn float(&mut self, name: &str, shape: &[usize], data: &[f32]) {
        let (dtype, bytes) = if self.spec.dtype == "bfloat16" {
            let b = data.iter().flat_map(|&x| half::bf16::from_f32(x).to_bits().to_le_bytes()).collect();
            (safetensors::Dtype::BF16, b)
        } else {
            (safetensors::Dtype::F32, data.iter().flat_map(|x| x.to_le_bytes()).collect())
        };
        self.tensors.insert(name.to_string(), Tensor { dtype, shape: shape.to_vec(), bytes });
    }

    /// A `[rows, cols]` matrix, quantized when the spec says so (MLX affine layout: values
    /// packed LSB-first into uint32, one scale and bias per group).
    fn matrix(&mut self, path: &str, rows: usize, cols: usize, data: &[f32]) {
        let Some(q) = self.spec.quantization else {
            self.float(&format!("{path}.weight"), &[rows, cols], data);
            return;
        };
        let levels = ((1u32 << q.bits) - 1) as f32;
        let per_word = 32 / q.bits;
        let groups = cols / q.group_size;
        let mut packed = vec![0u32; rows * cols / per_word];
        let mut scales = Vec::with_capacity(rows * groups);
        let mut biases = Vec::with_capacity(rows * groups);
        for r in 0..rows {
            for g in 0..groups {
                let start = r * cols + g * q.group_size;
                let group = &data[start..start + q.group_size];
                let lo = group.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = group.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let scale = if hi > lo { (hi - lo) / levels } else { 1.0 };
                // Round scale and bias to the stored dtype first so dequantization sees
                // exactly what the file holds.
                let (scale, bias) = (self.round(scale), self.round(lo));
                scales.push(scale);
                biases.push(bias);
                for (i, &x) in group.iter().enumerate() {
                    let v = ((x - bias) / scale).round().clamp(0.0, levels) as u32;
                    let idx = start + i;
                    packed[idx / per_word] |= v << ((idx % per_word) * q.bits);
                }
            }
        }
        let bytes = packed.iter().flat_map(|x| x.to_le_bytes()).collect();
        self.tensors.insert(
            format!("{path}.weight"),
            Tensor { dtype: safetensors::Dtype::U32, shape: vec![rows, cols / per_word], bytes },
        );
        self.float(&format!("{path}.scales"), &[rows, groups], &scales);
        self.float(&format!("{path}.biases"), &[rows, groups], &biases);
    }

    fn round(&self, x: f32) -> f32 {
        if self.spec.dtype == "bfloat16" { half::bf16::from_f32(x).to_f32() } else { x }
    }
}

fn write_checkpoint(spec: &FixtureSpec, dir: &Path) -> Result<()> {
    let mut rng = Rng::new(spec.seed);
    let mut w = Writer { spec, tensors: BTreeMap::new() };
    let (h, v, i) = (spec.hidden_size, spec.vocab_size, spec.intermediate_size);
    let (nh, nkv, d) = (spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim);
    let inv = |n: usize| 1.0 / (n as f64).sqrt();

    // A tied embedding is also the output projection: a large one makes the model echo its
    // last input token. Small embeddings let the (context-dependent) residual branches decide.
    // The final norm's gain then restores a logit spread of about `logit_scale`.
    // Gemma multiplies the embedding by sqrt(hidden) on the way in: stored that much smaller,
    // it enters the residual stream as large as the others' does.
    let gemma = spec.model_type == "gemma3_text";
    let embed_std = if spec.tie_word_embeddings { 0.1 } else { 1.0 } / if gemma { (h as f64).sqrt() } else { 1.0 };
    let embed = tensor(&mut rng, v * h, embed_std);
    w.matrix("model.embed_tokens", v, h, &embed);
    // Gemma stores a norm's gain as its offset from 1 (the norm multiplies by 1 + w).
    let stored = |g: f32| if gemma { g - 1.0 } else { g };
    let gains = |rng: &mut Rng, n: usize| -> Vec<f32> { (0..n).map(|_| 1.0 + 0.1 * rng.normal()).collect() };
    let norm = |rng: &mut Rng, n: usize| -> Vec<f32> { gains(rng, n).into_iter().map(stored).collect() };
    for l in 0..spec.num_hidden_layers {
        let p = format!("model.layers.{l}");
        let norms: &[&str] = if gemma {
            &["input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm"]
        } else {
            &["input_layernorm", "post_attention_layernorm"]
        };
        for name in norms {
            let x = norm(&mut rng, h);
            w.float(&format!("{p}.{name}.weight"), &[h], &x);
        }
        // Gains: sharp attention (q, k) and residual branches (o, down) that outweigh the
        // token embedding, so outputs depend on context and position. With unit gains a tied
        // model mostly repeats its last input token and is blind to KV bugs.
        for (name, rows, cols, gain) in [
            ("q_proj", nh * d, h, 2.0),
            ("k_proj", nkv * d, h, 2.0),
            ("v_proj", nkv * d, h, 1.0),
            ("o_proj", h, nh * d, 3.0),
        ] {
            let x = tensor(&mut rng, rows * cols, gain * inv(cols));
            w.matrix(&format!("{p}.self_attn.{name}"), rows, cols, &x);
        }
        if spec.model_type != "llama" {
            let x = norm(&mut rng, d);
            w.float(&format!("{p}.self_attn.q_norm.weight"), &[d], &x);
            let x = norm(&mut rng, d);
            w.float(&format!("{p}.self_attn.k_norm.weight"), &[d], &x);
        }
        for (name, rows, cols, gain) in [("gate_proj", i, h, 1.0), ("up_proj", i, h, 1.0), ("down_proj", h, i, 3.0)] {
            let x = tensor(&mut rng, rows * cols, gain * inv(cols));
            w.matrix(&format!("{p}.mlp.{name}"), rows, cols, &x);
        }
    }
    let gain = if spec.tie_word_embeddings { spec.logit_scale / (embed_std * (h as f64).sqrt()) } else { 1.0 };
    let x: Vec<f32> = gains(&mut rng, h).into_iter().map(|g| stored(g * gain as f32)).collect();
    w.float("model.norm.weight", &[h], &x);
    if !spec.tie_word_embeddings {
        let x = tensor(&mut rng, v * h, spec.logit_scale * inv(h));
        w.matrix("lm_head", v, h, &x);
    }

    let views: Vec<(String, safetensors::tensor::TensorView)> = w
        .tensors
        .iter()
        .map(|(name, t)| {
            safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.bytes)
                .map(|view| (name.clone(), view))
                .map_err(|e| Error::Invalid(format!("fixture tensor {name}: {e}")))
        })
        .collect::<Result<_>>()?;
    let file = dir.join("model.safetensors");
    let bytes = safetensors::tensor::serialize(views, None)
        .map_err(|e| Error::Invalid(format!("fixture serialisation: {e}")))?;
    write(&file, &bytes)?;

    let mut config = json!({
        "architectures": [match spec.model_type.as_str() {
            "qwen3" => "Qwen3ForCausalLM",
            "gemma3_text" => "Gemma3ForCausalLM",
            _ => "LlamaForCausalLM",
        }],
        "model_type": spec.model_type,
        "hidden_size": h,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": d,
        "intermediate_size": i,
        "vocab_size": v,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": IM_START,
        "eos_token_id": IM_END,
        "pad_token_id": ENDOFTEXT,
        "torch_dtype": spec.dtype,
    });
    if let Some(rs) = &spec.rope_scaling {
        config["rope_scaling"] = serde_json::to_value(rs).map_err(|e| Error::Invalid(e.to_string()))?;
    }
    for (key, value) in [
        ("sliding_window", spec.sliding_window.map(|x| json!(x))),
        ("sliding_window_pattern", spec.sliding_window_pattern.map(|x| json!(x))),
        ("rope_local_base_freq", spec.rope_local_base_freq.map(|x| json!(x))),
        ("query_pre_attn_scalar", spec.query_pre_attn_scalar.map(|x| json!(x))),
    ] {
        if let Some(v) = value {
            config[key] = v;
        }
    }
    if let Some(q) = spec.quantization {
        config["quantization"] = json!({"group_size": q.group_size, "bits": q.bits, "mode": "affine"});
    }
    write(&dir.join("config.json"), serde_json::to_string_pretty(&config).unwrap_or_default().as_bytes())?;
    write(&dir.join("tokenizer.json"), tokenizer_json().as_bytes())?;
    write(
        &dir.join("tokenizer_config.json"),
        json!({
            "bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        })
        .to_string()
        .as_bytes(),
    )?;
    write(&dir.join("chat_template.jinja"), CHAT_TEMPLATE.as_bytes())?;
    Ok(())
}

fn write(path: &Path, bytes: &[u8]) -> Result<()> {
    std::fs::write(path, bytes).map_err(|e| Error::io(path, e))
}

const CHAT_TEMPLATE: &str = "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// GPT-2's reversible byte-to-character map used by byte-level BPE: printable bytes map to
/// themselves, the rest to code points from 256 up.
fn byte_chars() -> Vec<char> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut extra = 0;
    (0..256u32)
        .map(|b| {
            if printable(b) {
                char::from_u32(b).unwrap_or('?')
            } else {
                extra += 1;
                char::from_u32(255 + extra).unwrap_or('?')
            }
        })
        .collect()
}

/// A byte-level BPE tokenizer with no merges: one token per byte, plus three special tokens.
/// Prompt lengths in tokens are then exactly their byte lengths, which lets suites hit block
/// and tile boundaries with plain text.
fn tokenizer_json() -> String {
    let vocab: serde_json::Map<String, serde_json::Value> =
        byte_chars().into_iter().enumerate().map(|(i, c)| (c.to_string(), json!(i))).collect();
    let special = |id: u32, content: &str| json!({"id": id, "content": content, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true});
    json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [special(ENDOFTEXT, "<|endoftext|>"), special(IM_START, "<|im_start|>"), special(IM_END, "<|im_end|>")],
        "normalizer": null,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "post_processor": null,
        "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                  "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                  "vocab": vocab, "merges": []}
    })
    .to_string()
}
