//! `parity locate`: where two devices part, named to the layer and the operation.
//!
//! A suite run says that a path on one device diverged from its reference on another at some
//! step; it cannot say which of the model's few hundred operations made the difference, and
//! every later operation inherits it. Here one builtin path runs the same tokens (a prompt
//! prefilled, then decode steps fed the reference side's own greedy tokens, so both sides see
//! the same inputs) once per device, with every intermediate of the forward pass tapped
//! ([`Taps`]): the embedding, each layer's norms, q/k/v projections, RoPE, attention, output
//! projection, MLP and residuals, the final norm and the logits. The first tap, in computation
//! order, whose relative RMS difference passes the threshold is where the sides part: what
//! llama.cpp's `test-backend-ops` does op by op, on a whole model's real call shapes.
//!
//! MLX keeps one default device per process, so each side is recorded by a child (this
//! executable, `--dump`) that writes its taps as a safetensors file; the parent compares them.

use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;

use crate::engine::builtin::Builtin;
use crate::error::{Error, Result};
use crate::faults::Faults;
use crate::model::{Model, RowStep, Taps};
use crate::vocab::{BuiltinPath, Settings};

/// What one side runs.
#[derive(Debug, Clone)]
pub struct Plan {
    pub prompt: Vec<u32>,
    /// Copies of the prompt decoded together (B = 2 same-prompt parity is what exposed the RoPE
    /// stride aliasing: identical rows must stay identical).
    pub batch: usize,
    /// Decode steps after the prefill.
    pub steps: usize,
    pub path: BuiltinPath,
    /// The tokens to feed at each decode step (the reference side's greedy choices); `None`:
    /// this side's own.
    pub forced: Option<Vec<u32>>,
}

/// One tapped intermediate, on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct Tap {
    pub name: String,
    pub shape: Vec<usize>,
    pub values: Vec<f32>,
}

/// Every tap of every step of one side, and the greedy token of row 0 at each step.
#[derive(Debug, Clone, PartialEq)]
pub struct Recording {
    pub device: String,
    pub steps: Vec<Vec<Tap>>,
    pub greedy: Vec<u32>,
}

/// Run `plan` on the model as loaded (its device is the process's), `faults` planted.
pub fn record(model: &Model, plan: &Plan, settings: &Settings, faults: Faults) -> Result<Recording> {
    if plan.prompt.is_empty() || plan.batch == 0 {
        return Err(Error::Invalid("locate needs a non-empty prompt and a batch of at least one".into()));
    }
    let builtin = Builtin::new(model, plan.path, settings);
    let mut kv = builtin.kv(faults)?;
    model.set_faults(faults);
    let seqs = (0..plan.batch).map(|_| kv.create(0)).collect::<Result<Vec<_>>>()?;
    let mut steps = Vec::with_capacity(plan.steps + 1);
    let mut greedy = Vec::with_capacity(plan.steps + 1);
    let mut feed = plan.prompt.clone();
    for step in 0..=plan.steps {
        let rows: Vec<RowStep> = seqs.iter().map(|&s| RowStep::new(s, feed.clone())).collect();
        let taps = Taps::default();
        let logits = model.forward_traced(kv.as_mut(), &rows, plan.path.attention, Some(&taps))?;
        let chosen = crate::array::greedy(&logits)?[0];
        greedy.push(chosen);
        let host = taps
            .into_inner()
            .into_iter()
            .map(|(name, a)| {
                let shape = a.shape().iter().map(|&d| d as usize).collect();
                Ok(Tap { name, shape, values: crate::array::host_f32(&a)? })
            })
            .collect::<Result<Vec<_>>>()?;
        steps.push(host);
        if step == plan.steps {
            break;
        }
        let next = match &plan.forced {
            Some(forced) => *forced.get(step).ok_or_else(|| {
                Error::Invalid(format!("{} forced tokens for {} decode steps", forced.len(), plan.steps))
            })?,
            None => chosen,
        };
        feed = vec![next];
    }
    model.set_faults(Faults::NONE);
    Ok(Recording { device: crate::environment::device(), steps, greedy })
}

/// Tensor names that sort into computation order: step, then tap index.
fn tensor_name(step: usize, index: usize, name: &str) -> String {
    format!("{step:04}/{index:04}/{name}")
}

pub fn write(rec: &Recording, path: &Path) -> Result<()> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = rec
        .steps
        .iter()
        .enumerate()
        .flat_map(|(s, taps)| {
            taps.iter().enumerate().map(move |(i, t)| {
                (tensor_name(s, i, &t.name), t.shape.clone(), t.values.iter().flat_map(|x| x.to_le_bytes()).collect())
            })
        })
        .collect();
    let views = bytes
        .iter()
        .map(|(n, shape, data)| {
            safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), data).map(|v| (n.clone(), v))
        })
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Invalid(format!("locate: taps as safetensors: {e}")))?;
    let meta = HashMap::from([
        ("device".to_string(), rec.device.clone()),
        ("greedy".to_string(), serde_json::to_string(&rec.greedy).unwrap_or_default()),
        ("steps".to_string(), rec.steps.len().to_string()),
    ]);
    safetensors::serialize_to_file(views, Some(meta), path)
        .map_err(|e| Error::Invalid(format!("locate: writing {}: {e}", path.display())))
}

pub fn read(path: &Path) -> Result<Recording> {
    let bad = |what: String| Error::Invalid(format!("locate: {}: {what}", path.display()));
    let bytes = std::fs::read(path).map_err(|e| bad(e.to_string()))?;
    let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).map_err(|e| bad(e.to_string()))?;
    let info = meta.metadata().clone().unwrap_or_default();
    let field = |k: &str| info.get(k).cloned().ok_or_else(|| bad(format!("no `{k}` in the header")));
    let device = field("device")?;
    let greedy: Vec<u32> = serde_json::from_str(&field("greedy")?).map_err(|e| bad(format!("greedy: {e}")))?;
    let n: usize = field("steps")?.parse().map_err(|e| bad(format!("steps: {e}")))?;
    let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| bad(e.to_string()))?;
    let mut names: Vec<&str> = st.names();
    names.sort_unstable();
    let mut steps: Vec<Vec<Tap>> = vec![Vec::new(); n];
    for full in names {
        let mut parts = full.splitn(3, '/');
        let (Some(s), Some(_), Some(name)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(bad(format!("tensor `{full}` is not step/index/name")));
        };
        let s: usize = s.parse().map_err(|_| bad(format!("tensor `{full}`: step")))?;
        let view = st.tensor(full).map_err(|e| bad(e.to_string()))?;
        if view.dtype() != safetensors::Dtype::F32 || s >= n {
            return Err(bad(format!("tensor `{full}` is not an f32 tap of steps 0..{n}")));
        }
        let values = view.data().chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        steps[s].push(Tap { name: name.to_string(), shape: view.shape().to_vec(), values });
    }
    Ok(Recording { device, steps, greedy })
}

/// One tap of one step, compared.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TapDiff {
    pub step: usize,
    pub name: String,
    /// RMS of the difference over RMS of the reference side (0 when both are zero).
    pub rel_rms: f64,
    pub max_abs: f64,
    /// Set where the two sides tapped arrays of different shapes (a cache read of another
    /// width): the largest difference there is, and the shapes that say why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shapes: Option<String>,
}

/// Both sides compared, tap by tap, in computation order.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Location {
    pub on: String,
    pub against: String,
    pub threshold: f64,
    pub diffs: Vec<TapDiff>,
    /// The first tap over the threshold: where the sides part.
    pub first: Option<TapDiff>,
    /// Row 0's greedy tokens, each side.
    pub greedy_on: Vec<u32>,
    pub greedy_against: Vec<u32>,
}

fn diff(step: usize, a: &Tap, b: &Tap) -> TapDiff {
    let (mut d2, mut r2, mut max_abs) = (0.0f64, 0.0f64, 0.0f64);
    for (&x, &y) in a.values.iter().zip(&b.values) {
        let d = f64::from(x) - f64::from(y);
        d2 += d * d;
        r2 += f64::from(y) * f64::from(y);
        // A NaN on either side is the largest difference there is, never a silent 0.
        max_abs = if d.is_nan() { f64::NAN } else { max_abs.max(d.abs()) };
    }
    let rel_rms = if d2.is_nan() {
        f64::NAN
    } else if r2 > 0.0 {
        (d2 / r2).sqrt()
    } else if d2 == 0.0 {
        0.0
    } else {
        f64::INFINITY
    };
    TapDiff { step, name: a.name.clone(), rel_rms, max_abs, shapes: None }
}

/// Compare `on` with `against`, tap by tap. Both must have tapped the same operations in the
/// same order (the same path on the same tokens); a tap whose shapes differ is where they part.
pub fn compare(on: &Recording, against: &Recording, threshold: f64) -> Result<Location> {
    if on.steps.len() != against.steps.len() {
        return Err(Error::Invalid(format!(
            "locate: {} steps on {} but {} on {}",
            on.steps.len(),
            on.device,
            against.steps.len(),
            against.device
        )));
    }
    let mut diffs = Vec::new();
    for (s, (a, b)) in on.steps.iter().zip(&against.steps).enumerate() {
        if a.len() != b.len() {
            return Err(Error::Invalid(format!("locate: step {s}: {} taps against {}", a.len(), b.len())));
        }
        for (x, y) in a.iter().zip(b) {
            if x.name != y.name {
                return Err(Error::Invalid(format!("locate: step {s}: tap {} against {}", x.name, y.name)));
            }
            if x.shape != y.shape {
                let shapes = Some(format!("shape {:?} against {:?}", x.shape, y.shape));
                diffs.push(TapDiff {
                    step: s,
                    name: x.name.clone(),
                    rel_rms: f64::INFINITY,
                    max_abs: f64::INFINITY,
                    shapes,
                });
                continue;
            }
            diffs.push(diff(s, x, y));
        }
    }
    let first = diffs.iter().find(|d| d.rel_rms.is_nan() || d.rel_rms > threshold).cloned();
    Ok(Location {
        on: on.device.clone(),
        against: against.device.clone(),
        threshold,
        diffs,
        first,
        greedy_on: on.greedy.clone(),
        greedy_against: against.greedy.clone(),
    })
}

impl Location {
    /// What a terminal shows: the verdict, the first diverging layer's taps at that step, then
    /// per step the largest relative RMS, the logits' and each side's greedy token.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let layer_of = |name: &str| name.strip_prefix("layer ").and_then(|r| r.split(' ').next()).map(str::to_string);
        match &self.first {
            None => out.push_str(&format!(
                "{} against {}: every tap within rel RMS {:.0e} ({} taps over {} steps)\n",
                self.on,
                self.against,
                self.threshold,
                self.diffs.len(),
                self.greedy_on.len()
            )),
            Some(f) => {
                out.push_str(&format!(
                    "{} against {}: first past rel RMS {:.0e} at step {}, {} (rel RMS {:.3e}, max |diff| {:.3e})\n",
                    self.on, self.against, self.threshold, f.step, f.name, f.rel_rms, f.max_abs
                ));
                // The whole layer it starts in: the operations before it agreed, the ones
                // after it inherit it.
                let layer = layer_of(&f.name);
                out.push_str(&format!("step {} taps:\n", f.step));
                let shown = self.diffs.iter().filter(|d| {
                    d.step == f.step && if layer.is_some() { layer_of(&d.name) == layer } else { d.name == f.name }
                });
                for d in shown {
                    let mark = if d.name == f.name { "  <- first" } else { "" };
                    let shapes = d.shapes.as_ref().map(|s| format!(" ({s})")).unwrap_or_default();
                    out.push_str(&format!(
                        "  {:<28} rel RMS {:.3e}  max |diff| {:.3e}{shapes}{mark}\n",
                        d.name, d.rel_rms, d.max_abs
                    ));
                }
            }
        }
        for s in 0..self.greedy_on.len() {
            let worst = self.diffs.iter().filter(|d| d.step == s).map(|d| d.rel_rms).fold(0.0, nan_max);
            let logits = self.diffs.iter().find(|d| d.step == s && d.name == "logits").map_or(f64::NAN, |d| d.rel_rms);
            out.push_str(&format!(
                "step {s}: largest rel RMS {worst:.3e}, logits {logits:.3e}, row 0 greedy {} on {}, {} on {}\n",
                self.greedy_on[s], self.on, self.greedy_against[s], self.against
            ));
        }
        out
    }
}

fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() { f64::NAN } else { a.max(b) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tap(name: &str, values: &[f32]) -> Tap {
        Tap { name: name.into(), shape: vec![values.len()], values: values.to_vec() }
    }

    fn rec(device: &str, steps: Vec<Vec<Tap>>) -> Recording {
        let greedy = vec![0; steps.len()];
        Recording { device: device.into(), steps, greedy }
    }

    #[test]
    fn the_first_tap_over_the_threshold_is_named_in_computation_order() {
        let against = rec(
            "cpu",
            vec![vec![tap("embed", &[1.0, 2.0]), tap("layer 0 rope_q", &[3.0, 4.0]), tap("logits", &[5.0, 6.0])]],
        );
        // The logits differ more, but after the RoPE tap: the RoPE tap is where it starts.
        let on = rec(
            "gpu",
            vec![vec![tap("embed", &[1.0, 2.0]), tap("layer 0 rope_q", &[3.0, 4.1]), tap("logits", &[5.0, 9.0])]],
        );
        let loc = compare(&on, &against, 1e-4).unwrap();
        let first = loc.first.as_ref().unwrap();
        assert_eq!((first.step, first.name.as_str()), (0, "layer 0 rope_q"));
        assert!((first.rel_rms - 0.1 / 5.0).abs() < 1e-6, "{}", first.rel_rms);
        assert!(loc.render().contains("first past rel RMS 1e-4 at step 0, layer 0 rope_q"), "{}", loc.render());
    }

    /// A NaN compares as nothing (`NaN > threshold` is false too): it must be the first, never
    /// read as agreement.
    #[test]
    fn a_nan_tap_is_a_difference() {
        let against = rec("cpu", vec![vec![tap("embed", &[1.0]), tap("logits", &[1.0])]]);
        let on = rec("gpu", vec![vec![tap("embed", &[f32::NAN]), tap("logits", &[1.0])]]);
        let first = compare(&on, &against, 1e-4).unwrap().first.unwrap();
        assert_eq!(first.name, "embed");
        assert!(first.rel_rms.is_nan());
    }

    /// A tap whose shapes differ (a cache read of another width) is where the sides part, with
    /// both shapes said; different operations in one place mean different paths: an error.
    #[test]
    fn a_tap_of_other_shapes_is_where_the_sides_part_and_other_taps_an_error() {
        let a = rec("cpu", vec![vec![tap("embed", &[1.0]), tap("logits", &[1.0])]]);
        let b = rec("gpu", vec![vec![tap("embed", &[1.0, 2.0]), tap("logits", &[1.0])]]);
        let first = compare(&a, &b, 1e-4).unwrap().first.unwrap();
        assert_eq!((first.name.as_str(), first.rel_rms), ("embed", f64::INFINITY));
        assert_eq!(first.shapes.as_deref(), Some("shape [1] against [2]"));
        let c = rec("gpu", vec![vec![tap("input_norm", &[1.0]), tap("logits", &[1.0])]]);
        assert!(compare(&a, &c, 1e-4).is_err());
    }

    #[test]
    fn a_recording_reads_back_as_written() {
        let dir = std::env::temp_dir().join(format!("parity-locate-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("taps.safetensors");
        let mut steps = Vec::new();
        for s in 0..3 {
            // More than ten taps a step: the names must sort by index, not as text.
            steps.push((0..12).map(|i| tap(&format!("t{i}"), &[s as f32, i as f32])).collect());
        }
        let r = Recording { device: "cpu".into(), steps, greedy: vec![7, 8, 9] };
        write(&r, &path).unwrap();
        assert_eq!(read(&path).unwrap(), r);
        std::fs::remove_dir_all(&dir).ok();
    }
}
