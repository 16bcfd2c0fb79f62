//! How far a lossy path's next-token distributions are from the reference's over a corpus read
//! teacher-forced: per position, KL divergence, the change in the probability of the token
//! that comes next in the text, whether the two argmaxes agree and how much their top-k
//! overlap; summarised as llama.cpp's `llama-perplexity --kl-divergence` prints it (mean,
//! median, tail percentiles, RMS of the probability change, top-1 agreement), and by context
//! position, since a quantized cache's error compounds with length.
//!
//! A quantized KV cache never matches its full-precision path token for token over thousands
//! of positions, and its worst step says little: one near-tie flips, or one large KL, in a
//! corpus of thousands. What a team choosing a KV format needs is the distribution, and the
//! tolerance a lossy path is held to is a bound on it ([`DistributionTolerance`]).

use serde::{Deserialize, Serialize};

/// One position of a corpus: the path's next-token distribution against the reference's.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct PositionSample {
    /// Context position of the token whose next-token distribution this is (0: the first).
    pub position: usize,
    /// `KL(reference || path)`, nats.
    pub kl: f32,
    /// Probability of the text's next token, reference and path.
    pub p_reference: f32,
    pub p_path: f32,
    /// The two argmaxes are the same token.
    pub top1: bool,
    /// Share of the reference's top-k tokens in the path's top-k.
    pub topk_overlap: f32,
}

/// Mean (with its standard error, as `llama-perplexity` prints `Mean KLD: x ± y`), median,
/// tail percentiles and maximum of a set of values.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub mean: f64,
    /// Standard error of the mean: the sample standard deviation over the square root of the
    /// count (0 for fewer than two values). Positions of one text are correlated, so it is a
    /// lower bound on the mean's real uncertainty.
    pub mean_se: f64,
    pub median: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(values: &[f64]) -> Spread {
        if values.is_empty() {
            return Spread::default();
        }
        let mut v = values.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let var = if v.len() > 1 { v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0) } else { 0.0 };
        Spread {
            mean,
            mean_se: (var / n).sqrt(),
            median: quantile(&v, 0.5),
            p90: quantile(&v, 0.9),
            p99: quantile(&v, 0.99),
            max: v[v.len() - 1],
        }
    }
}

/// The `q` quantile of sorted values, linearly interpolated between neighbours (numpy's
/// default), so a percentile of few samples is not pinned to one of them.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let at = q * (sorted.len() - 1) as f64;
    let (lo, hi) = (at.floor() as usize, at.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (at - lo as f64)
}

/// Positions `from..to` of the context, summarised.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Band {
    pub from: usize,
    pub to: usize,
    pub positions: usize,
    pub kl_mean: f64,
    pub kl_p99: f64,
    pub dp_rms: f64,
    pub top1_agree: f64,
}

/// A lossy path over a corpus, against its reference.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Distribution {
    pub positions: usize,
    /// KL(reference || path) per position, nats.
    pub kl: Spread,
    /// RMS and largest absolute change in the probability of the text's next token.
    pub dp_rms: f64,
    pub dp_max: f64,
    /// Share of positions whose argmax agrees with the reference's.
    pub top1_agree: f64,
    /// k of the top-k overlap, and its mean share.
    pub topk: usize,
    pub topk_overlap: f64,
    /// By context position, in bands that double: early against late context.
    pub by_position: Vec<Band>,
    /// The 0th to 100th percentiles of KL, for plotting its distribution.
    pub kl_percentiles: Vec<f64>,
}

/// Where the position bands start: 0, 32, 64, 128, ... (doubling).
fn band_of(position: usize) -> usize {
    if position < 32 { 0 } else { (position / 32).ilog2() as usize + 1 }
}

fn band_start(band: usize) -> usize {
    if band == 0 { 0 } else { 32 << (band - 1) }
}

fn rms(values: impl Iterator<Item = f64>) -> f64 {
    let (mut sum, mut n) = (0.0, 0usize);
    for v in values {
        sum += v * v;
        n += 1;
    }
    if n == 0 { 0.0 } else { (sum / n as f64).sqrt() }
}

fn share(values: impl Iterator<Item = bool>) -> f64 {
    let (mut yes, mut n) = (0usize, 0usize);
    for v in values {
        yes += usize::from(v);
        n += 1;
    }
    if n == 0 { 0.0 } else { yes as f64 / n as f64 }
}

impl Distribution {
    /// Summarise positions (from any number of sequences); `topk` is the k their overlap used.
    pub fn of(samples: &[PositionSample], topk: usize) -> Distribution {
        let kl: Vec<f64> = samples.iter().map(|s| f64::from(s.kl)).collect();
        let dp = |s: &PositionSample| f64::from(s.p_path) - f64::from(s.p_reference);
        let mut sorted = kl.clone();
        sorted.sort_by(f64::total_cmp);
        let kl_percentiles = if sorted.is_empty() {
            Vec::new()
        } else {
            (0..=100).map(|q| quantile(&sorted, q as f64 / 100.0)).collect()
        };
        let bands = samples.iter().map(|s| band_of(s.position)).max().map_or(0, |b| b + 1);
        let by_position = (0..bands)
            .filter_map(|b| {
                let in_band: Vec<&PositionSample> = samples.iter().filter(|s| band_of(s.position) == b).collect();
                if in_band.is_empty() {
                    return None;
                }
                let kl: Vec<f64> = in_band.iter().map(|s| f64::from(s.kl)).collect();
                let spread = Spread::of(&kl);
                Some(Band {
                    from: band_start(b),
                    to: band_start(b + 1),
                    positions: in_band.len(),
                    kl_mean: spread.mean,
                    kl_p99: spread.p99,
                    dp_rms: rms(in_band.iter().map(|s| dp(s))),
                    top1_agree: share(in_band.iter().map(|s| s.top1)),
                })
            })
            .collect();
        Distribution {
            positions: samples.len(),
            kl: Spread::of(&kl),
            dp_rms: rms(samples.iter().map(dp)),
            dp_max: samples.iter().map(|s| dp(s).abs()).fold(0.0, f64::max),
            top1_agree: share(samples.iter().map(|s| s.top1)),
            topk,
            topk_overlap: if samples.is_empty() {
                0.0
            } else {
                samples.iter().map(|s| f64::from(s.topk_overlap)).sum::<f64>() / samples.len() as f64
            },
            by_position,
            kl_percentiles,
        }
    }
}

/// Bounds on a lossy path's distribution (`[tolerance]` in a suite): each one named is checked
/// and reported with its measured value. None named: the corpus rows are held to exactness
/// (every argmax agrees), as any other row.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct DistributionTolerance {
    pub kl_mean: Option<f64>,
    pub kl_p99: Option<f64>,
    pub kl_max: Option<f64>,
    pub dp_rms: Option<f64>,
    /// Lower bounds.
    pub top1_agree: Option<f64>,
    pub topk_overlap: Option<f64>,
}

/// One bound, checked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Bound {
    /// `kl_p99`, `top1_agree`, ...
    pub name: String,
    /// `<=` for an upper bound, `>=` for a lower one.
    pub relation: String,
    pub limit: f64,
    pub measured: f64,
    pub held: bool,
}

impl DistributionTolerance {
    pub fn is_empty(&self) -> bool {
        *self == DistributionTolerance::default()
    }

    /// Every bound named, against `d`; with none named, top-1 agreement must be complete.
    pub fn check(&self, d: &Distribution) -> Vec<Bound> {
        let t = if self.is_empty() { DistributionTolerance { top1_agree: Some(1.0), ..*self } } else { *self };
        let upper = [("kl_mean", t.kl_mean, d.kl.mean), ("kl_p99", t.kl_p99, d.kl.p99), ("kl_max", t.kl_max, d.kl.max)];
        let upper = upper.into_iter().chain([("dp_rms", t.dp_rms, d.dp_rms)]);
        let lower = [("top1_agree", t.top1_agree, d.top1_agree), ("topk_overlap", t.topk_overlap, d.topk_overlap)];
        let bound = |name: &str, relation: &str, limit: f64, measured: f64, held: bool| Bound {
            name: name.into(),
            relation: relation.into(),
            limit,
            measured,
            held,
        };
        upper
            .filter_map(|(name, limit, measured)| limit.map(|l| bound(name, "<=", l, measured, measured <= l)))
            .chain(
                lower
                    .into_iter()
                    .filter_map(|(name, limit, measured)| limit.map(|l| bound(name, ">=", l, measured, measured >= l))),
            )
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(position: usize, kl: f32, dp: f32, top1: bool) -> PositionSample {
        PositionSample { position, kl, p_reference: 0.5, p_path: 0.5 + dp, top1, topk_overlap: 0.9 }
    }

    #[test]
    fn percentiles_interpolate_and_bands_double() {
        let samples: Vec<PositionSample> = (0..200).map(|p| sample(p, p as f32 / 100.0, 0.0, p % 4 != 0)).collect();
        let d = Distribution::of(&samples, 10);
        assert_eq!(d.positions, 200);
        assert!((d.kl.mean - 0.995).abs() < 1e-6, "{}", d.kl.mean);
        assert!((d.kl.median - 0.995).abs() < 1e-6);
        assert!((d.kl.p99 - 1.9701).abs() < 1e-4, "{}", d.kl.p99);
        assert!((d.kl.max - 1.99).abs() < 1e-6);
        assert_eq!(d.top1_agree, 0.75);
        let bands: Vec<(usize, usize, usize)> = d.by_position.iter().map(|b| (b.from, b.to, b.positions)).collect();
        assert_eq!(bands, [(0, 32, 32), (32, 64, 32), (64, 128, 64), (128, 256, 72)]);
        assert!(d.by_position[3].kl_mean > d.by_position[0].kl_mean, "late context carries the larger KL here");
        assert_eq!(d.kl_percentiles.len(), 101);
        assert_eq!(d.kl_percentiles[100], d.kl.max);
    }

    #[test]
    fn the_probability_change_is_signed_for_rms_and_absolute_for_max() {
        let d = Distribution::of(&[sample(0, 0.0, 0.3, true), sample(1, 0.0, -0.4, true)], 10);
        assert!((d.dp_rms - (0.125f64).sqrt()).abs() < 1e-6, "{}", d.dp_rms);
        assert!((d.dp_max - 0.4).abs() < 1e-6);
    }

    /// Bounds are checked one by one against what was measured; with none named the rows are
    /// held to exactness, never to nothing.
    #[test]
    fn bounds_hold_or_not_each_with_its_value() {
        let d = Distribution::of(&[sample(0, 0.02, 0.01, true), sample(1, 0.5, 0.01, false)], 10);
        let t = DistributionTolerance { kl_p99: Some(0.1), top1_agree: Some(0.4), ..DistributionTolerance::default() };
        let b = t.check(&d);
        assert_eq!(b.len(), 2);
        assert!(!b[0].held && b[0].name == "kl_p99" && b[0].relation == "<=" && b[0].measured > 0.4);
        assert!(b[1].held && b[1].name == "top1_agree" && b[1].measured == 0.5);
        let exact = DistributionTolerance::default().check(&d);
        assert_eq!((exact.len(), exact[0].name.as_str(), exact[0].held), (1, "top1_agree", false));
    }
}
