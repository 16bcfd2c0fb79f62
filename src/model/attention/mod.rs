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
mod rowwise;

use mlx_rs::Array;

use super::layers::{Linear, LoadOptions, NormGain, RmsNorm, Stacked};
use super::rope::{Rope, Ropes};
use super::{Taps, tap};
use crate::checkpoint::{ModelConfig, WeightStore};
use crate::error::Result;
use crate::faults::Faults;
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
