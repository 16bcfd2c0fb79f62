//! Self-attention over a KV backend, one row (sequence) at a time.
//!
//! Projections run batched over all rows; RoPE, the cache write, the cache read and the
//! attention itself run per row, with that row's own offset and its own visible keys. This is
//! the layout that cannot alias one row's position onto another's.

use mlx_rs::Array;
use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::ops::indexing::IndexOp;

use super::RowStep;
use super::layers::{Linear, LoadOptions, RmsNorm};
use super::rope::Rope;
use crate::checkpoint::{ModelConfig, WeightStore};
use crate::error::Result;
use crate::faults::{Fault, Faults};
use crate::kv::KvCache;

pub struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
}

/// What every layer of one step shares.
pub struct StepContext<'a> {
    pub rows: &'a [RowStep],
    /// First KV row of each row's new tokens, as reserved in the cache.
    pub starts: &'a [usize],
    /// Each row's RoPE offset for this step (see [`rope_offsets`]).
    pub offsets: Vec<i32>,
    pub rope: &'a Rope,
    pub faults: Faults,
}

impl Attention {
    pub fn load(w: &mut WeightStore, c: &ModelConfig, path: &str, qk_norm: bool, opts: &LoadOptions) -> Result<Self> {
        let q = c.quantization.as_ref();
        let (h, kvh, d) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let bias = c.attention_bias;
        let norm = |w: &mut WeightStore, name: &str| -> Result<Option<RmsNorm>> {
            if qk_norm {
                Ok(Some(RmsNorm::load(w, &format!("{path}.{name}"), d, c.rms_norm_eps, opts)?))
            } else {
                Ok(None)
            }
        };
        Ok(Attention {
            q_proj: Linear::load(w, q, &format!("{path}.q_proj"), c.hidden_size, h * d, bias, opts)?,
            k_proj: Linear::load(w, q, &format!("{path}.k_proj"), c.hidden_size, kvh * d, bias, opts)?,
            v_proj: Linear::load(w, q, &format!("{path}.v_proj"), c.hidden_size, kvh * d, bias, opts)?,
            o_proj: Linear::load(w, q, &format!("{path}.o_proj"), h * d, c.hidden_size, bias, opts)?,
            q_norm: norm(w, "q_norm")?,
            k_norm: norm(w, "k_norm")?,
            heads: h as i32,
            kv_heads: kvh as i32,
            head_dim: d as i32,
            scale: (d as f32).powf(-0.5),
        })
    }

    /// `x`: `[B, T, hidden]` (normed) -> `[B, T, hidden]`.
    pub fn forward(&self, x: &Array, layer: usize, kv: &mut dyn KvCache, ctx: &StepContext) -> Result<Array> {
        let (b, t) = (x.shape()[0], x.shape()[1]);
        let split = |y: Array, heads: i32, norm: &Option<RmsNorm>| -> Result<Array> {
            let y = y.reshape(&[b, t, heads, self.head_dim])?;
            let y = match norm {
                Some(n) => n.forward(&y)?,
                None => y,
            };
            Ok(y.transpose_axes(&[0, 2, 1, 3])?) // [B, heads, T, D]
        };
        let q = split(self.q_proj.forward(x)?, self.heads, &self.q_norm)?;
        let k = split(self.k_proj.forward(x)?, self.kv_heads, &self.k_norm)?;
        let v = split(self.v_proj.forward(x)?, self.kv_heads, &None)?;

        let offsets = &ctx.offsets;
        let aliased = ctx.faults.has(Fault::RopeBatchAlias) && b > 1 && t == 1;
        let (q, k) = if aliased {
            (ctx.rope.apply_batch_aliased(&q, offsets[0])?, ctx.rope.apply_batch_aliased(&k, offsets[0])?)
        } else {
            (q, k)
        };

        // Every row writes before any row reads. Rows of a paged pool share slabs: a read
        // between two writes keeps the first write's version of the slab alive, so the second
        // write could not update it in place.
        let mut queries = Vec::with_capacity(b as usize);
        for (i, row) in ctx.rows.iter().enumerate() {
            let r = i as i32;
            // One row needs no slicing (B = 1 is the hot path of single-sequence decode).
            let row_of = |x: &Array| if b == 1 { x.clone() } else { x.index((r..r + 1, .., .., ..)) };
            let (mut qr, mut kr) = (row_of(&q), row_of(&k));
            if !aliased {
                qr = ctx.rope.apply(&qr, offsets[i])?;
                kr = ctx.rope.apply(&kr, offsets[i])?;
            }
            kv.write(layer, row.seq, ctx.starts[i], &kr, &row_of(&v))?;
            queries.push(qr);
        }
        let mut outs = Vec::with_capacity(b as usize);
        for (i, (row, qr)) in ctx.rows.iter().zip(&queries).enumerate() {
            let (keys, values) = kv.read(layer, row.seq)?;
            let masked = kv.masked_prefix(row.seq)?;
            // Only left-padded rows need an explicit mask; its width is the keys actually read.
            let out = if masked > 0 && !ctx.faults.has(Fault::PadUnmasked) {
                let mask = prefix_mask(ctx.starts[i], t as usize, keys.shape()[2] as usize, masked);
                mlx_rs::fast::scaled_dot_product_attention(qr, &keys, &values, self.scale, &mask, None)?
            } else if t > 1 {
                // Causal, aligned to the bottom right: query j sits at row start + j.
                mlx_rs::fast::scaled_dot_product_attention(
                    qr,
                    &keys,
                    &values,
                    self.scale,
                    ScaledDotProductAttentionMask::Causal,
                    None,
                )?
            } else {
                mlx_rs::fast::scaled_dot_product_attention(qr, &keys, &values, self.scale, None, None)?
            };
            outs.push(out);
        }
        let out = if outs.len() == 1 { outs.swap_remove(0) } else { mlx_rs::ops::concatenate(&outs, 0)? }; // [B, H, T, D]
        let out = out.transpose_axes(&[0, 2, 1, 3])?.reshape(&[b, t, self.heads * self.head_dim])?;
        self.o_proj.forward(&out)
    }
}

/// Each row's RoPE offset: its first new KV row minus its masked (left-pad) prefix. Derived
/// from the cache's counter on every call; there is no second copy to drift.
pub fn rope_offsets(kv: &dyn KvCache, rows: &[RowStep], starts: &[usize], faults: Faults) -> Result<Vec<i32>> {
    let mut offsets = Vec::with_capacity(rows.len());
    for (row, &start) in rows.iter().zip(starts) {
        offsets.push(start as i32 - kv.masked_prefix(row.seq)? as i32);
    }
    if faults.has(Fault::BatchRowSwap) && offsets.len() > 1 && rows[0].tokens.len() == 1 {
        offsets.swap(0, 1);
    }
    Ok(offsets)
}

/// Causal mask `[T, L]` that also hides the first `masked` key rows from every real query.
/// Pad queries (inside the masked prefix) attend causally among themselves so that their
/// softmax is defined; their outputs are never used.
fn prefix_mask(start: usize, t: usize, keys: usize, masked: usize) -> Array {
    let mut m = Vec::with_capacity(t * keys);
    for j in 0..t {
        let qpos = start + j;
        for kpos in 0..keys {
            m.push(kpos <= qpos && (kpos >= masked || qpos < masked));
        }
    }
    Array::from_slice(&m, &[t as i32, keys as i32])
}
