//! Packed twins: a quantized checkpoint's weights dequantized to float32 at load are read, in
//! the products of a decode step, from their packed form instead.
//!
//! A checkpoint quantized to 4 bits and dequantized at load (`dequantize = true`: MLX's CPU
//! quantized matmul runs on one thread) holds every weight as a float32 `scale * q + bias`. A
//! decode step at batch 1 reads all of those floats, 32 bits each, for 4 bits of information:
//! SmolLM2-135M's step reads 540 MB where 100 MB would do. ci/blas/gemv_forward.c, the BLAS in
//! front of OpenBLAS that runs a step's products of 1 to 12 rows, takes the packed form of such
//! a matrix as its twin and computes each weight in registers as it multiplies. It compares every
//! weight of a twin, bit for bit, with the float32 matrix before it uses it, sums in the order
//! it sums the floats, and checks that a row's sums through the twin are the float kernel's on
//! this CPU's build, so a product's bits are the same with or without a twin: what
//! moves is the bytes a step reads, not a logit.
//!
//! Without that BLAS (macOS, a GPU, `PARITY_NETLIB_BLAS=1`) there is nothing to register with
//! and the float32 matrices are read as before.

use std::sync::OnceLock;

use mlx_rs::{Array, Dtype};

use crate::checkpoint::QuantSpec;

type PackedFn = unsafe extern "C" fn(*const f32, i32, i32, *const u32, *const f32, *const f32, i32, i32) -> i32;
type DropFn = unsafe extern "C" fn(*const f32);
type OfFn = unsafe extern "C" fn(*const f32) -> i32;
type MaxRowsFn = unsafe extern "C" fn() -> i32;

/// The shim's entry points, looked up once in the loaded objects.
struct Shim {
    packed: PackedFn,
    drop: DropFn,
    of: OfFn,
    max_rows: MaxRowsFn,
}

fn shim() -> Option<&'static Shim> {
    static SHIM: OnceLock<Option<Shim>> = OnceLock::new();
    SHIM.get_or_init(|| {
        let symbol = crate::environment::loaded_symbol;
        let (packed, drop, of, max_rows) = (
            symbol(c"parity_twin_packed")?,
            symbol(c"parity_twin_drop")?,
            symbol(c"parity_twin_of")?,
            symbol(c"parity_twin_max_rows")?,
        );
        // SAFETY: ci/blas/gemv_forward.c defines these functions with these signatures.
        unsafe {
            Some(Shim {
                packed: std::mem::transmute::<*mut libc::c_void, PackedFn>(packed),
                drop: std::mem::transmute::<*mut libc::c_void, DropFn>(drop),
                of: std::mem::transmute::<*mut libc::c_void, OfFn>(of),
                max_rows: std::mem::transmute::<*mut libc::c_void, MaxRowsFn>(max_rows),
            })
        }
    })
    .as_ref()
}

/// A float32 matrix's packed twin, registered with the BLAS for as long as this lives. Owned
/// next to the matrix and dropped before it (a twin outliving its matrix would stand for
/// whatever array MLX puts at that address next).
pub struct Twin {
    key: *const f32,
    /// What the BLAS reads of it: the packed words, the scales and the biases.
    bytes: u64,
}

// SAFETY: the key is never dereferenced on this side, only handed back to the shim, whose
// registry is safe to call from any thread.
unsafe impl Send for Twin {}
unsafe impl Sync for Twin {}

impl Twin {
    /// The twin of `weight_t` (`[in, out]` float32, contiguous) from MLX's packed affine form of
    /// its transpose: `packed` `[out, in * bits / 32]` uint32, `scales` and `biases`
    /// `[out, in / group]` float32. `None` where there is no BLAS to register with, the arrays
    /// are not of that form, or a weight of the twin is not the matrix's to the bit.
    pub fn packed(weight_t: &Array, packed: &Array, scales: &Array, biases: &Array, spec: QuantSpec) -> Option<Twin> {
        let shim = shim()?;
        let (k, n) = matrix(weight_t)?;
        let per_word = 32 / spec.bits.max(1);
        let words = k.checked_mul(spec.bits)? / 32;
        let groups = k / spec.group_size.max(1);
        if packed.dtype() != Dtype::Uint32
            || packed.shape() != [n as i32, words as i32]
            || [scales, biases].iter().any(|a| a.dtype() != Dtype::Float32 || a.shape() != [n as i32, groups as i32])
            || k % per_word != 0
        {
            return None;
        }
        let key = weight_t.as_slice::<f32>().as_ptr();
        let (p, s, b) = (packed.as_slice::<u32>(), scales.as_slice::<f32>(), biases.as_slice::<f32>());
        let (group, bits) = (i32::try_from(spec.group_size).ok()?, i32::try_from(spec.bits).ok()?);
        // SAFETY: every pointer covers the shape the call is given (checked above); the shim
        // copies what it keeps.
        let ok = unsafe { (shim.packed)(key, k as i32, n as i32, p.as_ptr(), s.as_ptr(), b.as_ptr(), group, bits) };
        let bytes = (p.len() * 4 + s.len() * 4 + b.len() * 4) as u64;
        (ok == 1).then_some(Twin { key, bytes })
    }

    /// Bytes a product reads from this twin.
    pub fn nbytes(&self) -> u64 {
        self.bytes
    }

    /// Products of up to this many rows read a twin; more read the float32 matrix (the BLAS's
    /// choice: past it computing each weight again costs more than the bytes it saves).
    pub fn max_rows() -> usize {
        // SAFETY: takes nothing, returns a constant.
        shim().map_or(0, |s| unsafe { (s.max_rows)() }.max(0) as usize)
    }

    /// Whether there is a BLAS to register twins with (ci/blas/gemv_forward.c in front of
    /// OpenBLAS, as ci/setup puts it).
    pub fn available() -> bool {
        shim().is_some()
    }

    /// Whether the BLAS holds a twin of `weight_t` now (`None`: no BLAS to hold any).
    pub fn of(weight_t: &Array) -> Option<bool> {
        let shim = shim()?;
        let key = weight_t.as_slice::<f32>().as_ptr();
        // SAFETY: the shim only compares the pointer with its registered keys.
        Some(unsafe { (shim.of)(key) } == 1)
    }
}

impl Drop for Twin {
    fn drop(&mut self) {
        if let Some(shim) = shim() {
            // SAFETY: unregisters by key; waits for any product reading the twin.
            unsafe { (shim.drop)(self.key) }
        }
    }
}

/// `[k, n]` of a contiguous float32 matrix with both in `i32`.
fn matrix(a: &Array) -> Option<(usize, usize)> {
    let shape = a.shape();
    if a.dtype() != Dtype::Float32 || shape.len() != 2 || shape.iter().any(|&d| d <= 0) {
        return None;
    }
    let (k, n) = (shape[0] as usize, shape[1] as usize);
    // The pointer the shim keys by must be the one MLX hands BLAS: the array's own data, whole.
    (a.as_slice::<f32>().len() == k * n).then_some((k, n))
}

#[cfg(test)]
mod tests {
    use mlx_rs::Array;
    use mlx_rs::ops::indexing::IndexOp;

    use super::*;
    use crate::checkpoint::{Quantization, WeightStore};
    use crate::model::layers::{Linear, LoadOptions, Stacked};

    /// A random `[n, k]` matrix quantized as MLX quantizes a checkpoint, and its dequantized
    /// float32 transpose `[k, n]`, made contiguous as parity's loader makes it.
    fn quantized(k: i32, n: i32, spec: QuantSpec) -> (Array, [Array; 3]) {
        let w = mlx_rs::random::normal::<f32>(&[n, k], None, None, None).unwrap();
        let (group, bits) = (spec.group_size as i32, spec.bits as i32);
        let (q, s, b) = mlx_rs::ops::quantize(&w, group, bits).unwrap();
        let dense = mlx_rs::ops::dequantize(&q, &s, &b, group, bits).unwrap();
        let t = dense.t().contiguous().unwrap();
        t.eval().unwrap();
        (t, [q, s, b])
    }

    /// `m` rows of `x` by `w`, as bits.
    fn product(x: &Array, m: i32, w: &Array) -> Vec<u32> {
        let y = x.index(..m).matmul(w).unwrap();
        y.eval().unwrap();
        y.as_slice::<f32>().iter().map(|v| v.to_bits()).collect()
    }

    /// Guards a twin against moving a bit of any product it serves: every row count it takes
    /// (and the next, which must go back to the floats), every packing a checkpoint uses,
    /// runs of K that start inside a group, columns past the last whole 8. A weight computed
    /// otherwise than MLX's dequantize (an fma where MLX rounds twice), a sum taken in another
    /// order or a column left over would each change the product bits here.
    #[test]
    fn a_product_through_its_packed_twin_is_the_float32_product_bit_for_bit() {
        crate::environment::use_device(crate::environment::DeviceChoice::Cpu).expect("the CPU is always there");
        if !Twin::available() {
            return;
        }
        let rows = Twin::max_rows() as i32 + 1;
        for (bits, group, k, n) in [(4, 32, 576, 960), (4, 64, 1536, 200), (8, 32, 576, 124), (2, 32, 640, 232)] {
            let spec = QuantSpec { group_size: group, bits };
            let (w, [q, s, b]) = quantized(k, n, spec);
            let x = mlx_rs::random::normal::<f32>(&[rows, k], None, None, None).unwrap();
            let floats: Vec<Vec<u32>> = (1..=rows).map(|m| product(&x, m, &w)).collect();
            let twin = Twin::packed(&w, &q, &s, &b, spec);
            // Refused if a weight is not MLX's float or the twin's sums are not the float
            // kernel's on this CPU's build (the shim checks both at registration).
            assert!(twin.is_some(), "{bits}-bit group {group} {k}x{n}: the twin of MLX's dequantized weights refused");
            assert_eq!(Twin::of(&w), Some(true));
            for m in 1..=rows {
                assert!(product(&x, m, &w) == floats[m as usize - 1], "{bits}-bit {k}x{n}, {m} rows");
            }
            drop(twin);
            assert_eq!(Twin::of(&w), Some(false), "a dropped twin is unregistered");
        }
    }

    /// A twin is used only where every weight is the matrix's: one weight off and it is refused
    /// (the products then read the floats), as is a twin of the wrong shape or a second twin.
    #[test]
    fn a_twin_that_is_not_its_matrix_is_refused() {
        crate::environment::use_device(crate::environment::DeviceChoice::Cpu).expect("the CPU is always there");
        if !Twin::available() {
            return;
        }
        let spec = QuantSpec { group_size: 32, bits: 4 };
        let (w, [q, s, b]) = quantized(256, 256, spec);
        let mut values = w.as_slice::<f32>().to_vec();
        values[256 * 100 + 7] = f32::from_bits(values[256 * 100 + 7].to_bits() ^ 1);
        let off = Array::from_slice(&values, &[256, 256]);
        assert!(Twin::packed(&off, &q, &s, &b, spec).is_none(), "one weight a bit off");
        let wrong = QuantSpec { group_size: 64, bits: 4 };
        assert!(Twin::packed(&w, &q, &s, &b, wrong).is_none(), "scales of another group size");
        // One twin a matrix: a second would outlive the first's drop, standing for whatever
        // array MLX puts at that address next.
        let first = Twin::packed(&w, &q, &s, &b, spec);
        assert!(first.is_some());
        assert!(Twin::packed(&w, &q, &s, &b, spec).is_none(), "a second twin of one matrix");
        drop(first);
        assert_eq!(Twin::of(&w), Some(false), "no twin left behind the first");
    }

    /// q, k and v (and gate and up) run as one stacked matmul. Loaded dequantized, the parts are
    /// stacked packed and dequantized once: the stacked floats are the parts' floats side by
    /// side to the bit, one twin stands for them, and its products are the floats'.
    #[test]
    fn a_stacked_matrix_is_dequantized_once_with_one_twin() {
        crate::environment::use_device(crate::environment::DeviceChoice::Cpu).expect("the CPU is always there");
        if !Twin::available() {
            return;
        }
        let spec = QuantSpec { group_size: 32, bits: 4 };
        let dir = std::env::temp_dir().join(format!("parity-stacked-twin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut tensors: Vec<(String, Array)> = Vec::new();
        let mut floats: Vec<Array> = Vec::new();
        for (name, n) in [("q", 576), ("k", 192), ("v", 192)] {
            let (w, [q, s, b]) = quantized(576, n, spec);
            floats.push(w);
            for (t, a) in [("weight", q), ("scales", s), ("biases", b)] {
                tensors.push((format!("l.{name}.{t}"), a));
            }
        }
        Array::save_safetensors(tensors.iter().map(|(n, a)| (n.as_str(), a)), None, dir.join("model.safetensors"))
            .unwrap();
        let mut w = WeightStore::load(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let quant = Quantization { default: spec, overrides: Default::default() };
        let opts = LoadOptions { compute: Some(Dtype::Float32), dequantize: true };
        let parts = [("q", 576), ("k", 192), ("v", 192)].map(|(p, n)| (format!("l.{p}"), 576, n));
        let stacked = Stacked::load(&mut w, Some(&quant), &parts, false, &opts).unwrap();
        let Stacked::One { linear: Linear::Dense { twin, weight_t, .. }, .. } = &stacked else {
            panic!("three parts of one packing stack into one float32 matmul")
        };
        let side_by_side = mlx_rs::ops::concatenate(&floats.iter().collect::<Vec<_>>(), 1).unwrap();
        let bits = |a: &Array| a.as_slice::<f32>().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert!(bits(weight_t) == bits(&side_by_side), "the stacked floats are the parts' floats");
        assert!(twin.is_some(), "the stacked matrix has a twin");
        assert_eq!(twin.as_ref().map(Twin::nbytes), Some((576 * 960 / 2 + 2 * 18 * 960 * 4) as u64));
        let rows = Twin::max_rows() as i32;
        let x = mlx_rs::random::normal::<f32>(&[rows, 576], None, None, None).unwrap();
        let copy = Array::from_slice(weight_t.as_slice::<f32>(), &[576, 960]);
        for m in 1..=rows {
            assert!(product(&x, m, weight_t) == product(&x, m, &copy), "the stacked twin's product, {m} rows");
        }
    }
}
