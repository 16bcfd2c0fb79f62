//! Attention over a paged cache's rows where they lie, on the CPU.
//!
//! MLX's CPU backend has no paged attention: a batched read of a paged cache gathers every
//! sequence's rows into one `[B, kv_heads, W, D]` copy a layer, K and V, every step, and
//! attention multiplies the copy. At batch 32 that copy was a quarter of a SmolLM2 decode step
//! (dense attention reads its slots as views), all of paged's distance from dense.
//!
//! ci/blas/gemv_forward.c, the BLAS in front of OpenBLAS, runs attention's products over the
//! copy (a few query rows by an operand under 64 Ki elements) with every output element one
//! fused multiply-add chain over k in order from zero. Its `parity_rows_scores` and
//! `parity_rows_values` compute the same chains reading each key and value row from the
//! store, so this path's output is the copy's to the bit
//! (`tests::in_place_attention_is_the_gathered_copy_s_bit_for_bit`). It runs only where that
//! holds: float32 keys and queries on the CPU with the shim's chains, at most `TINY_ROWS` query
//! rows, an operand under `CHAIN_ELEMENTS`. Anywhere else the gathered copy is attended as
//! before.
//!
//! The products are operations of the step's graph (`in_place.cpp`, an MLX primitive that
//! calls the shim on MLX's CPU stream), so nothing waits: run on the host between waits for the
//! queries and the softmax, two a layer, they cost a decode step its pipelining (the host could
//! not build step n + 1 while step n ran): a batch-32 SmolLM2 step 7-11% slower than dense's.
//! The mask is MLX's and the softmax [`super::attend_keys`]'s fused one, which is MLX's to the
//! bit at any size (the test holds this path to MLX's own attention under the size
//! `attend_keys` fuses at, too).

use std::sync::OnceLock;

use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::{Array, Dtype};

use crate::error::Result;
use crate::kv::StoreRows;

/// The shim's `TinyRows`: products of more query rows go to OpenBLAS, whose sums are not chains.
const TINY_ROWS: i32 = 8;
/// The shim's `MinForwardElements`: a larger operand goes to OpenBLAS.
const CHAIN_ELEMENTS: i64 = 65536;

type ChainsFn = unsafe extern "C" fn() -> i32;
type RowsFn = unsafe extern "C" fn(i32, i32, *const f32, i32, *const f32, i32, *const i32, i32, *mut f32, i32);

#[cfg(parity_rows_primitive)]
unsafe extern "C" {
    /// `in_place.cpp`: the lazy product of `a` by the rows `rows` of `store`, shaped `shape`.
    fn parity_rows_product(
        res: *mut mlx_sys::mlx_array,
        a: mlx_sys::mlx_array,
        store: mlx_sys::mlx_array,
        rows: mlx_sys::mlx_array,
        product: RowsFn,
        values: i32,
        batch: i32,
        kv_heads: i32,
        rows_per: i32,
        l: i32,
        shape: *const i32,
        ndim: i32,
        err: *mut libc::c_char,
        err_len: usize,
    ) -> i32;
}

/// Attention's two products over the rows.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Product {
    Scores,
    Values,
}

#[cfg_attr(not(parity_rows_primitive), expect(dead_code, reason = "only the primitive calls the products"))]
struct Shim {
    scores: RowsFn,
    values: RowsFn,
}

/// The shim's products over rows, where it is loaded and runs its chains on this CPU, and the
/// primitive that runs them is built in.
fn shim() -> Option<&'static Shim> {
    static SHIM: OnceLock<Option<Shim>> = OnceLock::new();
    SHIM.get_or_init(|| {
        if !cfg!(parity_rows_primitive) {
            return None;
        }
        let symbol = crate::environment::loaded_symbol;
        let (chains, scores, values) =
            (symbol(c"parity_rows_chains")?, symbol(c"parity_rows_scores")?, symbol(c"parity_rows_values")?);
        // SAFETY: ci/blas/gemv_forward.c defines these functions with these signatures.
        unsafe {
            let chains = std::mem::transmute::<*mut libc::c_void, ChainsFn>(chains);
            (chains() != 0).then(|| Shim {
                scores: std::mem::transmute::<*mut libc::c_void, RowsFn>(scores),
                values: std::mem::transmute::<*mut libc::c_void, RowsFn>(values),
            })
        }
    })
    .as_ref()
}

/// Attention in place for one layer's queries over the rows a read names, where it gives the
/// copy's bits (see the module docs): [`plan`] checks, [`InPlace::attend`] builds.
pub(super) struct InPlace<'a> {
    #[cfg_attr(not(parity_rows_primitive), expect(dead_code, reason = "only the primitive calls the products"))]
    shim: &'static Shim,
    at: &'a StoreRows,
    /// The queries' `[B, H, T, D]`, and the keys a sequence reads.
    q_shape: [i32; 4],
    l: i32,
}

/// Attention in place for `q` (`[B, H, T, D]`) over the rows `at` names, `l` a sequence, or
/// `None` where it would not give the copy's bits.
pub(super) fn plan<'a>(q: &Array, at: &'a StoreRows, l: i32) -> Option<InPlace<'a>> {
    let (&[b, h, t, d], &[kv_heads, total, _]) = (q.shape(), at.keys.shape()) else {
        return None;
    };
    let fits = q.dtype() == Dtype::Float32
        && at.keys.dtype() == Dtype::Float32
        && at.values.dtype() == Dtype::Float32
        && at.keys.shape() == [kv_heads, total, d]
        && at.values.shape() == at.keys.shape()
        && h % kv_heads == 0
        && t <= TINY_ROWS
        && i64::from(l) * i64::from(d) < CHAIN_ELEMENTS
        && at.rows.len() == (b * l) as usize
        && at.index.shape() == [b * l]
        // The primitive reads each row's `d` floats at its index unchecked: every index inside
        // the store. (`index` holds `rows`' numbers.)
        && at.rows.iter().all(|&r| (0..total).contains(&r))
        && crate::environment::device() == "cpu";
    let shim = shim().filter(|_| fits)?;
    Some(InPlace { shim, at, q_shape: [b, h, t, d], l })
}

impl InPlace<'_> {
    /// The layer's key store the rows are read from.
    pub(super) fn stored_keys(&self) -> &Array {
        &self.at.keys
    }

    /// What [`super::attend_keys`] returns over the gathered copy, computed where the rows lie;
    /// `None` (attend the copy) for queries of another shape than planned.
    pub(super) fn attend(
        &self,
        q: &Array,
        scale: f32,
        mask: Option<ScaledDotProductAttentionMask<'_>>,
    ) -> Result<Option<Array>> {
        if q.shape() != self.q_shape {
            return Ok(None);
        }
        let ([b, h, t, d], l, at) = (self.q_shape, self.l, self.at);
        let kv_heads = at.keys.shape()[0];
        let repeats = h / kv_heads;
        let q = mlx_rs::array!(scale).multiply(q)?;
        let shape: &[i32] = if repeats > 1 { &[b, kv_heads, repeats, t, l] } else { &[b, h, t, l] };
        let scores = self.product(Product::Scores, &q, &at.keys, shape)?;
        let weights = super::weights(scores, mask, kv_heads, repeats, t, l)?;
        // A mask of another shape would have broadcast the weights past the rows read below.
        if weights.shape() != shape {
            return Ok(None);
        }
        Ok(Some(self.product(Product::Values, &weights, &at.values, &[b, h, t, d])?))
    }

    /// The shim's `which` product for every (batch row, kv head) pair: its `repeats * t` rows of
    /// `a` by the store rows its sequence reads from that head's store, shaped `shape` (the
    /// primitive derives each side's width from the kind: scores `a` d wide into l columns,
    /// values `a` l wide into d columns).
    #[cfg(parity_rows_primitive)]
    fn product(&self, which: Product, a: &Array, store: &Array, shape: &[i32]) -> Result<Array> {
        let [b, h, t, _] = self.q_shape;
        let kv_heads = self.at.keys.shape()[0];
        let product = match which {
            Product::Scores => self.shim.scores,
            Product::Values => self.shim.values,
        };
        let mut res = mlx_sys::mlx_array { ctx: std::ptr::null_mut() };
        let mut err = [0 as libc::c_char; 256];
        // SAFETY: the handles are live arrays for the call; the primitive checks the operands'
        // types and sizes against the geometry, and `plan` checked every row index to be under
        // the store's rows, which is all it reads unchecked. On success `res` holds a new
        // array this side owns.
        let status = unsafe {
            parity_rows_product(
                &mut res,
                a.as_ptr(),
                store.as_ptr(),
                self.at.index.as_ptr(),
                product,
                i32::from(which == Product::Values),
                b,
                kv_heads,
                h / kv_heads * t,
                self.l,
                shape.as_ptr(),
                shape.len() as i32,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if status != 0 {
            // SAFETY: the primitive wrote a terminated message into `err`.
            let message = unsafe { std::ffi::CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned();
            return Err(crate::error::Error::Invalid(message));
        }
        // SAFETY: `res` is the new array the call made.
        Ok(unsafe { Array::from_ptr(res) })
    }

    /// Never reached: without the primitive `shim()` is `None`, so nothing is planned in place.
    #[cfg(not(parity_rows_primitive))]
    fn product(&self, _: Product, _: &Array, _: &Array, _: &[i32]) -> Result<Array> {
        Err(crate::error::Error::Invalid("attention in place needs parity's MLX primitive, not built here".into()))
    }
}

#[cfg(test)]
mod tests {
    use std::rc::Rc;

    use super::*;

    /// Attention in place must be the gathered copy's to the bit: a chain summed in another
    /// order, a padding column read from another row, or a head's store read at another's
    /// offset would move every paged row's logits away from dense's. Ragged rows with padding,
    /// blocks out of order, rows no sequence reads poisoned with NaN (they must stay unread),
    /// grouped and plain heads, head sizes under, at and past the shim's 64-column blocks, one
    /// query row and several (a strided view, as a layer's are, read in the wrong order if taken
    /// as row-major), each mask kind.
    #[test]
    fn in_place_attention_is_the_gathered_copy_s_bit_for_bit() {
        crate::environment::use_device(crate::environment::DeviceChoice::Cpu).expect("the CPU is always there");
        if shim().is_none() {
            eprintln!("no BLAS shim with its chains is loaded: nothing runs in place here");
            return;
        }
        let cases = [
            (4, 9, 3, 1, 64, &[37, 128, 5, 100][..]),
            (3, 9, 3, 1, 64, &[160, 160, 160][..]),
            (2, 4, 4, 3, 32, &[200, 57][..]),
            (2, 4, 4, 3, 32, &[180, 180][..]),
            (2, 8, 2, 1, 80, &[260, 255][..]),
            // Under the size the copy's softmax is fused at: MLX's own attention over the copy.
            (2, 9, 3, 1, 64, &[150, 190][..]),
            (1, 9, 3, 1, 64, &[100][..]),
            (1, 4, 4, 2, 64, &[20][..]),
        ];
        for (b, h, kv_heads, t, d, lens) in cases {
            let what = format!("{b}x{h}/{kv_heads} heads, {t} queries, head size {d}, lengths {lens:?}");
            let l = *lens.iter().max().expect("rows") as i32;
            let (bs, total) = (4usize, 2048usize);
            // Block j of row r is 7 (131 r + j) mod 512: out of order, and no two rows share one.
            let mut rows = Vec::new();
            let mut read = vec![false; total];
            for (r, &len) in lens.iter().enumerate() {
                let own: Vec<i32> =
                    (0..len).map(|p| ((7 * (r * 131 + p / bs)) % (total / bs) * bs + p % bs) as i32).collect();
                for &x in &own {
                    read[x as usize] = true;
                }
                rows.extend_from_slice(&own);
                rows.extend(std::iter::repeat_n(own[0], l as usize - len));
            }
            let normal = |shape: &[i32]| mlx_rs::random::normal::<f32>(shape, None, None, None).unwrap();
            let poisoned = |a: Array| {
                let mut host = a.as_slice::<f32>().to_vec();
                for (x, v) in host.iter_mut().enumerate() {
                    if !read[x / d as usize % total] {
                        *v = f32::NAN;
                    }
                }
                Array::from_slice(&host, a.shape())
            };
            let keys = poisoned(normal(&[kv_heads, total as i32, d]));
            let values = poisoned(normal(&[kv_heads, total as i32, d]));
            // Laid out as a layer's queries are, a transposed `[B, T, H, D]`: strided where t > 1.
            let q = normal(&[b, t, h, d]).multiply(mlx_rs::array!(3.0)).unwrap().transpose_axes(&[0, 2, 1, 3]).unwrap();
            let index: Vec<i32> =
                (0..kv_heads).flat_map(|hk| rows.iter().map(move |&r| hk * total as i32 + r)).collect();
            let index = Array::from_slice(&index, &[index.len() as i32]);
            let gathered = |s: &Array| {
                s.reshape(&[kv_heads * total as i32, d])
                    .and_then(|s| s.take_axis(&index, 0))
                    .and_then(|s| s.reshape(&[kv_heads, b, l, d]))
                    .and_then(|s| s.transpose_axes(&[1, 0, 2, 3]))
                    .unwrap()
            };
            let (kg, vg) = (gathered(&keys), gathered(&values));
            // Query j of row r sits at position len - t + j and sees the positions up to it.
            let visible: Vec<bool> = lens
                .iter()
                .flat_map(|&len| {
                    (0..t as usize)
                        .flat_map(move |j| (0..l as usize).map(move |c| c < len && c + t as usize <= len + j))
                })
                .collect();
            let rows_mask = Array::from_slice(&visible, &[b, 1, t, l]);
            let uniform = lens.iter().all(|&n| n == l as usize);
            let mask = || match (uniform, t) {
                (true, 1) => None,
                (true, _) => Some(ScaledDotProductAttentionMask::Causal),
                (false, _) => Some(ScaledDotProductAttentionMask::Array(&rows_mask)),
            };
            let index = Array::from_slice(&rows, &[rows.len() as i32]);
            let at = StoreRows { keys, values, rows: Rc::new(rows), index };
            let planned = plan(&q, &at, l).expect("the case runs in place");
            let copy = super::super::attend_keys(&q, &kg, &vg, 0.125, mask()).unwrap();
            let ours = planned.attend(&q, 0.125, mask()).unwrap().expect("in place");
            assert_eq!(ours.shape(), copy.shape(), "{what}");
            let (ours, copy) = (ours.as_slice::<f32>(), copy.as_slice::<f32>());
            assert!(copy.iter().all(|x| x.is_finite()), "{what}: the copy read a poisoned row");
            let differ = ours.iter().zip(copy).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
            assert_eq!(differ, 0, "{what}: {differ} of {} values differ", copy.len());
            // The primitive reads raw pointers: a shape that does not fit the geometry is an
            // error when the graph is built, never a read past an operand.
            let wrong = [b, h, t, l + 1];
            let refused = planned.product(Product::Scores, &q, &at.keys, &wrong);
            assert!(refused.is_err_and(|e| e.to_string().contains("[parity rows]")), "{what}: a misfit shape built");
        }
    }
}
