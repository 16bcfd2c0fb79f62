//! Rotary position embedding.
//!
//! Regression guard (RoPE stride aliasing): a batched decode tensor `[B, H, 1, D]` must never
//! be rotated with a single scalar offset. MLX's rope treats axis -2 as the sequence axis; a
//! "uniform offsets" fast path over the transposed `[B, 1, H, D]` layout once rotated row b at
//! `offset + b`. Batched attention rotates the batch in one call with an array of per-row
//! offsets ([`Rope::apply_batch`], MLX's rope with a `[B]` offset array: row b's position t is
//! `offsets[b] + t`); row-by-row attention calls [`Rope::apply`] on one row at a time. The
//! planted fault `rope-batch-alias` reproduces the bug in [`Rope::apply_batch_aliased`].

use mlx_rs::Array;

use crate::checkpoint::{ModelConfig, RopeScaling};
use crate::error::{Error, Result};

/// One RoPE per kind of layer: the global one, and the sliding layers' own where the family
/// has one.
pub struct Ropes {
    global: Rope,
    local: Option<Rope>,
}

impl Ropes {
    pub fn new(cfg: &ModelConfig) -> Result<Self> {
        Ok(Ropes { global: Rope::new(cfg)?, local: Rope::local(cfg) })
    }

    /// The RoPE of a layer that is windowed (`sliding`) or not.
    pub fn for_layer(&self, sliding: bool) -> &Rope {
        match (&self.local, sliding) {
            (Some(local), true) => local,
            _ => &self.global,
        }
    }
}

pub struct Rope {
    dims: i32,
    traditional: bool,
    base: Option<f32>,
    scale: f32,
    /// Llama 3 scaling: per-frequency periods passed to MLX instead of `base`.
    freqs: Option<Array>,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> Result<Self> {
        let dims = cfg.head_dim as i32;
        let base = cfg.rope_theta;
        let (base, scale, freqs) = match cfg.rope_scaling {
            RopeScaling::None => (Some(base), 1.0, None),
            RopeScaling::Linear { factor } => (Some(base), 1.0 / factor, None),
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } => {
                let periods = llama3_periods(
                    cfg.head_dim,
                    base,
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                );
                (None, 1.0, Some(Array::from_slice(&periods, &[periods.len() as i32])))
            }
        };
        Ok(Rope { dims, traditional: cfg.rope_traditional, base, scale, freqs })
    }

    /// The sliding-window layers' RoPE where the family gives them their own base (Gemma 3:
    /// `rope_local_base_freq`, never scaled, as in mlx-lm's gemma3_text).
    fn local(cfg: &ModelConfig) -> Option<Self> {
        cfg.rope_local_theta.map(|base| Rope {
            dims: cfg.head_dim as i32,
            traditional: cfg.rope_traditional,
            base: Some(base),
            scale: 1.0,
            freqs: None,
        })
    }

    /// Rotate `x` (`[1, H, T, D]`, one sequence) whose first row sits at `offset`.
    pub fn apply(&self, x: &Array, offset: i32) -> Result<Array> {
        if x.shape()[0] != 1 {
            return Err(Error::Invalid(format!(
                "rope on a batch of {} rows: apply per row with each row's own offset",
                x.shape()[0]
            )));
        }
        Ok(mlx_rs::fast::rope(x, self.dims, self.traditional, self.base, self.scale, offset, self.freqs.as_ref())?)
    }

    /// Rotate `x` (`[B, H, T, D]`) whose row b starts at `offsets[b]` (`[B]` int32), in one call.
    pub fn apply_batch(&self, x: &Array, offsets: &Array) -> Result<Array> {
        if offsets.shape() != [x.shape()[0]] {
            return Err(Error::Invalid(format!(
                "rope on a batch of {} rows with offsets of shape {:?}",
                x.shape()[0],
                offsets.shape()
            )));
        }
        Ok(mlx_rs::fast::rope_dynamic(
            x,
            self.dims,
            self.traditional,
            self.base,
            self.scale,
            offsets,
            self.freqs.as_ref(),
        )?)
    }

    /// Planted fault `rope-batch-alias`: the whole `[B, H, 1, D]` decode tensor rotated in one
    /// call with row 0's offset, the batch axis standing where rope expects the sequence axis
    /// (what the aliased strides did), so row b is rotated at `offset + b`.
    pub fn apply_batch_aliased(&self, x: &Array, offset: i32) -> Result<Array> {
        let as_seq = x.transpose_axes(&[2, 1, 0, 3])?; // [1, H, B, D]
        let rotated = mlx_rs::fast::rope(
            &as_seq,
            self.dims,
            self.traditional,
            self.base,
            self.scale,
            offset,
            self.freqs.as_ref(),
        )?;
        Ok(rotated.transpose_axes(&[2, 1, 0, 3])?)
    }
}

/// Llama 3.1 frequency scaling (as in Meta's reference and mlx-lm): long wavelengths are
/// stretched by `factor`, short ones kept, the band in between interpolated. Returns periods
/// (`1 / inv_freq`), the form MLX's rope takes as `freqs`.
fn llama3_periods(head_dim: usize, base: f32, factor: f32, low: f32, high: f32, old_ctx: f32) -> Vec<f32> {
    let low_wavelen = old_ctx / low;
    let high_wavelen = old_ctx / high;
    (0..head_dim)
        .step_by(2)
        .map(|i| {
            let period = base.powf(i as f32 / head_dim as f32);
            let wavelen = 2.0 * std::f32::consts::PI * period;
            if wavelen > low_wavelen {
                period * factor
            } else if wavelen > high_wavelen && wavelen < low_wavelen {
                let smooth = (old_ctx / wavelen - low) / (high - low);
                period / ((1.0 - smooth) / factor + smooth)
            } else {
                period
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// MLX's rope with a `[B]` offset array rotates row b from `offsets[b]` (negative for left
    /// pads), exactly as one call per row with that row's scalar offset.
    #[test]
    fn batch_offsets_rotate_each_row_from_its_own_offset() {
        let json = r#"{"model_type": "llama", "hidden_size": 16, "num_attention_heads": 2,
            "intermediate_size": 32, "num_hidden_layers": 1, "vocab_size": 8, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 64, "rope_theta": 10000.0}"#;
        let cfg = ModelConfig::parse(std::path::Path::new("config.json"), json).expect("config");
        let rope = Rope::new(&cfg).unwrap();
        let x = mlx_rs::random::normal::<f32>(&[3, 2, 4, 8], None, None, None).unwrap();
        let offsets = [0, 5, -2];
        let batch = rope.apply_batch(&x, &Array::from_slice(&offsets, &[3])).unwrap();
        for (b, &off) in offsets.iter().enumerate() {
            use mlx_rs::ops::indexing::IndexOp;
            let b = b as i32;
            let row = rope.apply(&x.index((b..b + 1, .., .., ..)), off).unwrap();
            let diff = batch.index((b..b + 1, .., .., ..)).subtract(&row).unwrap().abs().unwrap().max(None).unwrap();
            assert_eq!(diff.item_exact::<f32>(), 0.0, "row {b} at offset {off}");
        }
        let short = Array::from_slice(&[0, 1], &[2]);
        assert!(rope.apply_batch(&x, &short).is_err(), "one offset per row");
    }

    #[test]
    fn llama3_periods_keep_short_and_stretch_long_wavelengths() {
        let p = llama3_periods(64, 500_000.0, 32.0, 1.0, 4.0, 8192.0);
        assert_eq!(p.len(), 32);
        assert_eq!(p[0], 1.0, "highest frequency untouched");
        let unscaled_last = 500_000f32.powf(62.0 / 64.0);
        assert!((p[31] / unscaled_last - 32.0).abs() < 1e-3, "lowest frequency stretched by factor");
    }
}
