//! `config.json` for the supported families. Parsed by hand from a JSON value rather than with
//! serde derive so that every error names the field and what was expected of it.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;
use serde_json::Value;

use crate::error::{Error, Result};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama 3.x, SmolLM2 and other `LlamaForCausalLM` checkpoints.
    Llama,
    /// Qwen3: per-head RMSNorm on q and k before RoPE, tied embeddings by default.
    Qwen3,
    /// Gemma 3 (text): sliding-window layers interleaved with global ones, each kind with its
    /// own RoPE base; `(1 + w)` RMSNorms, four per block; a scaled embedding; GELU MLP.
    Gemma3,
}

pub const SUPPORTED_MODEL_TYPES: &[&str] = &["llama", "qwen3", "gemma3_text"];

impl Arch {
    pub fn name(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3_text",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "lowercase")]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1+ frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position_embeddings: f32,
    },
}

/// Affine quantization of one linear or embedding (MLX layout: packed uint32 `weight`,
/// `scales`, `biases`, one scale and bias per `group_size` inputs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct QuantSpec {
    pub group_size: usize,
    pub bits: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Quantization {
    pub default: QuantSpec,
    /// mlx-lm writes per-module entries (`"model.layers.0.mlp.down_proj": {...}` or `false`)
    /// next to the defaults for mixed-precision conversions.
    pub overrides: BTreeMap<String, Option<QuantSpec>>,
}

impl Quantization {
    /// The spec for module `path` (e.g. `model.layers.3.self_attn.q_proj`), or `None` if that
    /// module is stored unquantized.
    pub fn for_module(&self, path: &str) -> Option<QuantSpec> {
        match self.overrides.get(path) {
            Some(o) => *o,
            None => Some(self.default),
        }
    }
}

/// Local attention: layer `i` sees only the last `size` positions unless `(i + 1) % pattern == 0`
/// (a global layer), as mlx-lm's gemma3_text counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct SlidingWindow {
    pub size: usize,
    pub pattern: usize,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelConfig {
    pub arch: Arch,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_traditional: bool,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    /// `None` when config.json does not say; the loader then ties unless `lm_head` exists.
    pub tie_word_embeddings: Option<bool>,
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub quantization: Option<Quantization>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
    /// Gemma 3: which layers attend locally, and how far.
    pub sliding_window: Option<SlidingWindow>,
    /// Gemma 3: the RoPE base of the sliding layers (the global ones use `rope_theta`).
    pub rope_local_theta: Option<f32>,
    /// Gemma 3: attention scores are scaled by `query_pre_attn_scalar^-0.5`, not `head_dim`'s.
    pub query_pre_attn_scalar: Option<f32>,
}

struct Fields<'a> {
    file: &'a Path,
    obj: &'a serde_json::Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn err(&self, field: &str, msg: impl std::fmt::Display) -> Error {
        Error::config(self.file, format!("field `{field}`: {msg}"))
    }
    fn get(&self, field: &str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }
    fn usize_opt(&self, field: &str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                // MLX shapes are int32: a larger size cannot be a tensor dimension.
                Some(n) if n > 0 && n <= i32::MAX as u64 => Ok(Some(n as usize)),
                Some(n) if n > 0 => {
                    Err(self.err(field, format!("{n} is larger than any tensor dimension MLX can hold ({})", i32::MAX)))
                }
                _ => Err(self.err(field, format!("expected a positive integer, found {v}"))),
            },
        }
    }
    fn usize(&self, field: &str) -> Result<usize> {
        self.usize_opt(field)?.ok_or_else(|| self.err(field, "missing"))
    }
    /// A positive number that fits an f32. Epsilons, RoPE bases and scaling factors are all
    /// strictly positive; found by fuzzing (fuzz/regressions/config/): an eps of 0 or below, or
    /// a theta of 1e300 (finite as f64, infinite as f32), was accepted and every logit became
    /// NaN at run time.
    fn f32_or(&self, field: &str, default: f32) -> Result<f32> {
        match self.get(field) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .map(|x| x as f32)
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| self.err(field, format!("expected a positive number within f32 range, found {v}"))),
        }
    }
    fn bool_opt(&self, field: &str) -> Result<Option<bool>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(field, format!("expected true or false, found {v}"))),
        }
    }
    fn token_ids(&self, field: &str) -> Result<Vec<u32>> {
        let as_id = |v: &Value| v.as_u64().and_then(|n| u32::try_from(n).ok());
        match self.get(field) {
            None => Ok(vec![]),
            Some(Value::Array(items)) => {
                items.iter().map(|v| as_id(v).ok_or_else(|| self.err(field, format!("not a token id: {v}")))).collect()
            }
            Some(v) => as_id(v).map(|id| vec![id]).ok_or_else(|| self.err(field, format!("not a token id: {v}"))),
        }
    }
}

impl ModelConfig {
    /// How many positions layer `layer` attends to (`None`: every position).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        self.sliding_window.filter(|w| !(layer + 1).is_multiple_of(w.pattern)).map(|w| w.size)
    }

    pub fn load(dir: &Path) -> Result<Self> {
        let file = dir.join("config.json");
        let text = std::fs::read_to_string(&file).map_err(|e| Error::io(&file, e))?;
        Self::parse(&file, &text)
    }

    pub fn parse(file: &Path, text: &str) -> Result<Self> {
        let value: Value =
            serde_json::from_str(text).map_err(|e| Error::config(file, format!("not valid JSON: {e}")))?;
        let obj = value.as_object().ok_or_else(|| Error::config(file, "expected a JSON object at the top level"))?;
        let f = Fields { file, obj };

        let model_type = f
            .get("model_type")
            .ok_or_else(|| f.err("model_type", "missing"))?
            .as_str()
            .ok_or_else(|| f.err("model_type", "expected a string"))?;
        let arch = match model_type {
            "llama" => Arch::Llama,
            "qwen3" => Arch::Qwen3,
            "gemma3_text" => Arch::Gemma3,
            other => {
                return Err(f.err(
                    "model_type",
                    format!("unsupported model_type `{other}`; supported: {}", SUPPORTED_MODEL_TYPES.join(", ")),
                ));
            }
        };

        let hidden_size = f.usize("hidden_size")?;
        let num_heads = f.usize("num_attention_heads")?;
        let num_kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(num_heads);
        if num_heads % num_kv_heads != 0 {
            return Err(f.err(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide num_attention_heads = {num_heads}"),
            ));
        }
        let head_dim = match f.usize_opt("head_dim")? {
            Some(d) => d,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(f.err("head_dim", "missing and hidden_size is not a multiple of num_attention_heads"));
            }
        };
        if head_dim % 2 != 0 {
            return Err(f.err("head_dim", format!("{head_dim} is odd; RoPE needs an even head_dim")));
        }

        let default_theta = match arch {
            Arch::Llama => 10_000.0,
            Arch::Qwen3 | Arch::Gemma3 => 1_000_000.0,
        };
        let num_layers = f.usize("num_hidden_layers")?;
        let (sliding_window, rope_local_theta, query_pre_attn_scalar) = match arch {
            Arch::Gemma3 => {
                let window = SlidingWindow {
                    size: f.usize_opt("sliding_window")?.unwrap_or(512),
                    pattern: f.usize_opt("sliding_window_pattern")?.unwrap_or(6),
                };
                check_layer_types(&f, window, num_layers)?;
                (
                    Some(window),
                    Some(f.f32_or("rope_local_base_freq", 10_000.0)?),
                    Some(f.f32_or("query_pre_attn_scalar", 256.0)?),
                )
            }
            Arch::Llama | Arch::Qwen3 => (None, None, None),
        };
        let rope_scaling = parse_rope_scaling(&f)?;
        let quantization = parse_quantization(&f)?;

        Ok(ModelConfig {
            arch,
            hidden_size,
            num_layers,
            intermediate_size: f.usize("intermediate_size")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: f.usize("vocab_size")?,
            rms_norm_eps: f.f32_or("rms_norm_eps", 1e-6)?,
            rope_theta: f.f32_or("rope_theta", default_theta)?,
            rope_traditional: f.bool_opt("rope_traditional")?.unwrap_or(false),
            rope_scaling,
            max_position_embeddings: f.usize_opt("max_position_embeddings")?.unwrap_or(131_072),
            tie_word_embeddings: f.bool_opt("tie_word_embeddings")?,
            attention_bias: f.bool_opt("attention_bias")?.unwrap_or(false),
            mlp_bias: f.bool_opt("mlp_bias")?.unwrap_or(false),
            quantization,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
            pad_token_id: f.token_ids("pad_token_id")?.first().copied(),
            sliding_window,
            rope_local_theta,
            query_pre_attn_scalar,
        })
    }
}

/// Transformers' Gemma 3 configs also list `layer_types`; mlx-lm reads only the pattern. A
/// list that disagrees with the pattern would make the two run different models, so it is an
/// error here, naming the first layer where they part.
fn check_layer_types(f: &Fields, w: SlidingWindow, layers: usize) -> Result<()> {
    let Some(v) = f.get("layer_types") else { return Ok(()) };
    let kinds = v.as_array().ok_or_else(|| f.err("layer_types", "expected an array of strings"))?;
    if kinds.len() != layers {
        return Err(f.err("layer_types", format!("{} entries for {layers} layers", kinds.len())));
    }
    for (i, kind) in kinds.iter().enumerate() {
        let sliding = match kind.as_str() {
            Some("sliding_attention") => true,
            Some("full_attention") => false,
            _ => {
                return Err(f.err(
                    "layer_types",
                    format!("entry {i}: expected sliding_attention or full_attention, found {kind}"),
                ));
            }
        };
        if sliding == (i + 1).is_multiple_of(w.pattern) {
            return Err(f.err(
                "layer_types",
                format!("layer {i} is {kind}, but sliding_window_pattern = {} makes it the other kind", w.pattern),
            ));
        }
    }
    Ok(())
}

fn parse_rope_scaling(f: &Fields) -> Result<RopeScaling> {
    let Some(v) = f.get("rope_scaling") else {
        return Ok(RopeScaling::None);
    };
    let obj = v.as_object().ok_or_else(|| f.err("rope_scaling", "expected an object"))?;
    let sub = Fields { file: f.file, obj };
    let kind = sub
        .get("rope_type")
        .or_else(|| sub.get("type"))
        .and_then(Value::as_str)
        .ok_or_else(|| f.err("rope_scaling.rope_type", "missing"))?;
    let factor = sub.f32_or("factor", 1.0)?;
    match kind {
        "default" => Ok(RopeScaling::None),
        "linear" => Ok(RopeScaling::Linear { factor }),
        "llama3" => Ok(RopeScaling::Llama3 {
            factor,
            low_freq_factor: sub.f32_or("low_freq_factor", 1.0)?,
            high_freq_factor: sub.f32_or("high_freq_factor", 4.0)?,
            original_max_position_embeddings: sub.f32_or("original_max_position_embeddings", 8192.0)?,
        }),
        other => {
            Err(f.err("rope_scaling.rope_type", format!("unsupported `{other}`; supported: default, linear, llama3")))
        }
    }
}

fn parse_quant_spec(f: &Fields, field: &str, v: &Value) -> Result<QuantSpec> {
    let obj = v.as_object().ok_or_else(|| f.err(field, "expected an object"))?;
    let sub = Fields { file: f.file, obj };
    let group_size = sub
        .usize("group_size")
        .map_err(|_| f.err(&format!("{field}.group_size"), "missing or not a positive integer"))?;
    let bits = sub.usize("bits").map_err(|_| f.err(&format!("{field}.bits"), "missing or not a positive integer"))?;
    if let Some(mode) = sub.get("mode").and_then(Value::as_str)
        && mode != "affine"
    {
        return Err(f.err(&format!("{field}.mode"), format!("unsupported `{mode}`; only affine")));
    }
    if ![2, 3, 4, 5, 6, 8].contains(&bits) {
        return Err(f.err(&format!("{field}.bits"), format!("unsupported {bits}; MLX affine supports 2,3,4,5,6,8")));
    }
    if ![32, 64, 128].contains(&group_size) {
        return Err(f.err(&format!("{field}.group_size"), format!("unsupported {group_size}; expected 32, 64 or 128")));
    }
    Ok(QuantSpec { group_size, bits })
}

fn parse_quantization(f: &Fields) -> Result<Option<Quantization>> {
    let Some(v) = f.get("quantization").or_else(|| f.get("quantization_config")) else {
        return Ok(None);
    };
    let default = parse_quant_spec(f, "quantization", v)?;
    let mut overrides = BTreeMap::new();
    if let Some(obj) = v.as_object() {
        for (key, val) in obj {
            match val {
                Value::Bool(false) => {
                    overrides.insert(key.clone(), None);
                }
                Value::Object(_) => {
                    let spec = parse_quant_spec(f, &format!("quantization.{key}"), val)?;
                    overrides.insert(key.clone(), Some(spec));
                }
                _ => {}
            }
        }
    }
    Ok(Some(Quantization { default, overrides }))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GEMMA: &str = r#"{"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 128, "num_hidden_layers": 4,
        "vocab_size": 320, "sliding_window": 10, "sliding_window_pattern": 2 LAYER_TYPES}"#;

    fn parse(layer_types: &str) -> Result<ModelConfig> {
        ModelConfig::parse(Path::new("config.json"), &GEMMA.replace("LAYER_TYPES", layer_types))
    }

    #[test]
    fn gemma3_windows_follow_the_pattern_as_mlx_lm_counts_it() {
        let c = parse("").unwrap();
        let windows: Vec<_> = (0..4).map(|l| c.layer_window(l)).collect();
        assert_eq!(windows, [Some(10), None, Some(10), None]);
        assert_eq!((c.rope_local_theta, c.query_pre_attn_scalar, c.rope_theta), (Some(10_000.0), Some(256.0), 1e6));
        let agreeing =
            r#", "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]"#;
        assert_eq!(parse(agreeing).unwrap(), c);
    }

    /// mlx-lm reads only the pattern: a `layer_types` list that disagrees would have parity and
    /// mlx-lm run two different models under one name.
    #[test]
    fn layer_types_that_disagree_with_the_pattern_are_refused() {
        let swapped =
            r#", "layer_types": ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]"#;
        let e = parse(swapped).unwrap_err().to_string();
        assert!(e.contains("layer_types") && e.contains("layer 0"), "{e}");
        let short = r#", "layer_types": ["sliding_attention"]"#;
        assert!(parse(short).unwrap_err().to_string().contains("1 entries for 4 layers"));
    }
}
