//! Small operations on MLX arrays that every layer above needs: greedy choice, host copies,
//! finiteness. Full-vocabulary rows stay on the device; only what a caller asks for (B ids, a
//! few scalars, a step index) reaches the host.

use mlx_rs::Array;

use crate::error::{Error, Result};

/// Argmax of each row of `[B, vocab]` logits, brought to the host as B integers.
pub fn greedy(logits: &Array) -> Result<Vec<u32>> {
    let ids = mlx_rs::ops::indexing::argmax_axis(logits, -1, false)?;
    ids.eval()?;
    Ok(ids.as_slice::<u32>().to_vec())
}

/// A small array's values on the host as f32 (contiguous copy first; views are not).
pub fn host_f32(a: &Array) -> Result<Vec<f32>> {
    let a = a.as_dtype(mlx_rs::Dtype::Float32)?.contiguous()?;
    a.eval()?;
    Ok(a.as_slice::<f32>().to_vec())
}

/// Split `[B, vocab]` into B rows of `[vocab]`.
pub fn rows(logits: &Array) -> Result<Vec<Array>> {
    use mlx_rs::ops::indexing::IndexOp;
    let b = logits.shape()[0];
    Ok((0..b).map(|i| logits.index(i)).collect())
}

/// The first step whose logits hold a NaN or an infinity, if any: one reduction on the device
/// over every step, one small host copy.
///
/// A non-finite *reference* is not a KV bug (the reference reads no pool): the checkpoint or
/// the runtime produces it, and blaming the pool would send an engineer to the wrong code.
pub fn first_non_finite(logits: &[Array]) -> Result<Option<usize>> {
    if logits.is_empty() {
        return Ok(None);
    }
    let all = mlx_rs::ops::stack(logits, 0)?;
    let finite = all.is_finite()?.all_axis(-1, false)?;
    finite.eval()?;
    Ok(finite.as_slice::<bool>().iter().position(|&ok| !ok))
}

/// [`first_non_finite`] as an error naming the step: `what` says whose logits they are.
pub fn require_finite(what: &'static str, logits: &[Array]) -> Result<()> {
    match first_non_finite(logits)? {
        None => Ok(()),
        Some(step) => Err(Error::NonFinite { what, step }),
    }
}
