//! Batched attention: every operation runs once for all rows of a step, as engines' fast paths
//! run it. One RoPE call rotates `[B, H, T, D]` with an array of per-row offsets, one cache write
//! stores every row's K/V, one cache read returns `[B, kv_heads, W, D]` for the longest visible
//! length W, and one attention call covers the batch with a mask that hides each row's keys
//! past its own length (ragged rows), its masked left pads and, on a sliding-window layer, its
//! keys older than the window.
//!
//! The planted batching faults live here, in the operations they break: `rope-batch-alias` (the
//! single-offset call on the batch), `batch-row-swap` (the offsets array), `ragged-mask-wide`
//! (the mask) and `pad-unmasked` (the mask).

use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::{Array, Dtype};

use super::{LayerView, StepContext};
use crate::error::Result;
use crate::faults::{Fault, Faults};
use crate::kv::KvCache;
use crate::kv::store::Memo;
use crate::model::rope::{Angles, Rope};

/// What the layers of one batched step share: the offsets array, the rotation angles and the
/// mask, built once.
pub struct Step {
    /// `[B]` int32 RoPE offsets, one per row.
    offsets: Array,
    tokens: usize,
    /// The global layers' RoPE angles, where MLX has no rope kernel (see [`Rope::angles`]).
    angles: Memo<Dtype, Angles>,
    /// The same for the sliding-window layers' RoPE.
    local_angles: Memo<Dtype, Angles>,
    /// The mask for the visible lengths and first positions the cache reported (the same for
    /// every global layer).
    mask: Memo<(Vec<usize>, Vec<usize>), Mask>,
    /// The same for every sliding-window layer.
    local_mask: Memo<(Vec<usize>, Vec<usize>), Mask>,
}

#[derive(Clone)]
enum Mask {
    /// Every row sees all its keys: single-token rows of one length.
    None,
    /// Rows of one length, several tokens each: causal, aligned to the bottom right.
    Causal,
    /// `[B, 1, T, W]` boolean.
    Array(Array),
}

impl Step {
    pub fn new(offsets: &[i32], tokens: usize, faults: Faults) -> Self {
        let mut offsets = offsets.to_vec();
        // Planted fault: the offsets array built with rows 0 and 1 exchanged.
        if faults.has(Fault::BatchRowSwap) && offsets.len() > 1 && tokens == 1 {
            offsets.swap(0, 1);
        }
        let n = offsets.len() as i32;
        Step {
            offsets: Array::from_slice(&offsets, &[n]),
            tokens,
            angles: Memo::new(),
            local_angles: Memo::new(),
            mask: Memo::new(),
            local_mask: Memo::new(),
        }
    }

    /// `x` (`[B, H, T, D]`) rotated by `rope`, each row from its own offset: MLX's kernel where it
    /// has one, else MLX's computation with this step's angles, shared by every layer of
    /// `rope`'s kind (a decode step of SmolLM2 built them 60 times).
    fn rotate(&self, rope: &Rope, sliding: bool, x: &Array) -> Result<Array> {
        if rope.kernel() {
            return rope.apply_batch(x, &self.offsets);
        }
        let memo = if sliding { &self.local_angles } else { &self.angles };
        let angles = memo.get_or_try(x.dtype(), |&dtype| rope.angles(&self.offsets, self.tokens as i32, dtype))?;
        rope.rotate(x, &angles)
    }
}

/// `q`: `[B, H, T, D]`, `k`/`v`: `[B, kv_heads, T, D]` -> `[B, H, T, D]`.
pub fn attend(
    step: &Step,
    q: Array,
    k: Array,
    v: Array,
    view: &LayerView,
    kv: &mut dyn KvCache,
    ctx: &StepContext,
) -> Result<Array> {
    let (b, t) = (q.shape()[0], q.shape()[2]);
    let (layer, scale, rope) = (view.layer, view.scale, view.rope);
    let (q, k) = if ctx.faults.has(Fault::RopeBatchAlias) && b > 1 && t == 1 {
        // Planted fault: the "uniform offsets" fast path, one call with row 0's offset.
        (rope.apply_batch_aliased(&q, ctx.offsets[0])?, rope.apply_batch_aliased(&k, ctx.offsets[0])?)
    } else {
        let sliding = view.window.is_some();
        (step.rotate(rope, sliding, &q)?, step.rotate(rope, sliding, &k)?)
    };
    crate::model::tap(ctx.taps, Some(layer), "rope_q", &q);
    crate::model::tap(ctx.taps, Some(layer), "rope_k", &k);
    // The write comes before the read: the store's old version is then free to be updated in
    // place (MLX donates a buffer only when nothing else holds it).
    kv.write_batch(layer, &ctx.seqs, &ctx.starts, &k, &v)?;
    let read = kv.read_batch(layer, &ctx.seqs)?;
    let w = read.keys.shape()[2];
    let in_place = read.rows.as_ref().and_then(|at| super::in_place::plan(&q, at, w));
    // A timed tap evaluates what it is given: the gathered keys would run the copy that
    // attention in place does without, so it times the cache's write instead.
    match &in_place {
        Some(planned) if crate::model::timed(ctx.taps) => {
            crate::model::tap(ctx.taps, Some(layer), "kv_read", planned.stored_keys())
        }
        _ => crate::model::tap(ctx.taps, Some(layer), "kv_read", &read.keys),
    }
    let memo = if view.window.is_some() { &step.local_mask } else { &step.mask };
    let mask = memo.get_or_try((read.visible, read.first), |(visible, first)| {
        Ok(mask(visible, first, &ctx.masked, step.tokens, view.window, ctx.faults))
    })?;
    let mask = || match &*mask {
        Mask::None => None,
        Mask::Causal => Some(ScaledDotProductAttentionMask::Causal),
        Mask::Array(m) => Some(ScaledDotProductAttentionMask::Array(m)),
    };
    if let Some(planned) = &in_place
        && let Some(out) = planned.attend(&q, scale, mask())?
    {
        return Ok(out);
    }
    super::attend_keys(&q, &read.keys, &read.values, scale, mask())
}

/// The mask for rows whose keys are `visible[b]` long (each row's last `t` are this step's
/// tokens) in a read `W = max(visible)` wide, the first at position `first[b]`, with
/// `masked[b]` left pads, on a layer that sees the last `window` positions (`None`: all).
///
/// Query j of row b sits at key column `visible[b] - t + j` and sees the columns up to it:
/// causal within the step, and blind to the filler past the row's end. Real queries never see
/// the masked prefix; pad queries see the pads before them, so their softmax is defined (their
/// outputs are never used). A windowed query at position q sees only the keys at positions k
/// with `q - k < window`, as mlx-lm's `create_causal_mask` has it. Pads, real tokens and the
/// rows a window layer released all count as positions, so column c is position
/// `first[b] + c`.
fn mask(visible: &[usize], first: &[usize], masked: &[usize], t: usize, window: Option<usize>, faults: Faults) -> Mask {
    let w = visible.iter().copied().max().unwrap_or(0);
    let pads = !faults.has(Fault::PadUnmasked) && masked.iter().zip(first).any(|(&m, &f)| m > f);
    let ragged = visible.iter().any(|&n| n != w);
    // Every query's window holds all its keys: the oldest query, at column w - t, reaches
    // column 0 when w - t < window.
    let windowed = window.is_some_and(|win| w > win);
    if !pads && !ragged && !windowed {
        return if t == 1 { Mask::None } else { Mask::Causal };
    }
    let win = window.unwrap_or(usize::MAX);
    let mut m = Vec::with_capacity(visible.len() * t * w);
    for ((&n, &pad), &f) in visible.iter().zip(masked).zip(first) {
        let pad = if faults.has(Fault::PadUnmasked) { 0 } else { pad };
        // Planted fault: a row shorter than the batch sees one key past its end.
        let reach = usize::from(faults.has(Fault::RaggedMaskWide) && n < w);
        for j in 0..t {
            let qc = (n + j).saturating_sub(t);
            let q = f + qc;
            m.extend((0..w).map(|c| {
                let k = f + c;
                c <= qc + reach && q - k.min(q) < win && (k >= pad || q < pad)
            }));
        }
    }
    Mask::Array(Array::from_slice(&m, &[visible.len() as i32, 1, t as i32, w as i32]))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bools(m: Mask) -> Vec<bool> {
        match m {
            Mask::Array(a) => a.as_slice::<bool>().to_vec(),
            _ => panic!("expected an explicit mask"),
        }
    }

    #[test]
    fn uniform_rows_need_no_mask_array() {
        assert!(matches!(mask(&[5, 5], &[0, 0], &[0, 0], 1, None, Faults::NONE), Mask::None));
        assert!(matches!(mask(&[5, 5], &[0, 0], &[0, 0], 3, None, Faults::NONE), Mask::Causal));
    }

    #[test]
    fn ragged_decode_rows_see_exactly_their_keys() {
        // Row 0 has 4 keys, row 1 has 2: row 1 must not see columns 2 and 3 (filler).
        let m = bools(mask(&[4, 2], &[0, 0], &[0, 0], 1, None, Faults::NONE));
        assert_eq!(m, [true, true, true, true, true, true, false, false]);
        let wide = bools(mask(&[4, 2], &[0, 0], &[0, 0], 1, None, Faults::only(Fault::RaggedMaskWide)));
        assert_eq!(wide, [true, true, true, true, true, true, true, false], "the fault reaches one key further");
    }

    #[test]
    fn left_pads_are_hidden_from_real_queries_only() {
        // One row, 2 masked pads then 2 real tokens, prefilled together (t = 4).
        let m = bools(mask(&[4], &[0], &[2], 4, None, Faults::NONE));
        #[rustfmt::skip]
        assert_eq!(m, [
            true, false, false, false, // pad 0: itself
            true, true, false, false,  // pad 1: the pads before it
            false, false, true, false, // real 0: itself, not the pads
            false, false, true, true,  // real 1
        ]);
        let unmasked = mask(&[4], &[0], &[2], 4, None, Faults::only(Fault::PadUnmasked));
        assert!(matches!(unmasked, Mask::Causal), "the fault leaves plain causality: real queries see the pads");
    }

    #[test]
    fn a_window_hides_keys_older_than_it() {
        // Two decode rows, 5 and 3 keys, window 3: row 0 sees columns 2..=4, row 1 all of its 3.
        let m = bools(mask(&[5, 3], &[0, 0], &[0, 0], 1, Some(3), Faults::NONE));
        assert_eq!(m, [false, false, true, true, true, true, true, true, false, false]);
        // A prefill of 4 with window 2: each query sees itself and the one before it.
        let m = bools(mask(&[4], &[0], &[0], 4, Some(2), Faults::NONE));
        #[rustfmt::skip]
        assert_eq!(m, [
            true, false, false, false,
            true, true, false, false,
            false, true, true, false,
            false, false, true, true,
        ]);
        // Rows whose oldest blocks a window layer released: row 0 holds positions 8..13 (5
        // columns), row 1 positions 0..3. Window 3: row 0's query at 12 sees 10..=12.
        let m = bools(mask(&[5, 3], &[8, 0], &[0, 0], 1, Some(3), Faults::NONE));
        assert_eq!(m, [false, false, true, true, true, true, true, true, false, false]);
        // A window at least as long as every row changes nothing.
        assert!(matches!(mask(&[3, 3], &[0, 0], &[0, 0], 1, Some(3), Faults::NONE), Mask::None));
    }
}
