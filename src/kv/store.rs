//! The storage layout both backends share: per layer, K and V each `[kv_heads, rows, head_dim]`,
//! rows addressed by one flat index (dense: `slot * capacity + position`; paged:
//! `block * block_size + offset`).
//!
//! Heads lead so that any set of rows, viewed or gathered, reads out as `[B, H, W, D]` with every
//! head's `[W, D]` matrix contiguous. Attention's matmuls take that as it is; MLX's CPU matmul
//! copies any operand whose last two axes are not a plain matrix, which a `[rows, H, D]` layout
//! would cost on every layer of every step. A gather indexes the store as `[H * rows, D]`, so each
//! gathered piece is one contiguous `D`-row (MLX's gather copies those with one `memcpy`).
//!
//! Writes are scatters or slice updates of whole arrays. MLX donates the old buffer to the result
//! when nothing else holds it, so a write touches only its rows; that is why every layer's
//! arrays are separate (one array shared by two layers could not be donated).

use std::rc::Rc;

use mlx_rs::Array;
use mlx_rs::ops::indexing::{IndexOp, TryIndexMutOp};

use super::KvShape;
use crate::error::{Error, Result};

#[derive(Clone)]
pub(crate) struct RowStore {
    /// Per layer (K, V), each `[kv_heads, rows, head_dim]`; empty until the first growth.
    layers: Vec<(Array, Array)>,
    rows: usize,
    shape: KvShape,
}

impl RowStore {
    pub(crate) fn new(shape: KvShape) -> Self {
        RowStore { layers: Vec::new(), rows: 0, shape }
    }

    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes of K plus V one row occupies over all layers, measured from the arrays as they
    /// are stored (the layout's dtype when nothing is stored yet).
    pub(crate) fn row_bytes(&self) -> u64 {
        if self.rows == 0 || self.layers.is_empty() {
            return self.shape.row_bytes();
        }
        let total: usize = self.layers.iter().map(|(k, v)| k.nbytes() + v.nbytes()).sum();
        (total / self.rows) as u64
    }

    fn heads(&self) -> i32 {
        self.shape.kv_heads as i32
    }

    fn dim(&self) -> i32 {
        self.shape.head_dim as i32
    }

    /// `[H, rows, D]` filled with `value` (NaN poison or zero) in the KV dtype.
    fn filled(&self, rows: usize, value: f32) -> Result<Array> {
        let shape = [self.heads(), rows as i32, self.dim()];
        Ok(mlx_rs::ops::full::<f32>(&shape, &Array::from_f32(value))?.as_dtype(self.shape.dtype.mlx())?)
    }

    /// One layer's K and V, `[kv_heads, rows, head_dim]` each.
    pub(crate) fn layer(&self, layer: usize) -> Result<&(Array, Array)> {
        self.layers.get(layer).ok_or_else(|| Error::Kv(format!("layer {layer} has no storage")))
    }

    fn layer_mut(&mut self, layer: usize) -> Result<&mut (Array, Array)> {
        self.layers.get_mut(layer).ok_or_else(|| Error::Kv(format!("layer {layer} has no storage")))
    }

    /// Append `n` rows filled with `value` to every layer. MLX arrays cannot grow in place, so
    /// this copies the existing rows once; callers grow geometrically.
    pub(crate) fn grow(&mut self, n: usize, value: f32) -> Result<()> {
        if self.layers.is_empty() {
            for _ in 0..self.shape.layers {
                self.layers.push((self.filled(n, value)?, self.filled(n, value)?));
            }
        } else {
            let fresh = self.filled(n, value)?;
            for (k, v) in &mut self.layers {
                *k = mlx_rs::ops::concatenate(&[&*k, &fresh], 1)?;
                *v = mlx_rs::ops::concatenate(&[&*v, &fresh], 1)?;
            }
        }
        self.rows += n;
        Ok(())
    }

    /// Replace every layer's K and V by `f(array)`, which must return `rows` rows (the dense
    /// backend re-lays its slots when their capacity grows).
    pub(crate) fn relayout(&mut self, rows: usize, f: impl Fn(&Array) -> Result<Array>) -> Result<()> {
        for (k, v) in &mut self.layers {
            *k = f(k)?;
            *v = f(v)?;
        }
        self.rows = rows;
        Ok(())
    }

    /// `[H, rows, D]` as `[H, groups, rows / groups, D]` (a view).
    pub(crate) fn grouped(&self, layer: usize, groups: usize) -> Result<(Array, Array)> {
        let (k, v) = self.layer(layer)?;
        let shape = [self.heads(), groups as i32, (self.rows / groups.max(1)) as i32, self.dim()];
        Ok((k.reshape(&shape)?, v.reshape(&shape)?))
    }

    /// Rows `first..first + n` of one layer, `[1, H, n, D]` (views).
    pub(crate) fn span(&self, layer: usize, first: usize, n: usize) -> Result<(Array, Array)> {
        let (k, v) = self.layer(layer)?;
        let r = first as i32..(first + n) as i32;
        Ok((k.index((.., r.clone(), ..)).expand_dims(0)?, v.index((.., r, ..)).expand_dims(0)?))
    }

    /// Write `k`, `v` (`[1, H, n, D]`) to rows `first..first + n` of one layer.
    pub(crate) fn write_span(&mut self, layer: usize, first: usize, k: &Array, v: &Array) -> Result<()> {
        let n = k.shape()[2] as usize;
        let (ks, vs) = self.layer_mut(layer)?;
        let r = first as i32..(first + n) as i32;
        ks.try_index_mut((.., r.clone(), ..), k.squeeze_axes(&[0])?)?;
        vs.try_index_mut((.., r, ..), v.squeeze_axes(&[0])?)?;
        Ok(())
    }

    /// Write `k`, `v` (`[B, H, T, D]`) to `rows` (`[B * T]` flat row indices, row-major over
    /// (b, t)) of one layer, in one scatter per array.
    pub(crate) fn scatter(&mut self, layer: usize, rows: &Array, k: &Array, v: &Array) -> Result<()> {
        let n = rows.size() as i32;
        let (h, d) = (self.heads(), self.dim());
        let flat = |x: &Array| -> Result<Array> { Ok(x.transpose_axes(&[1, 0, 2, 3])?.reshape(&[h, n, d])?) };
        let idx = rows.reshape(&[1, n, 1])?;
        let (ks, vs) = self.layer_mut(layer)?;
        *ks = ks.put_along_axis(&idx, flat(k)?, 1)?;
        *vs = vs.put_along_axis(&idx, flat(v)?, 1)?;
        Ok(())
    }

    /// Gather rows for a batch: `index` is [`head_major`](Self::head_major) of `b * w` flat row
    /// indices; the result is `[B, H, W, D]` for K and for V.
    pub(crate) fn gather(&self, layer: usize, index: &Array, b: usize, w: usize) -> Result<(Array, Array)> {
        let (k, v) = self.layer(layer)?;
        let (h, d) = (self.heads(), self.dim());
        let flat = [h * self.rows as i32, d];
        let g = |x: &Array| -> Result<Array> {
            Ok(x.reshape(&flat)?
                .take_axis(index, 0)?
                .reshape(&[h, b as i32, w as i32, d])?
                .transpose_axes(&[1, 0, 2, 3])?)
        };
        Ok((g(k)?, g(v)?))
    }

    /// Index into `[H * rows, D]` for `rows` of every head: `h * self.rows + r`, head-major.
    /// Valid while the store keeps its row count (callers key cached indices by it).
    pub(crate) fn head_major(&self, rows: &[i32]) -> Array {
        let total = self.rows as i32;
        let idx: Vec<i32> = (0..self.heads()).flat_map(|h| rows.iter().map(move |&r| h * total + r)).collect();
        Array::from_slice(&idx, &[idx.len() as i32])
    }

    /// Overwrite rows `first..first + n` of every layer with `value`.
    pub(crate) fn fill(&mut self, first: usize, n: usize, value: f32) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        let fill = self.filled(n, value)?;
        let r = first as i32..(first + n) as i32;
        for (k, v) in &mut self.layers {
            k.try_index_mut((.., r.clone(), ..), &fill)?;
            v.try_index_mut((.., r.clone(), ..), &fill)?;
        }
        Ok(())
    }

    /// Copy rows `src..src + n` over rows `dst..dst + n` in every layer.
    pub(crate) fn copy(&mut self, src: usize, dst: usize, n: usize) -> Result<()> {
        let (s, d) = (src as i32..(src + n) as i32, dst as i32..(dst + n) as i32);
        for (k, v) in &mut self.layers {
            let (ks, vs) = (k.index((.., s.clone(), ..)), v.index((.., s.clone(), ..)));
            k.try_index_mut((.., d.clone(), ..), &ks)?;
            v.try_index_mut((.., d.clone(), ..), &vs)?;
        }
        Ok(())
    }
}

/// A one-entry cache keyed by what its value was built from: every use compares the key, so a
/// stale value can never be served (no invalidation to forget). Every layer of a step asks for
/// the same gather index or mask; this builds it once.
///
/// The value is shared, never cloned: mlx-rs's `Array::clone` panics on an array a failed device
/// operation left empty (seen on MLX's CUDA backend after an illegal memory access), where the
/// next MLX operation on it returns an error that reaches the row.
pub(crate) struct Memo<K, V>(std::cell::RefCell<Option<(K, Rc<V>)>>);

/// A copy starts empty: what it memoized is rebuilt on first use, never shared between stores.
impl<K, V> Clone for Memo<K, V> {
    fn clone(&self) -> Self {
        Memo(std::cell::RefCell::new(None))
    }
}

impl<K: PartialEq, V> Memo<K, V> {
    pub(crate) fn new() -> Self {
        Memo(std::cell::RefCell::new(None))
    }

    pub(crate) fn get_or_try(&self, key: K, build: impl FnOnce(&K) -> Result<V>) -> Result<Rc<V>> {
        let mut slot = self.0.borrow_mut();
        if let Some((k, v)) = slot.as_ref()
            && *k == key
        {
            return Ok(Rc::clone(v));
        }
        let v = Rc::new(build(&key)?);
        *slot = Some((key, Rc::clone(&v)));
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value whose clone fails loudly, as mlx-rs's `Array::clone` does on an array a failed
    /// device operation left empty.
    struct NoClone(u32);

    impl Clone for NoClone {
        fn clone(&self) -> Self {
            panic!("Memo cloned its value")
        }
    }

    #[test]
    fn memo_shares_its_value_and_rebuilds_on_a_new_key() {
        let memo = Memo::new();
        let mut builds = 0;
        let a = memo
            .get_or_try(1, |_| {
                builds += 1;
                Ok(NoClone(10))
            })
            .expect("built");
        let b = memo
            .get_or_try(1, |_| {
                builds += 1;
                Ok(NoClone(11))
            })
            .expect("served");
        assert!(Rc::ptr_eq(&a, &b), "the same key must serve the value it built");
        let c = memo
            .get_or_try(2, |_| {
                builds += 1;
                Ok(NoClone(20))
            })
            .expect("rebuilt");
        assert_eq!((builds, a.0, c.0), (2, 10, 20));
    }
}
