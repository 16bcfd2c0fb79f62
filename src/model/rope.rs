//! Rotary position embedding.
//!
//! Regression guard (RoPE stride aliasing): a batched decode tensor `[B, H, 1, D]` must never
//! be rotated with a single scalar offset. MLX's rope treats axis -2 as the sequence axis; a
//! "uniform offsets" fast path over the transposed `[B, 1, H, D]` layout once rotated row b at
//! `offset + b`. Batched attention rotates the batch in one call with an array of per-row
//! offsets ([`Rope::apply_batch`], MLX's rope with a `[B]` offset array: row b's position t is
//! `offsets[b] + t`); row-by-row attention calls [`Rope::apply`] on one row at a time. The
//! planted fault `rope-batch-alias` reproduces the bug in [`Rope::apply_batch_aliased`].

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{IndexOp, IntoStrideBy};
use mlx_rs::{Array, Dtype};

use crate::checkpoint::{ModelConfig, RopeScaling};
use crate::error::{Error, Result};
use crate::fused::Fused;

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
    /// Whether MLX rotates with a kernel of its own on this process's device (its GPU
    /// backends). Where it has none (the CPU), every rope call builds the same graph of some
    /// twenty operations, the positions' cosines and sines among them: a batched step builds
    /// those once ([`Rope::angles`]) and rotates every layer with them ([`Rope::rotate`]).
    kernel: bool,
}

/// The cosines and sines of one step's rotation angles, `[B, 1, T, dims / 2]`: row b, token
/// t at position `offsets[b] + t`. The same for every layer that shares the RoPE.
pub struct Angles {
    cos: Array,
    sin: Array,
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
        Ok(Rope { dims, traditional: cfg.rope_traditional, base, scale, freqs, kernel: mlx_has_kernel() })
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
            kernel: mlx_has_kernel(),
        })
    }

    /// Whether MLX has a rope kernel here; where it has not, [`Rope::angles`] and
    /// [`Rope::rotate`] are MLX's own computation with the angles shared between layers.
    pub fn kernel(&self) -> bool {
        self.kernel
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

    /// The angles of a step of `tokens` tokens whose row b starts at `offsets[b]` (`[B]` int32),
    /// in `dtype`: the operations of MLX's rope fallback (`mlx/fast.cpp`, 0.32), in its order
    /// and dtypes, so that [`Rope::rotate`] with them is bit for bit what
    /// [`Rope::apply_batch`] computes on the CPU (`tests::shared_angles_rotate_bit_for_bit_as_mlx`
    /// holds it to that: a step whose rotation moved by one bit would move every snapshot).
    pub fn angles(&self, offsets: &Array, tokens: i32, dtype: Dtype) -> Result<Angles> {
        let half = self.dims / 2;
        let offsets = offsets.expand_dims_axes(&[-1, -2])?; // [B, 1, 1]
        let positions =
            Array::arange::<_, f32>(None, tokens, None)?.add(&offsets)?.multiply(Array::from_f32(self.scale))?; // [B, 1, T]
        let inv_freqs = match &self.freqs {
            Some(periods) => periods.reciprocal()?,
            None => {
                let base = self.base.ok_or_else(|| Error::Invalid("rope without base or freqs".into()))?;
                Array::arange::<_, f32>(0, -half, -1)?.multiply(Array::from_f32(base.ln() / half as f32))?.exp()?
            }
        };
        let theta = positions.expand_dims(-1)?.multiply(&inv_freqs)?; // [B, 1, T, half]
        Ok(Angles { cos: theta.cos()?.as_dtype(dtype)?, sin: theta.sin()?.as_dtype(dtype)? })
    }

    /// Rotate `x` (`[B, H, T, D]`, every dimension rotated) by `angles`: MLX's rope fallback
    /// after its angles (see [`Rope::angles`]), fused.
    pub fn rotate(&self, x: &Array, angles: &Angles) -> Result<Array> {
        let [_, _, _, d] = *x.shape() else {
            return Err(Error::Invalid(format!("rope of a {:?} tensor, expected [B, H, T, D]", x.shape())));
        };
        if d != self.dims {
            return Err(Error::Invalid(format!("rope of {} dimensions over a head of {d}", self.dims)));
        }
        let args = [x.clone(), angles.cos.clone(), angles.sin.clone()];
        ROTATE.with(|fused| fused[self.traditional as usize].call(&args))
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

thread_local! {
    /// [`rotation`] fused, split halves at 0 and paired dimensions at 1. Unfused it is seven
    /// MLX operations, 60 rotations a decode step of SmolLM2.
    static ROTATE: [Fused; 2] = [false, true].map(|traditional| {
        Fused::new(move |args: &[Array]| rotation(&args[0], &args[1], &args[2], traditional))
    });
}

/// MLX's rope fallback after its angles: `x` (`[B, H, T, D]`) by `cos` and `sin` (`[B, 1, T,
/// D / 2]`). Fused (see [`crate::fused`]; `tests::shared_angles_rotate_bit_for_bit_as_mlx`
/// holds it to MLX's own rope).
fn rotation(x: &Array, cos: &Array, sin: &Array, traditional: bool) -> std::result::Result<Array, Exception> {
    let [b, h, t, d] = *x.shape() else {
        return Err(Exception::custom(format!("rope of a {:?} tensor, expected [B, H, T, D]", x.shape())));
    };
    let (x1, x2) = if traditional {
        (x.index((.., .., .., (0..d).stride_by(2))), x.index((.., .., .., (1..d).stride_by(2))))
    } else {
        let half = d / 2;
        (x.index((.., .., .., ..half)), x.index((.., .., .., half..)))
    };
    let first = x1.multiply(cos)?.subtract(x2.multiply(sin)?)?;
    let second = x1.multiply(sin)?.add(x2.multiply(cos)?)?;
    if traditional {
        let pairs = [first.expand_dims(-1)?, second.expand_dims(-1)?];
        mlx_rs::ops::concatenate(&pairs, -1)?.reshape(&[b, h, t, d])
    } else {
        mlx_rs::ops::concatenate(&[first, second], -1)
    }
}

/// MLX's rope runs as a kernel on its GPU backends and as a graph of operations on its CPU
/// (`RoPE::use_fallback`: the stream's device is the CPU), the default device's.
fn mlx_has_kernel() -> bool {
    crate::environment::device() == "gpu"
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

    /// Guards the shared angles against drifting from MLX's own rope by a single bit: a batched
    /// step on the CPU rotates with [`Rope::angles`] and [`Rope::rotate`], the reference and
    /// every committed snapshot were computed through MLX's rope, so any difference (an
    /// operation reordered, a constant rounded otherwise, a dtype promoted elsewhere) would
    /// move every row's logits. Each way a config can shape the rope, ragged and negative
    /// offsets, one and several tokens, float32 and bfloat16.
    #[test]
    fn shared_angles_rotate_bit_for_bit_as_mlx() {
        // The angles are the CPU's computation; on a Mac the default device is Metal's kernel.
        crate::environment::use_device(crate::environment::DeviceChoice::Cpu).expect("the CPU is always there");
        let base = r#""model_type": "llama", "hidden_size": 32, "num_attention_heads": 2,
            "intermediate_size": 32, "num_hidden_layers": 1, "vocab_size": 8, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096, "rope_theta": 500000.0"#;
        let configs = [
            "",
            r#", "rope_traditional": true"#,
            r#", "rope_scaling": {"rope_type": "linear", "factor": 4.0}"#,
            r#", "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}"#,
        ];
        for extra in configs {
            let json = format!("{{{base}{extra}}}");
            let cfg = ModelConfig::parse(std::path::Path::new("config.json"), &json).expect("config");
            let rope = Rope::new(&cfg).unwrap();
            for (offsets, tokens) in [(vec![0, 1000, -3], 1), (vec![5, 0, 2999], 7), (vec![37], 1), (vec![0], 64)] {
                for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                    let b = offsets.len() as i32;
                    let x = mlx_rs::random::normal::<f32>(&[b, 3, tokens, 16], None, None, None)
                        .unwrap()
                        .as_dtype(dtype)
                        .unwrap();
                    let offsets = Array::from_slice(&offsets, &[b]);
                    let mlx = rope.apply_batch(&x, &offsets).unwrap();
                    let angles = rope.angles(&offsets, tokens, dtype).unwrap();
                    let shared = rope.rotate(&x, &angles).unwrap();
                    assert_eq!(shared.dtype(), dtype);
                    let (mlx, shared) =
                        (mlx.as_dtype(Dtype::Float32).unwrap(), shared.as_dtype(Dtype::Float32).unwrap());
                    let (mlx, shared) = (mlx.as_slice::<f32>(), shared.as_slice::<f32>());
                    let differ = mlx.iter().zip(shared).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                    assert_eq!(
                        differ, 0,
                        "{extra} offsets {offsets:?} tokens {tokens} {dtype:?}: {differ} values differ"
                    );
                }
            }
        }
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
