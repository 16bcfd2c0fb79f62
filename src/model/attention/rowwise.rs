//! Row-by-row attention: RoPE, the cache write, the cache read and the attention run per row,
//! each with the row's own offset and its own visible keys. Nothing here can alias one row's
//! position onto another's; it is the reference the batched mode is compared with.

use mlx_rs::Array;
use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::ops::indexing::IndexOp;

use super::{LayerView, StepContext};
use crate::error::Result;
use crate::faults::Fault;
use crate::kv::KvCache;

/// `q`: `[B, H, T, D]`, `k`/`v`: `[B, kv_heads, T, D]` -> `[B, H, T, D]`.
pub fn attend(
    q: Array,
    k: Array,
    v: Array,
    view: &LayerView,
    kv: &mut dyn KvCache,
    ctx: &StepContext,
) -> Result<Array> {
    let (layer, scale) = (view.layer, view.scale);
    let (b, t) = (q.shape()[0], q.shape()[2]);
    // Every row writes before any row reads: a read between two writes would keep the first
    // write's version of the store alive, so the second write could not update it in place.
    let mut queries = Vec::with_capacity(b as usize);
    for (i, &seq) in ctx.seqs.iter().enumerate() {
        let r = i as i32;
        // One row needs no slicing (B = 1 is the hot path of single-sequence decode).
        let row_of = |x: &Array| if b == 1 { x.clone() } else { x.index((r..r + 1, .., .., ..)) };
        let qr = view.rope.apply(&row_of(&q), ctx.offsets[i])?;
        let kr = view.rope.apply(&row_of(&k), ctx.offsets[i])?;
        kv.write(layer, seq, ctx.starts[i], &kr, &row_of(&v))?;
        queries.push(qr);
    }
    let mut outs = Vec::with_capacity(b as usize);
    for (i, (&seq, qr)) in ctx.seqs.iter().zip(&queries).enumerate() {
        let read = kv.read(layer, seq)?;
        let (keys, values, first) = (&read.keys, &read.values, read.first[0]);
        let masked = if ctx.faults.has(Fault::PadUnmasked) { 0 } else { ctx.masked[i] };
        let n = keys.shape()[2] as usize;
        // Only left-padded rows and windows shorter than the row need an explicit mask; its
        // width is the keys actually read.
        let out = if masked > first || view.window.is_some_and(|w| n > w) {
            let mask = row_mask(ctx.starts[i], t as usize, first, n, masked, view.window);
            super::attend_keys(qr, keys, values, scale, Some((&mask).into()))?
        } else if t > 1 {
            // Causal, aligned to the bottom right: query j sits at row start + j.
            super::attend_keys(qr, keys, values, scale, Some(ScaledDotProductAttentionMask::Causal))?
        } else {
            super::attend_keys(qr, keys, values, scale, None)?
        };
        outs.push(out);
    }
    Ok(if outs.len() == 1 { outs.swap_remove(0) } else { mlx_rs::ops::concatenate(&outs, 0)? })
}

/// Causal mask `[T, L]` over the keys at positions `first..first + L` that also hides the
/// first `masked` positions from every real query and, with a window, every key `window` or
/// more positions before the query. Pad queries (inside the masked prefix) attend causally
/// among themselves so that their softmax is defined; their outputs are never used.
fn row_mask(start: usize, t: usize, first: usize, keys: usize, masked: usize, window: Option<usize>) -> Array {
    let win = window.unwrap_or(usize::MAX);
    let mut m = Vec::with_capacity(t * keys);
    for j in 0..t {
        let qpos = start + j;
        for kpos in first..first + keys {
            m.push(kpos <= qpos && qpos - kpos.min(qpos) < win && (kpos >= masked || qpos < masked));
        }
    }
    Array::from_slice(&m, &[t as i32, keys as i32])
}
