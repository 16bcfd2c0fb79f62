//! Comparing a path with its reference: tokens, first divergence, per-step logit metrics and
//! the verdict.
//!
//! Logit metrics are reduced on the device over the full vocabulary row that selected each
//! token; only a few scalars per step reach the host. At a divergence the top-k of both rows
//! is fetched (k values, not the vocabulary).

use mlx_rs::Array;
use serde::{Deserialize, Serialize};

use crate::dtype::DtypeName;
use crate::engine::{Trace, host_f32};
use crate::error::{Error, Result};
use crate::scenario::{PathTrace, StepLayout};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    Identical,
    NearTie,
    Diverged,
    Error,
    Skipped,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Identical => "identical",
            Verdict::NearTie => "near-tie",
            Verdict::Diverged => "diverged",
            Verdict::Error => "error",
            Verdict::Skipped => "skipped",
        }
    }

    /// Severity for "worst of" aggregation: skipped < identical < near-tie < diverged < error.
    pub fn rank(self) -> u8 {
        match self {
            Verdict::Skipped => 0,
            Verdict::Identical => 1,
            Verdict::NearTie => 2,
            Verdict::Diverged => 3,
            Verdict::Error => 4,
        }
    }
}

/// Per-step logit metrics, path `a` against reference `r` on the same vocabulary row.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StepMetrics {
    /// `RMS(a - r) / RMS(r)`.
    pub rel_rms: f32,
    pub max_abs: f32,
    /// `KL(softmax(r) || softmax(a))`, in nats.
    pub kl: f32,
}

/// The top of a logits row: `(token, logit)`, best first.
pub type Top = Vec<(u32, f32)>;

/// What the two sides chose at the first step where they differ, and the logits that decide
/// whether it was a near-tie. Shared by the comparison and the report (flattened there), so
/// the two cannot drift apart field by field.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Choice {
    pub step: usize,
    pub reference_token: u32,
    pub token: u32,
    pub reference_top: Top,
    pub top: Top,
    /// Reference logit gap between its choice and the path's choice.
    pub reference_gap: f32,
    /// Largest logit shift observed between the two rows at this step.
    pub observed_shift: f32,
    /// The shift a near-tie may be explained by: the observed shift, at least the dtype's
    /// spacing at the logits' magnitude.
    pub tie_threshold: f32,
    /// Both tokens are in each other's top-k.
    pub mutual_top_k: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Divergence {
    #[serde(flatten)]
    pub choice: Choice,
    pub layout: StepLayout,
}

/// The comparison of one path with its reference.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PathComparison {
    pub verdict: Verdict,
    pub first_divergence: Option<Divergence>,
    pub steps: Vec<StepMetrics>,
    pub max_rel_rms: f32,
    pub max_kl: f32,
    pub tokens: Vec<u32>,
    pub reference_tokens: Vec<u32>,
}

/// How many top entries to fetch and to use for the mutual top-k test.
pub const TOP_K: usize = 5;

/// Relative spacing of representable numbers (machine epsilon) per dtype.
pub fn epsilon(dtype: DtypeName) -> f32 {
    match dtype {
        DtypeName::Float32 => f32::EPSILON,
        DtypeName::Float16 => 9.765_625e-4,
        DtypeName::Bfloat16 => 7.812_5e-3,
    }
}

/// Metrics for every step, computed on the device as `[S]` vectors.
pub fn step_metrics(reference: &[Array], path: &[Array]) -> Result<Vec<StepMetrics>> {
    let s = reference.len().min(path.len());
    if s == 0 {
        return Ok(Vec::new());
    }
    let f32t = mlx_rs::Dtype::Float32;
    let r = mlx_rs::ops::stack(&reference[..s], 0)?.as_dtype(f32t)?;
    let a = mlx_rs::ops::stack(&path[..s], 0)?.as_dtype(f32t)?;
    let d = a.subtract(&r)?;
    let rms = |x: &Array| -> Result<Array> { Ok(x.square()?.mean_axis(-1, false)?.sqrt()?) };
    let rel = rms(&d)?.divide(&rms(&r)?)?;
    let max_abs = d.abs()?.max_axis(-1, false)?;
    let lr = log_softmax(&r)?;
    let la = log_softmax(&a)?;
    let kl = lr.exp()?.multiply(&lr.subtract(&la)?)?.sum_axis(-1, false)?;
    let (rel, max_abs, kl) = (host_f32(&rel)?, host_f32(&max_abs)?, host_f32(&kl)?);
    Ok((0..s).map(|i| StepMetrics { rel_rms: rel[i], max_abs: max_abs[i], kl: kl[i].max(0.0) }).collect())
}

fn log_softmax(x: &Array) -> Result<Array> {
    let lse = mlx_rs::ops::logsumexp_axis(x, -1, true)?;
    Ok(x.subtract(&lse)?)
}

/// Top-k `(token, logit)` of one row.
pub fn top_k(row: &Array, k: usize) -> Result<Top> {
    let row = row.as_dtype(mlx_rs::Dtype::Float32)?;
    let k = k.min(row.size());
    let neg = row.negative()?;
    let idx = mlx_rs::ops::argsort_axis(&neg, -1)?;
    use mlx_rs::ops::indexing::IndexOp;
    let idx = idx.index(0..k as i32);
    let vals = row.take_axis(&idx, -1)?;
    let idx = idx.as_dtype(mlx_rs::Dtype::Uint32)?;
    idx.eval()?;
    let ids: Vec<u32> = idx.as_slice::<u32>().to_vec();
    let vals = host_f32(&vals)?;
    Ok(ids.into_iter().zip(vals).collect())
}

/// Logit of `token` in `row`.
fn logit(row: &Array, token: u32) -> Result<f32> {
    use mlx_rs::ops::indexing::IndexOp;
    let v = row.index(token as i32).as_dtype(mlx_rs::Dtype::Float32)?;
    v.eval()?;
    Ok(v.item_exact::<f32>())
}

/// Compare one path with its reference. `tolerance` is the largest relative RMS a near-tie
/// may have at its divergence step: a flip caused by a large shift is a divergence.
pub fn compare(reference: &Trace, path: &PathTrace, dtype: DtypeName, tolerance: f32) -> Result<PathComparison> {
    if path.tokens.len() > reference.tokens.len() {
        return Err(Error::Invalid("path ran longer than its reference".into()));
    }
    let steps = step_metrics(&reference.logits, &path.logits)?;
    let max_rel_rms = steps.iter().map(|m| m.rel_rms).fold(0.0, nan_max);
    let max_kl = steps.iter().map(|m| m.kl).fold(0.0, nan_max);
    let first = path.tokens.iter().zip(&reference.tokens).position(|(a, r)| a != r);
    let mut verdict = Verdict::Identical;
    let first_divergence = match first {
        None => None,
        Some(step) => {
            let (r_row, a_row) = (&reference.logits[step], &path.logits[step]);
            let (r_tok, a_tok) = (reference.tokens[step], path.tokens[step]);
            let reference_top = top_k(r_row, TOP_K)?;
            let top = top_k(a_row, TOP_K)?;
            let reference_gap = logit(r_row, r_tok)? - logit(r_row, a_tok)?;
            let m = steps[step];
            let magnitude = reference_top.first().map(|t| t.1.abs()).unwrap_or(0.0);
            let tie_threshold = m.max_abs.max(magnitude * epsilon(dtype));
            let mutual_top_k = reference_top.iter().any(|t| t.0 == a_tok) && top.iter().any(|t| t.0 == r_tok);
            let near_tie = reference_gap <= tie_threshold && mutual_top_k && m.rel_rms <= tolerance;
            verdict = if near_tie { Verdict::NearTie } else { Verdict::Diverged };
            Some(Divergence {
                choice: Choice {
                    step,
                    reference_token: r_tok,
                    token: a_tok,
                    reference_top,
                    top,
                    reference_gap,
                    observed_shift: m.max_abs,
                    tie_threshold,
                    mutual_top_k,
                },
                layout: path.layout.get(step).copied().unwrap_or_default(),
            })
        }
    };
    // NaN anywhere (a poisoned row was read) is a divergence even if argmax happened to agree.
    if verdict == Verdict::Identical && steps.iter().any(|m| !m.rel_rms.is_finite()) {
        verdict = Verdict::Diverged;
    }
    Ok(PathComparison {
        verdict,
        first_divergence,
        steps,
        max_rel_rms,
        max_kl,
        tokens: path.tokens.clone(),
        reference_tokens: reference.tokens[..path.tokens.len()].to_vec(),
    })
}

/// `max` that lets NaN win, so a poisoned step is never hidden by a later clean one.
pub fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(b) }
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
