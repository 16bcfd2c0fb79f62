//! Comparing a run with its reference, on what each kind of engine can show: a stepped path's
//! full logits ([`compare`]) or a server's top-k logprobs ([`compare_logprobs`]). Both give
//! tokens, the first divergence as a [`Choice`], per-step metrics and a verdict, and both
//! adjudicate a flip by the one near-tie rule ([`Choice::near_tie`]).
//!
//! Logit metrics are reduced on the device over the full vocabulary row that selected each
//! token; only a few scalars per step reach the host. At a divergence the top-k of both rows
//! is fetched (k values, not the vocabulary).

use mlx_rs::Array;
use mlx_rs::error::Exception;
use serde::{Deserialize, Serialize};

use crate::array::host_f32;
use crate::dtype::DtypeName;
use crate::error::{Error, Result};
use crate::fused::Fused;
use crate::vocab::{LogprobTrace, PathTrace, PositionSample, Trace, Verdict};

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

impl Choice {
    /// The one near-tie rule: a flip is a near-tie when the reference's gap between the two
    /// tokens is within the shift that can explain it, both tokens are in each other's top-k,
    /// and the step moved no more than the tolerance allows (`shift_within_tolerance`): a flip
    /// caused by a large shift is a divergence, however close the tokens were.
    pub fn near_tie(&self, shift_within_tolerance: bool) -> bool {
        self.mutual_top_k && self.reference_gap <= self.tie_threshold && shift_within_tolerance
    }

    fn verdict(&self, shift_within_tolerance: bool) -> Verdict {
        if self.near_tie(shift_within_tolerance) { Verdict::NearTie } else { Verdict::Diverged }
    }
}

/// Which of several comparisons speaks for a row: the worst verdict, among equals the earliest
/// divergence, among full equals the last. `None` when there is nothing to choose from.
pub fn worst<'a>(compared: impl IntoIterator<Item = (Verdict, Option<&'a Choice>)>) -> Option<usize> {
    compared
        .into_iter()
        .enumerate()
        .max_by_key(|(_, (verdict, choice))| (verdict.rank(), std::cmp::Reverse(choice.map_or(usize::MAX, |c| c.step))))
        .map(|(i, _)| i)
}

/// The comparison of one path with its reference.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PathComparison {
    pub verdict: Verdict,
    pub first_divergence: Option<Choice>,
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
    let kl = kl(&lr, &la)?;
    let (rel, max_abs, kl) = (host_f32(&rel)?, host_f32(&max_abs)?, host_f32(&kl)?);
    Ok((0..s).map(|i| StepMetrics { rel_rms: rel[i], max_abs: max_abs[i], kl: kl[i].max(0.0) }).collect())
}

/// How many top tokens a corpus position's overlap compares.
pub const CORPUS_TOP_K: usize = 10;

/// A corpus read teacher-forced: positions `first..first + n`, the reference's and the path's
/// logits rows after each token (`[V]` each), and the text's next token after each. One
/// reduction on the device per metric over all rows; the host gets a few numbers per position
/// (and the top-k ids for the overlap).
pub fn position_samples(
    reference: &[Array],
    path: &[Array],
    next: &[u32],
    first: usize,
) -> Result<Vec<PositionSample>> {
    let n = reference.len().min(path.len()).min(next.len());
    if n == 0 {
        return Ok(Vec::new());
    }
    let f32t = mlx_rs::Dtype::Float32;
    let r = mlx_rs::ops::stack(&reference[..n], 0)?.as_dtype(f32t)?;
    let a = mlx_rs::ops::stack(&path[..n], 0)?.as_dtype(f32t)?;
    let (lr, la) = (log_softmax(&r)?, log_softmax(&a)?);
    let kl = kl(&lr, &la)?;
    let targets = Array::from_slice(&next[..n].iter().map(|&t| t as i32).collect::<Vec<_>>(), &[n as i32, 1]);
    let p = |l: &Array| -> Result<Vec<f32>> { host_f32(&l.take_along_axis(&targets, -1)?.exp()?) };
    let (p_reference, p_path) = (p(&lr)?, p(&la)?);
    let top = |x: &Array| -> Result<Vec<u32>> {
        let k = CORPUS_TOP_K.min(x.shape()[1] as usize) as i32;
        use mlx_rs::ops::indexing::IndexOp;
        let idx = mlx_rs::ops::argsort_axis(&x.negative()?, -1)?.index((.., 0..k)).as_dtype(mlx_rs::Dtype::Uint32)?;
        let idx = idx.contiguous()?;
        idx.eval()?;
        Ok(idx.as_slice::<u32>().to_vec())
    };
    let (top_r, top_a) = (top(&r)?, top(&a)?);
    let k = top_r.len() / n;
    let kl = host_f32(&kl)?;
    Ok((0..n)
        .map(|i| {
            let (tr, ta) = (&top_r[i * k..(i + 1) * k], &top_a[i * k..(i + 1) * k]);
            let shared = tr.iter().filter(|t| ta.contains(t)).count();
            PositionSample {
                position: first + i,
                kl: kl[i].max(0.0),
                p_reference: p_reference[i],
                p_path: p_path[i],
                top1: tr[0] == ta[0],
                topk_overlap: shared as f32 / k as f32,
            }
        })
        .collect())
}

/// A corpus read through a server: per position the reference's and the path's top-k
/// `(token, logprob)` as the API returned them (sorted most probable first), and the text's
/// next token after each. A server returns no full distribution, so each metric is computed
/// from what it does return, and what it cannot see is stated:
///
/// - KL is that of the two distributions coarsened to the reference's top-k tokens and one
///   bucket for the rest of the vocabulary (the reference's mass outside its top-k against the
///   path's mass outside those tokens). With the path's probability of every such token known,
///   this is a lower bound on the full KL (merging tokens into one bucket never raises KL, the
///   log-sum inequality); the tail's own redistribution is what it cannot see. A reference
///   top-k token missing from the path's top-k has a path probability of at most the path's
///   k-th: it is taken at that bound.
/// - The probability of the next token is the listed one, 0 where a side's top-k does not
///   list it (so a change is off by at most that side's k-th probability).
/// - Top-1 is the first entry of each list, the top-k overlap over the first
///   [`CORPUS_TOP_K`] (or fewer, where fewer were returned).
pub fn topk_position_samples(
    reference: &[Vec<(u32, f64)>],
    path: &[Vec<(u32, f64)>],
    next: &[u32],
    first: usize,
) -> Result<Vec<PositionSample>> {
    let n = reference.len().min(path.len()).min(next.len());
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let (r, a) = (&reference[i], &path[i]);
        let (Some(&(r_top, _)), Some(&(a_top, _)), Some(&(_, a_last))) = (r.first(), a.first(), a.last()) else {
            return Err(Error::Invalid(format!("position {}: a top-k list is empty", first + i)));
        };
        let lp = |list: &[(u32, f64)], t: u32| list.iter().find(|x| x.0 == t).map(|x| x.1);
        let (mut kl, mut r_mass, mut a_mass) = (0f64, 0f64, 0f64);
        for &(t, lr) in r {
            let la = lp(a, t).unwrap_or(a_last);
            let pr = lr.exp();
            kl += pr * (lr - la);
            r_mass += pr;
            a_mass += la.exp();
        }
        // The rest of the vocabulary as one bucket; a rounding may leave a list's mass a hair
        // over 1, and a path that put (nearly) all its mass on the reference's top-k leaves a
        // bucket of ~0: floored where a log needs it, so the term stays finite and large.
        let (r_rest, a_rest) = ((1.0 - r_mass).max(0.0), (1.0 - a_mass).max(f64::MIN_POSITIVE));
        if r_rest > 0.0 {
            kl += r_rest * (r_rest / a_rest).ln();
        }
        let p = |list: &[(u32, f64)]| lp(list, next[i]).map_or(0.0, f64::exp) as f32;
        let k = CORPUS_TOP_K.min(r.len()).min(a.len());
        let shared = r[..k].iter().filter(|x| a[..k].iter().any(|y| y.0 == x.0)).count();
        out.push(PositionSample {
            position: first + i,
            kl: kl.max(0.0) as f32,
            p_reference: p(r),
            p_path: p(a),
            top1: r_top == a_top,
            topk_overlap: shared as f32 / k.max(1) as f32,
        });
    }
    Ok(out)
}

/// `x - logsumexp(x)` over the last axis of float32 rows. On the CPU with the logsumexp spelled
/// out as MLX's kernel computes it (the row's max, `exp` of each difference summed left to
/// right from zero, then `log(sum) + max`, or the max itself where it is infinite) and compiled
/// for the host ([`crate::fused`]): MLX's kernel calls `exp` out of line for each element, and
/// the judge reads every logit of every step it compares. The same bits
/// (`tests::the_judge_s_fused_log_softmax_and_kl_are_mlx_s_bit_for_bit`).
fn log_softmax(x: &Array) -> Result<Array> {
    if crate::environment::device() != "cpu" {
        let lse = mlx_rs::ops::logsumexp_axis(x, -1, true)?;
        return Ok(x.subtract(&lse)?);
    }
    LOG_SOFTMAX.with(|f| f.call(std::slice::from_ref(x)))
}

/// Each row's KL divergence of `la` from `lr` (log-probabilities), `sum(exp(lr) * (lr - la))`,
/// its elementwise terms fused on the CPU as in [`log_softmax`].
fn kl(lr: &Array, la: &Array) -> Result<Array> {
    let terms = if crate::environment::device() == "cpu" {
        KL_TERMS.with(|f| f.call(&[lr.clone(), la.clone()]))?
    } else {
        kl_terms(lr, la)?
    };
    Ok(terms.sum_axis(-1, false)?)
}

thread_local! {
    static LOG_SOFTMAX: Fused = Fused::new(|a: &[Array]| log_softmax_ops(&a[0]));
    static KL_TERMS: Fused = Fused::new(|a: &[Array]| kl_terms(&a[0], &a[1]));
}

fn log_softmax_ops(x: &Array) -> std::result::Result<Array, Exception> {
    let max = x.max_axis(-1, true)?;
    let lse = x.subtract(&max)?.exp()?.sum_axis(-1, true)?.log()?.add(&max)?;
    x.subtract(mlx_rs::ops::select(max.is_inf()?, &max, &lse)?)
}

fn kl_terms(lr: &Array, la: &Array) -> std::result::Result<Array, Exception> {
    lr.exp()?.multiply(lr.subtract(la)?)
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
            let choice = Choice {
                step,
                reference_token: r_tok,
                token: a_tok,
                reference_top,
                top,
                reference_gap,
                observed_shift: m.max_abs,
                tie_threshold,
                mutual_top_k,
            };
            verdict = choice.verdict(m.rel_rms <= tolerance);
            Some(choice)
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

/// A metric as reports carry it: NaN (a poisoned read) becomes `None`, serialised as `null`.
pub fn finite(x: f32) -> Option<f32> {
    x.is_finite().then_some(x)
}

/// `max` that lets NaN win, so a poisoned step is never hidden by a later clean one.
pub fn nan_max(a: f32, b: f32) -> f32 {
    if a.is_nan() || b.is_nan() { f32::NAN } else { a.max(b) }
}

/// Where two runs' logprobs first differ at all (bitwise suites say where and by how much).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FirstDifference {
    pub step: usize,
    /// The token whose logprob differs, or that only one side has in its top-k.
    pub token: u32,
    pub reference: Option<f64>,
    pub path: Option<f64>,
}

/// The comparison of one request with its reference, on what the API returned. The same
/// verdicts and divergence record as [`PathComparison`]; the per-step metric is the largest
/// |delta logprob| over the tokens both top-k lists hold.
#[derive(Debug, Clone, PartialEq)]
pub struct LogprobComparison {
    pub verdict: Verdict,
    pub first_divergence: Option<Choice>,
    pub step_max_delta: Vec<f64>,
    pub max_delta: f64,
    pub first_difference: Option<FirstDifference>,
    pub tokens: Vec<u32>,
    pub reference_tokens: Vec<u32>,
    /// `(reference, path)` token counts when every shared step agrees but the lengths say the
    /// two runs differ: the path stopped short of what it was asked for and the reference did
    /// not, or it ran on where the reference stopped early. The length is then the divergence.
    pub length_mismatch: Option<(usize, usize)>,
}

/// Largest |a - b| over the tokens both top-k lists hold at `step`, and the first token that
/// differs at all (in value, or by being in one list only).
fn step_delta(step: usize, r: &[(u32, f64)], a: &[(u32, f64)]) -> (f64, Option<FirstDifference>) {
    let mut max = 0f64;
    let mut first = None;
    let at = |token, reference, path| Some(FirstDifference { step, token, reference, path });
    for &(t, lr) in r {
        match a.iter().find(|x| x.0 == t) {
            Some(&(_, la)) => {
                max = max.max((la - lr).abs());
                if la.to_bits() != lr.to_bits() && first.is_none() {
                    first = at(t, Some(lr), Some(la));
                }
            }
            None if first.is_none() => first = at(t, Some(lr), None),
            None => {}
        }
    }
    if first.is_none()
        && let Some(&(t, la)) = a.iter().find(|x| !r.iter().any(|y| y.0 == x.0))
    {
        first = at(t, None, Some(la));
    }
    (max, first)
}

/// Compare a request's logprobs with its reference's; the request asked for `asked` tokens. A
/// flip is adjudicated by [`Choice::near_tie`], with the shift observed at that step as its
/// threshold. Any difference at all is reported as the first difference (a `bitwise` suite
/// fails the row on it).
pub fn compare_logprobs(
    reference: &LogprobTrace,
    path: &LogprobTrace,
    tolerance: f64,
    asked: usize,
) -> LogprobComparison {
    let n = reference.steps.len().min(path.steps.len());
    let mut step_max_delta = Vec::with_capacity(n);
    let mut first_difference = None;
    for s in 0..n {
        let (d, first) = step_delta(s, &reference.steps[s], &path.steps[s]);
        step_max_delta.push(d);
        if first_difference.is_none() {
            first_difference = first;
        }
    }
    let max_delta = step_max_delta.iter().copied().fold(0f64, f64::max);
    let first = (0..n).find(|&s| reference.tokens[s] != path.tokens[s]);
    let first_divergence = first.map(|s| {
        let (r, a) = (&reference.steps[s], &path.steps[s]);
        let (r_tok, a_tok) = (reference.tokens[s], path.tokens[s]);
        let lp = |list: &[(u32, f64)], t: u32| list.iter().find(|x| x.0 == t).map(|x| x.1);
        let mutual_top_k = lp(r, a_tok).is_some() && lp(a, r_tok).is_some();
        // Outside the reference's top-k, the gap is at least down to its last entry.
        let floor = r.last().map_or(f64::NEG_INFINITY, |x| x.1);
        let reference_gap = lp(r, r_tok).unwrap_or(0.0) - lp(r, a_tok).unwrap_or(floor);
        let observed = step_max_delta[s];
        let top = |list: &[(u32, f64)]| list.iter().take(TOP_K).map(|&(t, v)| (t, v as f32)).collect::<Top>();
        Choice {
            step: s,
            reference_token: r_tok,
            token: a_tok,
            reference_top: top(r),
            top: top(a),
            reference_gap: reference_gap as f32,
            observed_shift: observed as f32,
            tie_threshold: observed as f32,
            mutual_top_k,
        }
    });
    let (lr, la) = (reference.tokens.len(), path.tokens.len());
    // A request may be asked for fewer tokens than the reference (concurrent staggers
    // lengths): only stopping short of what it was asked for is a mismatch.
    let length_mismatch =
        (first_divergence.is_none() && (la < asked.min(lr) || (la > lr && lr < asked))).then_some((lr, la));
    let verdict = match &first_divergence {
        None if length_mismatch.is_some() => Verdict::Diverged,
        None => Verdict::Identical,
        Some(c) => c.verdict(step_max_delta[c.step] <= tolerance),
    };
    LogprobComparison {
        verdict,
        first_divergence,
        step_max_delta,
        max_delta,
        first_difference,
        tokens: path.tokens.clone(),
        reference_tokens: reference.tokens[..n.min(lr)].to_vec(),
        length_mismatch,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The judge's fused log-softmax and KL terms must be MLX's to the bit: every verdict, RMS
    /// and KL in the committed snapshots was computed with MLX's own kernels. Rows of ordinary
    /// logits, a masked row of -inf, an inf and a NaN.
    #[test]
    fn the_judge_s_fused_log_softmax_and_kl_are_mlx_s_bit_for_bit() {
        crate::environment::use_device(crate::environment::DeviceChoice::Cpu).expect("the CPU is always there");
        let v = 4099;
        let mut host: Vec<f32> = mlx_rs::random::normal::<f32>(&[6, v], None, None, None)
            .unwrap()
            .multiply(mlx_rs::array!(7.0))
            .unwrap()
            .as_slice::<f32>()
            .to_vec();
        host[2 * v as usize..3 * v as usize].fill(f32::NEG_INFINITY);
        host[3 * v as usize + 17] = f32::INFINITY;
        host[4 * v as usize + 5] = f32::NAN;
        let x = Array::from_slice(&host, &[6, v]);
        let y = x.multiply(mlx_rs::array!(0.9)).unwrap();
        let mlx_lsm = |a: &Array| a.subtract(mlx_rs::ops::logsumexp_axis(a, -1, true).unwrap()).unwrap();
        let bits = |a: &Array| a.as_slice::<f32>().iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        let (ours, theirs) = (log_softmax(&x).unwrap(), mlx_lsm(&x));
        assert_eq!(bits(&ours), bits(&theirs), "log-softmax");
        let (la, lb) = (mlx_lsm(&x), mlx_lsm(&y));
        let unfused = la.exp().unwrap().multiply(la.subtract(&lb).unwrap()).unwrap().sum_axis(-1, false).unwrap();
        assert_eq!(bits(&kl(&la, &lb).unwrap()), bits(&unfused), "KL");
    }

    fn trace(steps: &[&[(u32, f64)]]) -> LogprobTrace {
        LogprobTrace {
            tokens: steps.iter().map(|s| s[0].0).collect(),
            steps: steps.iter().map(|s| s.to_vec()).collect(),
        }
    }

    #[test]
    fn identical_logprobs_are_identical_with_no_difference() {
        let r = trace(&[&[(5, -0.1), (7, -2.5)], &[(9, -0.01), (5, -5.0)]]);
        let c = compare_logprobs(&r, &r.clone(), 1e-3, 2);
        assert_eq!((c.verdict, c.max_delta, c.first_difference), (Verdict::Identical, 0.0, None));
    }

    #[test]
    fn a_flip_within_the_observed_shift_is_a_near_tie_and_a_large_one_diverges() {
        let r = trace(&[&[(5, -0.69), (7, -0.70)]]);
        let a = trace(&[&[(7, -0.6895), (5, -0.6905)]]);
        let c = compare_logprobs(&r, &a, 2e-2, 1);
        let d = c.first_divergence.as_ref().expect("divergence");
        assert_eq!((d.step, d.reference_token, d.token), (0, 5, 7));
        assert!((f64::from(d.reference_gap) - 0.01).abs() < 1e-6);
        assert_eq!(c.verdict, Verdict::NearTie, "gap 0.01 <= shift 0.0105");
        let a = trace(&[&[(7, -0.1), (5, -3.0)]]);
        assert_eq!(compare_logprobs(&r, &a, 1e-2, 1).verdict, Verdict::Diverged);
        // Not in the reference's top-k: never a near-tie.
        let a = trace(&[&[(8, -0.68), (5, -0.69)]]);
        let c = compare_logprobs(&r, &a, 10.0, 1);
        assert!(!c.first_divergence.as_ref().expect("div").mutual_top_k);
        assert_eq!(c.verdict, Verdict::Diverged);
    }

    /// The length rule that used to be computed here and then recomputed by the caller: a
    /// request that stops short of what it was asked for, every shared step agreeing, has
    /// diverged; one asked for fewer tokens than the reference (`concurrent` staggers lengths)
    /// has not.
    #[test]
    fn stopping_short_of_what_was_asked_diverges_and_asking_for_less_does_not() {
        let r = trace(&[&[(5, -0.1)], &[(9, -0.2)], &[(3, -0.3)]]);
        let short = trace(&[&[(5, -0.1)], &[(9, -0.2)]]);
        let c = compare_logprobs(&r, &short, 1e-3, 3);
        assert_eq!((c.verdict, c.length_mismatch), (Verdict::Diverged, Some((3, 2))));
        let c = compare_logprobs(&r, &short, 1e-3, 2);
        assert_eq!((c.verdict, c.length_mismatch), (Verdict::Identical, None));
        // Running on where the reference stopped early (it was asked for more) diverges too.
        let c = compare_logprobs(&short, &r, 1e-3, 3);
        assert_eq!((c.verdict, c.length_mismatch), (Verdict::Diverged, Some((2, 3))));
    }

    #[test]
    fn the_first_difference_is_found_in_values_and_in_membership() {
        let r = trace(&[&[(5, -0.1), (7, -2.5)], &[(9, -0.01), (5, -5.0)]]);
        let a = trace(&[&[(5, -0.1), (7, -2.5)], &[(9, -0.01), (5, -5.000001)]]);
        let c = compare_logprobs(&r, &a, 1e-3, 2);
        assert_eq!(c.verdict, Verdict::Identical);
        let d = c.first_difference.expect("difference");
        assert_eq!((d.step, d.token), (1, 5));
        assert!((c.max_delta - 1e-6).abs() < 1e-9);
        let a = trace(&[&[(5, -0.1), (8, -2.5)], &[(9, -0.01), (5, -5.0)]]);
        let d = compare_logprobs(&r, &a, 1e-3, 2).first_difference.expect("membership");
        assert_eq!((d.step, d.token, d.path), (0, 7, None));
    }

    /// Top-k KL is the KL of the two distributions cut to the reference's top-k and one
    /// bucket for the rest: worked by hand, zero on identical lists, and never over the full
    /// KL of the distributions the lists were cut from.
    #[test]
    fn topk_kl_is_the_coarsened_kl_and_bounds_the_full_one_from_below() {
        let ln = f64::ln;
        let r = vec![vec![(1, ln(0.5)), (2, ln(0.3))]];
        let a = vec![vec![(2, ln(0.4)), (1, ln(0.4))]];
        let s = topk_position_samples(&r, &a, &[2], 7).expect("samples");
        let want = 0.5 * ln(0.5 / 0.4) + 0.3 * ln(0.3 / 0.4) + 0.2 * ln(0.2 / 0.2);
        assert!((f64::from(s[0].kl) - want).abs() < 1e-6, "{} vs {want}", s[0].kl);
        assert_eq!((s[0].position, s[0].top1, s[0].topk_overlap), (7, false, 1.0));
        assert!((s[0].p_reference - 0.3).abs() < 1e-6 && (s[0].p_path - 0.4).abs() < 1e-6);
        let same = topk_position_samples(&r, &r, &[9], 0).expect("samples");
        assert_eq!((same[0].kl, same[0].top1, same[0].p_reference, same[0].p_path), (0.0, true, 0.0, 0.0));

        // A full distribution over 50 tokens and a perturbed one, cut to their top 10.
        let mut rng = crate::rng::Rng::new(3);
        let full = |noise: f64, rng: &mut crate::rng::Rng| -> Vec<f64> {
            let logits: Vec<f64> = (0..50).map(|i| -0.2 * i as f64 + noise * f64::from(rng.normal())).collect();
            let z = logits.iter().map(|l| l.exp()).sum::<f64>().ln();
            logits.iter().map(|l| l - z).collect()
        };
        let mut bounded = 0;
        for _ in 0..20 {
            let (lr, la) = (full(0.0, &mut rng), full(0.3, &mut rng));
            let exact: f64 = lr.iter().zip(&la).map(|(r, a)| r.exp() * (r - a)).sum();
            let top = |l: &[f64]| {
                let mut v: Vec<(u32, f64)> = l.iter().enumerate().map(|(i, &x)| (i as u32, x)).collect();
                v.sort_by(|x, y| y.1.total_cmp(&x.1));
                v.truncate(10);
                v
            };
            let s = topk_position_samples(&[top(&lr)], &[top(&la)], &[0], 0).expect("samples");
            if s[0].topk_overlap == 1.0 {
                assert!(f64::from(s[0].kl) <= exact + 1e-6, "top-k KL {} over the full KL {exact}", s[0].kl);
                bounded += 1;
            }
            assert!(s[0].kl.is_finite() && s[0].kl >= 0.0);
        }
        assert!(bounded >= 5, "only {bounded} of 20 draws had the reference's top-10 in the path's");
        let empty = topk_position_samples(&[vec![]], &r, &[1], 4).expect_err("an empty list is refused");
        assert!(empty.to_string().contains("position 4"), "{empty}");
    }
}
