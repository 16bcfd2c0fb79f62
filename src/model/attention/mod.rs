//! Self-attention over a KV backend, in one of two modes that must agree:
//!
//! - [`AttentionMode::Batched`] (`batched.rs`, the default): one RoPE call with per-row offsets,
//!   one cache write, one cache read and one attention call for all rows of a step, with a mask
//!   for ragged lengths and masked left pads. This is the layout engines' fast paths use, and
//!   where their batching bugs live.
//! - [`AttentionMode::RowByRow`] (`rowwise.rs`): RoPE, the cache write, the cache read and the
//!   attention per row, each with that row's own offset and its own visible keys. The simplest
//!   correct form, kept as a reference to compare the batched mode against.
//!
//! Projections run batched over all rows in both modes.

mod batched;
mod in_place;
mod rowwise;

use mlx_rs::error::Exception;
use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::{Array, Dtype};

use super::layers::{Linear, LoadOptions, NormGain, RmsNorm, Stacked};
use super::rope::{Rope, Ropes};
use super::{Taps, tap};
use crate::checkpoint::{ModelConfig, WeightStore};
use crate::error::Result;
use crate::faults::Faults;
use crate::fused::Fused;
use crate::kv::{KvCache, SeqId};

/// How attention runs over the rows of a step (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum AttentionMode {
    #[default]
    Batched,
    RowByRow,
}

impl AttentionMode {
    pub fn name(self) -> &'static str {
        match self {
            AttentionMode::Batched => "batched",
            AttentionMode::RowByRow => "row-by-row",
        }
    }
}

impl std::str::FromStr for AttentionMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "batched" => Ok(AttentionMode::Batched),
            "row-by-row" | "rowwise" => Ok(AttentionMode::RowByRow),
            other => Err(format!("unknown attention mode `{other}`; expected batched or row-by-row")),
        }
    }
}

pub struct Attention {
    /// q, k and v projections in one matmul.
    qkv: Stacked,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
    /// Sliding-window layers see only the last `window` positions (the mask's, not the
    /// cache's: every row stays stored) and rotate with the local RoPE.
    window: Option<usize>,
}

/// What every layer of one step shares.
pub struct StepContext<'a> {
    pub mode: AttentionMode,
    pub seqs: Vec<SeqId>,
    /// First KV row of each row's new tokens, as reserved in the cache.
    pub starts: Vec<usize>,
    /// Each row's masked (left-pad) prefix.
    pub masked: Vec<usize>,
    /// Each row's RoPE offset: its first new KV row minus its masked prefix. Derived from the
    /// cache's counter on every step; there is no second copy to drift.
    pub offsets: Vec<i32>,
    pub ropes: &'a Ropes,
    pub faults: Faults,
    pub taps: Option<&'a Taps>,
    /// Batched mode's per-step state, built once for all layers.
    batch: Option<batched::Step>,
}

impl<'a> StepContext<'a> {
    pub fn new(
        mode: AttentionMode,
        seqs: Vec<SeqId>,
        starts: Vec<usize>,
        masked: Vec<usize>,
        tokens: usize,
        ropes: &'a Ropes,
        faults: Faults,
    ) -> Self {
        let offsets: Vec<i32> = starts.iter().zip(&masked).map(|(&s, &m)| s as i32 - m as i32).collect();
        let batch = (mode == AttentionMode::Batched).then(|| batched::Step::new(&offsets, tokens, faults));
        StepContext { mode, seqs, starts, masked, offsets, ropes, faults, taps: None, batch }
    }

    /// The same step with its intermediates recorded in `taps`.
    pub fn traced(self, taps: Option<&'a Taps>) -> Self {
        StepContext { taps, ..self }
    }
}

/// What one layer's attention brings to the shared step.
pub struct LayerView<'a> {
    pub layer: usize,
    pub rope: &'a Rope,
    pub scale: f32,
    pub window: Option<usize>,
}

impl Attention {
    /// Layer `layer`'s attention; `qk_norm` says whether the family norms q and k per head (with
    /// `gain`, as its other norms).
    pub fn load(
        w: &mut WeightStore,
        c: &ModelConfig,
        path: &str,
        layer: usize,
        qk_norm: bool,
        gain: NormGain,
        opts: &LoadOptions,
    ) -> Result<Self> {
        let q = c.quantization.as_ref();
        let (h, kvh, d) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let bias = c.attention_bias;
        let norm = |w: &mut WeightStore, name: &str| -> Result<Option<RmsNorm>> {
            if qk_norm {
                Ok(Some(RmsNorm::load(w, &format!("{path}.{name}"), d, c.rms_norm_eps, gain, opts)?))
            } else {
                Ok(None)
            }
        };
        let qkv = [("q_proj", h * d), ("k_proj", kvh * d), ("v_proj", kvh * d)]
            .map(|(p, out)| (format!("{path}.{p}"), c.hidden_size, out));
        Ok(Attention {
            qkv: Stacked::load(w, q, &qkv, bias, opts)?,
            o_proj: Linear::load(w, q, &format!("{path}.o_proj"), h * d, c.hidden_size, bias, opts)?,
            q_norm: norm(w, "q_norm")?,
            k_norm: norm(w, "k_norm")?,
            heads: h as i32,
            kv_heads: kvh as i32,
            head_dim: d as i32,
            scale: c.query_pre_attn_scalar.unwrap_or(d as f32).powf(-0.5),
            window: c.layer_window(layer),
        })
    }

    /// Weight bytes the stacked q/k/v and the output projections read for `rows` rows.
    pub fn read_bytes(&self, rows: usize) -> (u64, u64) {
        (self.qkv.read_bytes(rows), self.o_proj.read_bytes(rows))
    }

    /// `x`: `[B, T, hidden]` (normed) -> `[B, T, hidden]`.
    pub fn forward(&self, x: &Array, layer: usize, kv: &mut dyn KvCache, ctx: &StepContext) -> Result<Array> {
        let (b, t) = (x.shape()[0], x.shape()[1]);
        let l = Some(layer);
        let split = |y: Array, heads: i32, norm: &Option<RmsNorm>, name: &str| -> Result<Array> {
            tap(ctx.taps, l, &format!("{name}_proj"), &y);
            let y = y.reshape(&[b, t, heads, self.head_dim])?;
            let y = match norm {
                Some(n) => {
                    let y = n.forward(&y)?;
                    tap(ctx.taps, l, &format!("{name}_norm"), &y);
                    y
                }
                None => y,
            };
            Ok(y.transpose_axes(&[0, 2, 1, 3])?) // [B, heads, T, D]
        };
        let [q, k, v]: [Array; 3] = self
            .qkv
            .forward(x)?
            .try_into()
            .map_err(|_| crate::error::Error::Invalid("q/k/v projection did not split in three".into()))?;
        let q = split(q, self.heads, &self.q_norm, "q")?;
        let k = split(k, self.kv_heads, &self.k_norm, "k")?;
        let v = split(v, self.kv_heads, &None, "v")?;
        let view = LayerView {
            layer,
            rope: ctx.ropes.for_layer(self.window.is_some()),
            scale: self.scale,
            window: self.window,
        };
        let out = match &ctx.batch {
            Some(step) => batched::attend(step, q, k, v, &view, kv, ctx)?,
            None => rowwise::attend(q, k, v, &view, kv, ctx)?,
        }; // [B, H, T, D]
        tap(ctx.taps, l, "attention", &out);
        let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, t, self.heads * self.head_dim])?;
        let out = self.o_proj.forward(&out)?;
        tap(ctx.taps, l, "o_proj", &out);
        Ok(out)
    }
}

/// Score elements (`B * H * T * L`) from which [`attend_keys`] runs the softmax fused: below
/// it, a decode step's few hundred, MLX's single softmax operation costs less than the
/// fused form's five operations to dispatch.
const FUSED_SOFTMAX_MIN: i32 = 4096;

/// Scaled dot-product attention of `q` (`[B, H, T, D]`) over `keys` and `values` (`[B,
/// kv_heads, L, D]`), what `mlx_rs::fast::scaled_dot_product_attention` returns, bit for bit.
///
/// On the CPU MLX has no attention kernel: it runs its fallback graph (`mlx/fast.cpp`), a
/// matmul per head, the mask, a softmax and a second matmul. Its softmax kernel is built for
/// baseline x86-64 and calls `exp` out of line, one element at a time (12 ns each here): two
/// thirds of the attention of a 128-token prefill, and the largest piece of a long prefill
/// after the weights. So on the CPU, for float32 scores of some size, this builds the same
/// graph with the softmax's own operations in its order (the row's max, `exp` of the
/// difference, their sum, its reciprocal, the product) compiled into one kernel for the host
/// (see [`crate::fused`]): 4.5x faster, and no bit moves (`tests::attention_is_mlx_s_bit_for_bit`).
pub(super) fn attend_keys(
    q: &Array,
    keys: &Array,
    values: &Array,
    scale: f32,
    mask: Option<ScaledDotProductAttentionMask<'_>>,
) -> Result<Array> {
    let (&[b, h, t, d], &[_, kv_heads, l, _]) = (q.shape(), keys.shape()) else {
        return Err(crate::error::Error::Invalid("attention takes [B, H, T, D] queries and keys".into()));
    };
    let fused =
        q.dtype() == Dtype::Float32 && b * h * t * l >= FUSED_SOFTMAX_MIN && crate::environment::device() == "cpu";
    if !fused {
        return Ok(mlx_rs::fast::scaled_dot_product_attention(q, keys, values, scale, mask, None)?);
    }
    // MLX's fallback, operation for operation, but for the softmax.
    let repeats = h / kv_heads;
    let mut q = mlx_rs::array!(scale).multiply(q)?;
    let (mut k, mut v) = (keys.clone(), values.clone());
    if repeats > 1 {
        q = q.reshape(&[b, kv_heads, repeats, t, d])?;
        k = k.expand_dims(2)?;
        v = v.expand_dims(2)?;
    }
    let scores = q.matmul(k.swap_axes(-1, -2)?)?;
    let weights = weights(scores, mask, kv_heads, repeats, t, l)?;
    let out = weights.matmul(&v)?;
    Ok(if repeats > 1 { out.reshape(&[b, h, t, d])? } else { out })
}

/// The softmax of `scores` (`[B, kv_heads, repeats, T, L]` where heads share keys, else `[B,
/// H, T, L]`) with `mask`'s hidden columns at the float's minimum, fused, as MLX's fallback
/// masks and [`softmax`] computes.
fn weights(
    mut scores: Array,
    mask: Option<ScaledDotProductAttentionMask<'_>>,
    kv_heads: i32,
    repeats: i32,
    t: i32,
    l: i32,
) -> Result<Array> {
    let mask = match mask {
        None => None,
        // Query j sits at key column j + l - t.
        Some(ScaledDotProductAttentionMask::Causal) => {
            let m: Vec<bool> = (0..t).flat_map(|j| (0..l).map(move |c| c <= j + l - t)).collect();
            Some(Array::from_slice(&m, &[t, l]))
        }
        Some(ScaledDotProductAttentionMask::Array(m)) if repeats > 1 && m.ndim() >= 3 => {
            let heads_axis = m.ndim() - 3;
            Some(if m.shape()[heads_axis] == 1 {
                m.expand_dims(heads_axis as i32)?
            } else {
                let mut shape = m.shape().to_vec();
                shape.splice(heads_axis..=heads_axis, [kv_heads, repeats]);
                m.reshape(&shape)?
            })
        }
        Some(ScaledDotProductAttentionMask::Array(m)) => Some(m.clone()),
    };
    if let Some(m) = mask {
        scores = mlx_rs::ops::select(&m, &scores, mlx_rs::array!(f32::MIN))?;
    }
    SOFTMAX.with(|f| f.call(&[scores]))
}

thread_local! {
    /// [`softmax`] fused.
    static SOFTMAX: Fused = Fused::new(|args: &[Array]| softmax(&args[0]));
}

/// Softmax over the last axis as MLX's CPU kernel computes it in float32: the row's max, then
/// `exp(x - max)` summed left to right from zero, then each times the reciprocal of the sum.
fn softmax(x: &Array) -> std::result::Result<Array, Exception> {
    let e = x.subtract(x.max_axis(-1, true)?)?.exp()?;
    let normalizer = e.sum_axis(-1, true)?.reciprocal()?;
    e.multiply(&normalizer)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused softmax must reproduce MLX's attention to the bit: a reordered sum, a divide
    /// instead of the reciprocal's product, or a mask filled with -inf instead of the float's
    /// minimum would move the logits of every prefill. Each mask kind, grouped and plain heads,
    /// a NaN read (poisoned rows must stay NaN where MLX's are), one token and several.
    #[test]
    fn attention_is_mlx_s_bit_for_bit() {
        crate::environment::use_device(crate::environment::DeviceChoice::Cpu).expect("the CPU is always there");
        let normal = |shape: &[i32]| mlx_rs::random::normal::<f32>(shape, None, None, None).unwrap();
        for (b, h, kv_heads, t, l) in [(2, 9, 3, 37, 64), (1, 4, 4, 33, 33), (3, 6, 2, 1, 700), (2, 2, 1, 48, 96)] {
            assert!(b * h * t * l >= FUSED_SOFTMAX_MIN, "each case runs the fused softmax");
            let q = normal(&[b, h, t, 16]).multiply(mlx_rs::array!(4.0)).unwrap();
            let (mut k, v) = (normal(&[b, kv_heads, l, 16]), normal(&[b, kv_heads, l, 16]));
            if l > t {
                // A poisoned key row (NaN), so the softmax's max meets a NaN.
                let mut host = k.as_slice::<f32>().to_vec();
                host[5 * 16] = f32::NAN;
                k = Array::from_slice(&host, k.shape());
            }
            let visible: Vec<bool> = (0..b * t * l).map(|i| i % 7 != 3 || i % l == 0).collect();
            let rows = Array::from_slice(&visible, &[b, 1, t, l]);
            let plain = Array::from_slice(&visible[..(t * l) as usize], &[t, l]);
            let mask = |i: usize| match i {
                0 => None,
                1 => Some(ScaledDotProductAttentionMask::Causal),
                2 => Some(ScaledDotProductAttentionMask::Array(&rows)),
                _ => Some(ScaledDotProductAttentionMask::Array(&plain)),
            };
            for (i, name) in ["none", "causal", "[B, 1, T, L]", "[T, L]"].into_iter().enumerate() {
                let what = format!("{b}x{h}/{kv_heads} heads, {t} over {l}, mask {name}");
                let mlx = mlx_rs::fast::scaled_dot_product_attention(&q, &k, &v, 0.125, mask(i), None).unwrap();
                let ours = attend_keys(&q, &k, &v, 0.125, mask(i)).unwrap();
                assert_eq!(ours.shape(), mlx.shape(), "{what}");
                let (ours, mlx) = (ours.as_slice::<f32>(), mlx.as_slice::<f32>());
                assert_eq!(mlx.iter().any(|x| x.is_nan()), l > t, "{what}: the poisoned row reaches MLX's output");
                let differ = ours.iter().zip(mlx).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(differ, 0, "{what}: {differ} of {} values differ", mlx.len());
            }
        }
    }
}
