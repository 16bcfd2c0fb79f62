//! The result of a suite run, and its renderings: JSON (full precision, the machine report),
//! insta snapshots (stable, for review), JUnit, Markdown, HTML and a terminal table. Reports
//! know no engine: a row reads the same whichever kind produced it.
//!
//! - the report types (here) and how a row is described in words ([`describe`]), shared by
//!   every rendering; markup escaping ([`escape`]);
//! - renderings: [`table`], [`junit`], [`markdown`], [`html`] (with [`chart`] and [`diff`]),
//!   [`snapshot`]; and [`merge`] for the reports of shards.

pub mod chart;
pub mod describe;
pub mod diff;
pub mod escape;
pub mod html;
pub mod junit;
pub mod markdown;
pub mod merge;
pub mod snapshot;
pub mod table;

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::compare::{Choice, FirstDifference};
pub use crate::environment::Environment;
use crate::kv::{Counters, KvStats};
use crate::vocab::{Bound, Distribution, EngineId, Evidence, Settings, Verdict};

/// Bumped when a field changes meaning or disappears (additions keep the version).
pub const SCHEMA_VERSION: u32 = 1;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Report {
    pub schema: u32,
    pub suite: String,
    pub suite_file: String,
    pub parity_version: String,
    /// The git commit parity was built from (`-dirty`: with uncommitted changes).
    #[serde(default)]
    pub parity_commit: String,
    pub environment: Environment,
    /// Set when this report covers one shard of the suite (`--shard I/N`).
    pub shard: Option<Shard>,
    /// Planted faults active during the run (selftest); empty for a normal run.
    pub faults: Vec<String>,
    pub checkpoints: Vec<CheckpointReport>,
    pub rows: Vec<Row>,
    pub summary: Summary,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
pub struct Shard {
    /// 1-based.
    pub index: usize,
    pub count: usize,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum CheckpointStatus {
    Ran,
    /// Not found locally (and `--require-models` not given).
    Skipped,
    /// Found but could not be loaded or run.
    Error,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct CheckpointReport {
    pub name: String,
    /// As written in the suite (path or repo id).
    pub reference: String,
    /// The directory it resolved to.
    pub resolved: Option<String>,
    pub status: CheckpointStatus,
    /// Why it was skipped or failed, with the places searched and a fetch hint.
    pub reason: Option<String>,
    pub dtype: String,
    /// Quantized weights were dequantized at load (a speed setting; recorded because it
    /// changes the arithmetic).
    pub dequantized: bool,
    pub settings: Settings,
    pub max_rel_rms_tolerance: f32,
    /// kind = "openai": the logprob tolerance, and whether any difference fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_logprob_delta_tolerance: Option<f32>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bitwise: bool,
    pub allowed_verdicts: Vec<Verdict>,
    /// Why this checkpoint's rows are not snapshotted (`no_snapshot` in the suite).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub no_snapshot: Option<String>,
    /// Wall time per phase (load, references, each scenario), seconds.
    pub phases: Vec<Phase>,
    /// Noise floor per prompt: the reference re-run in a different batch composition.
    pub noise_floor: BTreeMap<String, Option<f32>>,
    /// Each prompt as this checkpoint's tokenizer encoded it (chat template and `length`
    /// applied): a prompt or template edit shows here, beside the token changes it causes.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub prompt_ids: BTreeMap<String, Vec<u32>>,
    /// The engine that served the paths (absent when none started).
    #[serde(default)]
    pub engine: Option<EngineId>,
    /// Where the references came from: engine and path.
    #[serde(default)]
    pub reference_engine: Option<EngineId>,
    #[serde(default)]
    pub reference_path: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Phase {
    pub name: String,
    pub seconds: f64,
}

/// One (checkpoint, prompt, scenario, case, backend) comparison. A case may hold several
/// paths (both rows of a same-prompt batch); the row reports the worst of them.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Row {
    pub checkpoint: String,
    pub prompt: String,
    pub scenario: String,
    pub case: String,
    /// The path the row ran on (`backend` in the JSON, as schema 1 has always written it).
    #[serde(rename = "backend")]
    pub path: String,
    pub verdict: Verdict,
    pub pass: bool,
    /// Why the row failed, when it did (verdict not allowed, RMS over tolerance, error).
    pub failure: Option<String>,
    pub first_divergence: Option<DivergenceReport>,
    /// The path's greedy choice at each step, given the reference's history.
    pub tokens: Vec<u32>,
    pub reference_tokens: Vec<u32>,
    pub text: Option<String>,
    pub reference_text: Option<String>,
    /// Largest per-step relative RMS over the row's paths; `null` when a step was NaN.
    pub max_rel_rms: Option<f32>,
    pub max_kl: Option<f32>,
    /// Per step, worst over paths; `null` for NaN.
    pub step_rel_rms: Vec<Option<f32>>,
    /// Per step, KL(reference || path) in nats, worst over paths; `null` for NaN.
    #[serde(default)]
    pub step_kl: Vec<Option<f32>>,
    /// Where the worst path was in the cache layout, step by step, as runs (see [`StepPlace`]):
    /// the HTML report's block and tile guides, trims and rewinds.
    #[serde(default)]
    pub step_layout: Vec<StepPlace>,
    /// Rows per KV block of the path (none: not a paged path).
    #[serde(default)]
    pub block_size: Option<usize>,
    pub noise_floor_rel_rms: Option<f32>,
    /// A NaN reached the logits (a poisoned row was read).
    pub nan: bool,
    pub paths: usize,
    pub notes: Vec<String>,
    /// KV memory of the case's store at its end (peak included); absent when it did not run.
    #[serde(default)]
    pub kv: Option<KvStats>,
    /// kind = "openai": what the API returned, compared on logprobs (absent for step engines).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<ApiFacts>,
    /// The case's claims and what was seen for each: why a `vacuous` row tested nothing, and
    /// what a passing one did (absent where nothing ran).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evidence: Vec<Evidence>,
    /// What the engine counted about its own work during the case (paths that count).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub counters: Option<Counters>,
    /// `corpus` rows: the path's next-token distributions against the reference's over the
    /// corpus, and each bound of the tolerance checked against them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub distribution: Option<Distribution>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub bounds: Vec<Bound>,
}

/// A request-level row's measurements (kind = "openai").
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct ApiFacts {
    /// Largest |delta logprob| over the top-k tokens both sides returned, over the row's
    /// requests and steps.
    pub max_logprob_delta: f64,
    /// Per step, worst over the row's requests.
    pub step_logprob_delta: Vec<f64>,
    /// The first logprob that differs at all (reported always; fails a `bitwise` suite).
    pub first_difference: Option<FirstDifference>,
    /// The prompt's length in parity's tokenization, and as the server counted it
    /// (`usage.prompt_tokens`); they differ when the server tokenized the text otherwise.
    pub prompt_tokens: usize,
    pub server_prompt_tokens: Option<usize>,
    /// Prompt tokens the server said it served from its cache (`prompt_tokens_details`).
    pub cached_tokens: Option<usize>,
    pub finish_reason: Option<String>,
    /// Steps where the token the server presented as chosen is not the most probable of its
    /// own top_logprobs (mlx_lm.server 0.32.2 presents an arbitrary entry).
    pub presented_not_top1: usize,
    /// The server's returned text is not the decoding of its own most probable tokens.
    pub text_contradiction: Option<String>,
    /// Seconds from sending the request to its last byte, and parity's own time on it
    /// (encoding, parsing, comparing).
    pub seconds: f64,
    pub parity_seconds: f64,
}

impl Row {
    /// A row with its name and verdict, nothing measured yet: where every row starts, judged
    /// or not.
    pub fn new(checkpoint: &str, prompt: &str, scenario: &str, case: &str, path: &str, verdict: Verdict) -> Row {
        Row {
            checkpoint: checkpoint.to_string(),
            prompt: prompt.to_string(),
            scenario: scenario.to_string(),
            case: case.to_string(),
            path: path.to_string(),
            verdict,
            pass: false,
            failure: None,
            first_divergence: None,
            tokens: Vec::new(),
            reference_tokens: Vec::new(),
            text: None,
            reference_text: None,
            max_rel_rms: None,
            max_kl: None,
            step_rel_rms: Vec::new(),
            step_kl: Vec::new(),
            step_layout: Vec::new(),
            block_size: None,
            noise_floor_rel_rms: None,
            nan: false,
            paths: 0,
            notes: Vec::new(),
            kv: None,
            api: None,
            evidence: Vec::new(),
            counters: None,
            distribution: None,
            bounds: Vec::new(),
        }
    }

    /// `checkpoint/prompt/scenario:case/path`: the one id every report prints for a row,
    /// and exactly what `--filter` matches (a substring of it), so an id copied from any
    /// report selects that row.
    pub fn id(&self) -> String {
        row_id(&self.checkpoint, &self.prompt, &self.scenario, &self.case, &self.path)
    }

    /// The id inside its checkpoint (JUnit's test name; the class is the checkpoint).
    pub fn case_id(&self) -> String {
        format!("{}/{}:{}/{}", self.prompt, self.scenario, self.case, self.path)
    }
}

/// A row's id from its parts, for selecting rows before they exist.
pub fn row_id(checkpoint: &str, prompt: &str, scenario: &str, case: &str, path: &str) -> String {
    format!("{checkpoint}/{prompt}/{scenario}:{case}/{path}")
}

/// Where a run of steps sat in the cache layout: from `step` on, each step fed the next KV row
/// at the next position, until the next run starts (a trim, a rollback or a rewind). Runs keep the JSON
/// small: a plain decode is one run.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct StepPlace {
    pub step: usize,
    /// KV row of the token fed at that step.
    pub kv_row: usize,
    /// Its RoPE position.
    pub position: usize,
    /// Pad rows trimmed before that step.
    pub pads_trimmed: usize,
    /// Rows decoded then trimmed away (rolled back) before that step.
    #[serde(default)]
    pub rolled_back: usize,
}

impl StepPlace {
    /// Runs from one place per step (`step` is set from the order).
    pub fn runs(steps: impl IntoIterator<Item = StepPlace>) -> Vec<StepPlace> {
        let mut out: Vec<StepPlace> = Vec::new();
        for (step, place) in steps.into_iter().enumerate() {
            let here = StepPlace { step, ..place };
            if out.last().map(|r| r.at(step)) != Some(here) {
                out.push(here);
            }
        }
        out
    }

    /// Where step `step` of this run sat.
    fn at(self, step: usize) -> StepPlace {
        let k = step.saturating_sub(self.step);
        StepPlace { step, kv_row: self.kv_row + k, position: self.position + k, ..self }
    }

    /// One place per step for `steps` steps (empty without runs).
    pub fn expand(runs: &[StepPlace], steps: usize) -> Vec<StepPlace> {
        let Some(first) = runs.first() else { return Vec::new() };
        (0..steps).map(|k| runs.iter().rev().find(|r| r.step <= k).unwrap_or(first).at(k)).collect()
    }
}

/// Where a path first chose differently from its reference, in layout terms.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct DivergenceReport {
    #[serde(flatten)]
    pub choice: Choice,
    /// Which of the case's paths (batch rows of a same-prompt batch).
    pub path: usize,
    /// RoPE position of the token fed at that step.
    pub position: usize,
    pub position_mod_tile: usize,
    pub kv_row: usize,
    /// Paged backend: block of the sequence and offset inside it holding `kv_row`.
    pub block_index: Option<usize>,
    pub offset_in_block: Option<usize>,
    pub pads_trimmed: usize,
    pub batch_row: usize,
    pub batch_size: usize,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub rows: usize,
    pub passed: usize,
    pub failed: usize,
    pub skipped: usize,
    pub by_verdict: BTreeMap<String, usize>,
    /// Snapshot files that differ from the accepted ones (`.snap.new` written).
    pub snapshot_changes: Vec<String>,
    /// Those of `snapshot_changes` with no accepted snapshot yet (new, not changed).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub snapshot_new: Vec<String>,
    /// Wall time of the run.
    pub seconds: f64,
    /// Worker processes the cells ran in (`parity run --jobs`); absent: this one. Phase
    /// times are then the workers' summed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub jobs: Option<usize>,
}

impl Summary {
    /// `N rows: P passed, F failed, S skipped; K snapshot changes; 1.23s`, as the table and the
    /// Markdown summary both print it.
    pub fn line(&self) -> String {
        format!(
            "{}: {} passed, {} failed, {} skipped; {}; {:.2}s",
            describe::plural(self.rows, "row"),
            self.passed,
            self.failed,
            self.skipped,
            describe::plural(self.snapshot_changes.len(), "snapshot change"),
            self.seconds
        )
    }

    pub fn of(rows: &[Row]) -> Summary {
        let mut s = Summary { rows: rows.len(), ..Summary::default() };
        for r in rows {
            *s.by_verdict.entry(r.verdict.name().to_string()).or_default() += 1;
            if r.verdict == Verdict::Skipped {
                s.skipped += 1;
            } else if r.pass {
                s.passed += 1;
            } else {
                s.failed += 1;
            }
        }
        s
    }
}

impl Report {
    /// Rows failed, or a snapshot changed: the run is a failure (exit 1).
    pub fn failed(&self) -> bool {
        self.summary.failed > 0 || !self.summary.snapshot_changes.is_empty()
    }

    /// Nothing could be judged because a checkpoint was absent or would not load.
    pub fn unjudgeable(&self) -> bool {
        self.checkpoints.iter().any(|c| c.status != CheckpointStatus::Ran)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}
