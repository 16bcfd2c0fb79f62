//! Running a suite: for each checkpoint, resolve it and read its config and tokenizer, then
//! hand it to the driver of its kind of engine, which runs every (scenario, path) cell against
//! the references and has each case judged into report rows. One checkpoint failing does not
//! stop the others.
//!
//! - [`steps`]: engines that are stepped (builtin, process): parity's model loaded once, each
//!   prompt's reference computed once, the step-level scenarios run on every path.
//! - [`requests`]: servers (kind = "openai"): references from the reference path's server,
//!   then a fresh server per cell running the request-level scenarios.
//! - [`judge`]: the one judge turning a case of either kind into a row.
//! - [`select`]: what `--filter`, `--scenario` and `--backend` select.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::checkpoint::{self, ModelConfig, Tokenizer};
use crate::error::{Error, Result};
use crate::faults::Faults;
use crate::report::{CheckpointReport, CheckpointStatus, Phase, Report, Row, SCHEMA_VERSION, Shard, Summary};
use crate::scenario::explore::Budget;
use crate::vocab::{
    BuiltinRef, CheckpointSpec, EngineSpec, Prompt, PromptSource, PromptSpec, ReferenceSpec, Scenario, Suite, Verdict,
};

mod claims;
mod judge;
mod requests;
mod select;
mod steps;
mod witness;

pub use claims::Claims;
use select::Filter;
pub use select::{check_selection, nothing_selected, nothing_tested};

#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Keep rows whose id (`checkpoint/prompt/scenario:case/path`) contains this text.
    pub filter: Option<String>,
    pub scenarios: Option<Vec<Scenario>>,
    /// Only these paths (`--backend`).
    pub paths: Option<Vec<String>>,
    /// Only these checkpoints, by name (`--checkpoint`).
    pub checkpoints: Option<Vec<String>>,
    pub shard: Option<Shard>,
    /// An absent checkpoint is an error row instead of a skipped one.
    pub require_models: bool,
    pub faults: Faults,
    /// Where servers under test (kind = "openai") write their logs; none: not kept.
    pub server_logs: Option<std::path::PathBuf>,
    /// `parity explore`: random schedules on every path within this budget, instead of the
    /// suite's scenarios.
    pub explore: Option<Budget>,
    /// A worker of `parity run --jobs N`: runs only the cells it claims from the others.
    pub claims: Option<Claims>,
    /// A worker's directory shared with the others: references and noise floors computed once
    /// for all of them (`scenario::shared`).
    pub shared: Option<std::path::PathBuf>,
}

/// Progress callbacks; the CLI draws bars, tests pass [`NoProgress`].
pub trait Progress {
    fn checkpoint(&self, _name: &str, _cells: usize) {}
    fn cell(&self, _label: &str) {}
    /// A cell finished with these rows (stream them: a run killed later keeps its log).
    fn cell_done(&self, _rows: &[Row]) {}
    fn checkpoint_done(&self) {}
}

pub struct NoProgress;
impl Progress for NoProgress {}

/// One cell of a checkpoint's scenario x path matrix, with the suite's prompts it runs: the
/// unit of work (shards split by scenario).
pub(crate) struct Cell {
    /// Its place among the run's cells, counted over the whole suite in plan order (what
    /// workers claim cells by).
    pub index: usize,
    pub scenario: Scenario,
    pub path: String,
    pub prompts: Vec<usize>,
}

pub fn run_suite(suite: &Suite, opts: &RunOptions, progress: &dyn Progress) -> Report {
    let started = Instant::now();
    let mut rows = Vec::new();
    let mut checkpoints = Vec::new();
    let (mut unit_index, mut cell_index) = (0usize, 0usize);
    for spec in &suite.checkpoints {
        let cells = plan(suite, spec, opts, &mut unit_index, &mut cell_index);
        if cells.is_empty() {
            continue;
        }
        // A worker whose peers have taken every cell of this checkpoint loads nothing for it.
        if let (Some(claims), Some(last)) = (&opts.claims, cells.last())
            && !claims.any_free_through(last.index)
        {
            continue;
        }
        progress.checkpoint(&spec.name, cells.len());
        let (report, mut r) = run_checkpoint(suite, spec, &cells, opts, progress);
        progress.checkpoint_done();
        // A checkpoint none of whose rows was selected is not part of this run: its absence
        // must not make a bisect step unjudgeable, nor its load time show. Nor is one whose
        // cells a worker's peers all took.
        if r.is_empty() && (opts.filter.is_some() || opts.claims.is_some()) {
            continue;
        }
        checkpoints.push(report);
        rows.append(&mut r);
    }
    let mut summary = Summary::of(&rows);
    summary.seconds = started.elapsed().as_secs_f64();
    Report {
        schema: SCHEMA_VERSION,
        suite: suite.name.clone(),
        suite_file: suite.file.display().to_string(),
        parity_version: env!("CARGO_PKG_VERSION").to_string(),
        parity_commit: env!("PARITY_GIT_COMMIT").to_string(),
        environment: environment(suite, &checkpoints),
        shard: opts.shard,
        faults: opts.faults.list().iter().map(|f| f.name().to_string()).collect(),
        checkpoints,
        rows,
        summary,
    }
}

/// Where this run computed: this process's device, and the device each pinned reference's
/// child said it computed on (`builtin:dense@cpu` -> `cpu`), so a device parity report names
/// both sides in its environment block, not only per checkpoint.
fn environment(suite: &Suite, checkpoints: &[CheckpointReport]) -> crate::environment::Environment {
    let mut env = crate::environment::environment();
    for c in checkpoints {
        let Some(spec) = suite.checkpoints.iter().find(|s| s.name == c.name) else { continue };
        let reference = spec.engine.reference();
        if let ReferenceSpec::Builtin(BuiltinRef { device: Some(_), .. }) = reference
            && let Some(device) = c.reference_engine.as_ref().and_then(|e| e.device.clone())
        {
            env.reference_devices.insert(reference.describe(), device);
        }
    }
    env
}

/// How many cells the run has (filters and shard applied, `--filter` aside: it selects rows
/// inside cells).
pub fn cell_count(suite: &Suite, opts: &RunOptions) -> usize {
    let (mut unit, mut cell) = (0, 0);
    suite.checkpoints.iter().map(|spec| plan(suite, spec, opts, &mut unit, &mut cell).len()).sum()
}

/// The cells of one checkpoint this run (filters and shard applied). Shards split the suite
/// by (checkpoint, scenario), numbered over the whole suite in file order, so every shard
/// agrees on who runs what and each snapshot file comes from exactly one shard.
fn plan(
    suite: &Suite,
    spec: &CheckpointSpec,
    opts: &RunOptions,
    index: &mut usize,
    cell_index: &mut usize,
) -> Vec<Cell> {
    let mut cells = Vec::new();
    if opts.checkpoints.as_ref().is_some_and(|c| !c.contains(&spec.name)) {
        return cells;
    }
    let scenarios = if opts.explore.is_some() { vec![Scenario::Explore] } else { spec.scenarios.clone() };
    for scenario in scenarios {
        if opts.scenarios.as_ref().is_some_and(|s| !s.contains(&scenario)) {
            continue;
        }
        let mine = opts.shard.is_none_or(|s| *index % s.count == s.index - 1);
        *index += 1;
        if !mine {
            continue;
        }
        for path in &spec.paths {
            if opts.paths.as_ref().is_some_and(|b| !b.contains(path)) {
                continue;
            }
            // Every prompt of the checkpoint, whatever the filter: scenarios pair prompts
            // (ragged partners), so a selected row must see the same prompts as in a full run.
            // The filter selects rows inside the scenarios (`Setup::select`).
            let prompts: Vec<usize> = suite
                .prompts
                .iter()
                .enumerate()
                .filter(|(_, p)| spec.prompts.contains(&p.name))
                .map(|(i, _)| i)
                .collect();
            if !prompts.is_empty() {
                cells.push(Cell { index: *cell_index, scenario, path: path.clone(), prompts });
                *cell_index += 1;
            }
        }
    }
    cells
}

fn checkpoint_report(spec: &CheckpointSpec, status: CheckpointStatus) -> CheckpointReport {
    CheckpointReport {
        name: spec.name.clone(),
        reference: spec.reference.clone(),
        resolved: None,
        status,
        reason: None,
        dtype: format!("{:?}", spec.dtype).to_lowercase(),
        dequantized: spec.dequantize,
        settings: spec.settings.clone(),
        max_rel_rms_tolerance: spec.tolerance.max_rel_rms,
        max_logprob_delta_tolerance: None,
        bitwise: false,
        allowed_verdicts: spec.tolerance.allow.clone(),
        no_snapshot: spec.no_snapshot.clone(),
        phases: Vec::new(),
        noise_floor: BTreeMap::new(),
        prompt_ids: BTreeMap::new(),
        engine: None,
        reference_engine: None,
        reference_path: None,
    }
}

/// A checkpoint of the suite resolved to its directory, its config and tokenizer read: what
/// the driver of either kind of engine starts from.
pub(crate) struct Resolved<'a> {
    pub suite: &'a Suite,
    pub spec: &'a CheckpointSpec,
    pub dir: std::path::PathBuf,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    /// When loading began (the builtin's "load" phase counts from here).
    pub loading: Instant,
    pub filter: Filter<'a>,
}

fn run_checkpoint(
    suite: &Suite,
    spec: &CheckpointSpec,
    cells: &[Cell],
    opts: &RunOptions,
    progress: &dyn Progress,
) -> (CheckpointReport, Vec<Row>) {
    let mut report = checkpoint_report(spec, CheckpointStatus::Ran);
    let filter = Filter(opts.filter.as_deref());
    let dir = match checkpoint::resolve(&spec.reference, &suite.dir()) {
        Ok(d) => d,
        Err(e) => {
            let why = e.to_string();
            let absent = matches!(e, Error::CheckpointNotFound { .. });
            let (status, verdict) = if absent && !opts.require_models {
                (CheckpointStatus::Skipped, Verdict::Skipped)
            } else {
                (CheckpointStatus::Error, Verdict::Error)
            };
            report.status = status;
            report.reason = Some(why.clone());
            return (report, blanket_rows(suite, spec, cells, opts, filter, verdict, &why));
        }
    };
    report.resolved = Some(dir.display().to_string());

    let loading = Instant::now();
    let meta = ModelConfig::load(&dir).and_then(|c| Ok((c, Tokenizer::load(&dir)?)));
    let (config, tokenizer) = match meta {
        Ok(x) => x,
        Err(e) => {
            let why = e.to_string();
            report.status = CheckpointStatus::Error;
            report.reason = Some(why.clone());
            return (report, blanket_rows(suite, spec, cells, opts, filter, Verdict::Error, &why));
        }
    };
    let r = Resolved { suite, spec, dir, config, tokenizer, loading, filter };
    let rows = match &spec.engine {
        // A server cannot be stepped: it runs the request-level scenarios.
        EngineSpec::Openai(o) => requests::run(&r, o, cells, opts, progress, &mut report),
        EngineSpec::Builtin { .. } | EngineSpec::Process(_) => steps::run(&r, cells, opts, progress, &mut report),
    };
    (report, rows)
}

/// Every prompt the cells run, encoded once by its index in the suite; one that cannot be
/// encoded fails its own rows only. `vocab`: the vocabulary every id must fall in.
fn encode_all(r: &Resolved, cells: &[Cell], vocab: usize) -> BTreeMap<usize, std::result::Result<Prompt, String>> {
    let mut prompts = BTreeMap::new();
    for c in cells {
        for &p in &c.prompts {
            prompts.entry(p).or_insert_with(|| {
                encode(&r.suite.prompts[p], &r.tokenizer, &r.config, vocab, r.spec.settings.max_tokens)
                    .map_err(|e| e.to_string())
            });
        }
    }
    prompts
}

/// The ids of every prompt that encoded, by name, for the report (and its prompts snapshot).
fn encoded_ids(prompts: &BTreeMap<usize, std::result::Result<Prompt, String>>) -> BTreeMap<String, Vec<u32>> {
    prompts.values().filter_map(|p| p.as_ref().ok()).map(|p| (p.name.clone(), p.ids.clone())).collect()
}

/// Encode a suite prompt for this checkpoint, apply `length`, and check it fits the context
/// with the tokens to generate.
fn encode(p: &PromptSpec, tok: &Tokenizer, config: &ModelConfig, vocab: usize, max_tokens: usize) -> Result<Prompt> {
    let mut ids = match &p.source {
        PromptSource::Text(t) => tok.encode_raw(t)?,
        PromptSource::Chat(t) => tok.encode_chat(t)?,
        PromptSource::Ids(ids) => ids.clone(),
        PromptSource::File(f) => {
            let text = std::fs::read_to_string(f).map_err(|e| {
                Error::Invalid(format!("prompt `{}`: cannot read its file {}: {e}", p.name, f.display()))
            })?;
            tok.encode_raw(&text)?
        }
    };
    if ids.is_empty() {
        return Err(Error::Invalid(format!("prompt `{}` encodes to no tokens", p.name)));
    }
    if let Some(n) = p.length {
        ids = ids.iter().copied().cycle().take(n).collect();
    }
    let context = config.max_position_embeddings;
    if ids.len() + max_tokens > context {
        return Err(Error::Invalid(format!(
            "prompt `{}`: {} tokens plus {max_tokens} to generate exceed the context of {context} \
             (max_position_embeddings in config.json)",
            p.name,
            ids.len()
        )));
    }
    if let Some(bad) = ids.iter().find(|&&i| i as usize >= vocab) {
        return Err(Error::Invalid(format!(
            "prompt `{}`: token id {bad} is outside the vocabulary of {vocab}",
            p.name
        )));
    }
    Ok(Prompt { name: p.name.clone(), ids })
}

/// Run `cells` in order: each is announced, timed (a phase named `<scenario> <path>`, after
/// any phases the cell itself records, such as a server's start or the reference's work done
/// for it) and streamed to `progress` with its rows, which `run` makes and the filter then
/// narrows to the rows asked for (a case yielding several rows, such as a prefix donor and
/// adopter or a concurrent schedule, runs whole). Phases are disjoint: the cell's own phase is
/// its time less the phases it recorded, so a report's phases add up to the run's time.
fn each_cell<'c>(
    cells: impl IntoIterator<Item = &'c Cell>,
    opts: &RunOptions,
    filter: Filter,
    progress: &dyn Progress,
    phases: &mut Vec<Phase>,
    mut run: impl FnMut(&Cell, &mut Vec<Phase>) -> Vec<Row>,
) -> Vec<Row> {
    let mut rows = Vec::new();
    for cell in cells.into_iter().filter(|c| mine(opts, c)) {
        let label = format!("{} {}", cell.scenario.name(), cell.path);
        progress.cell(&label);
        let (t, before) = (Instant::now(), phases.len());
        let mut cell_rows = run(cell, phases);
        cell_rows.retain(|r| filter.selects_row(r));
        let inner: f64 = phases[before..].iter().map(|p| p.seconds).sum();
        phases.push(Phase { name: label, seconds: (t.elapsed().as_secs_f64() - inner).max(0.0) });
        progress.cell_done(&cell_rows);
        rows.append(&mut cell_rows);
    }
    rows
}

/// Whether this process runs `cell`: always, unless it is one worker of several and another
/// took the cell.
fn mine(opts: &RunOptions, cell: &Cell) -> bool {
    opts.claims.as_ref().is_none_or(|c| c.take(cell.index))
}

/// The rows of a cell's prompts that could not be encoded: each fails its own `*` row.
fn unencoded_rows(
    r: &Resolved,
    cell: &Cell,
    prompts: &BTreeMap<usize, std::result::Result<Prompt, String>>,
) -> Vec<Row> {
    cell.prompts
        .iter()
        .filter_map(|p| {
            let why = prompts[p].as_ref().err()?;
            let mut row = cell_row(r.spec, cell, &r.suite.prompts[*p].name, "*", Verdict::Error);
            row.failure = Some(why.clone());
            Some(row)
        })
        .collect()
}

/// A row of `cell`, named and with its verdict, nothing measured.
fn cell_row(spec: &CheckpointSpec, cell: &Cell, prompt: &str, case: &str, verdict: Verdict) -> Row {
    Row::new(&spec.name, prompt, cell.scenario.name(), case, &cell.path, verdict)
}

/// Rows for cells that could not run at all (checkpoint absent or broken, reference path not
/// started): one `*` row per prompt, saying why.
fn blanket_rows<'c>(
    suite: &Suite,
    spec: &CheckpointSpec,
    cells: impl IntoIterator<Item = &'c Cell>,
    opts: &RunOptions,
    filter: Filter,
    verdict: Verdict,
    why: &str,
) -> Vec<Row> {
    let mut rows = Vec::new();
    for c in cells.into_iter().filter(|c| mine(opts, c)) {
        for &p in &c.prompts {
            let mut row = cell_row(spec, c, &suite.prompts[p].name, "*", verdict);
            row.pass = verdict == Verdict::Skipped;
            row.failure = (verdict != Verdict::Skipped).then(|| why.to_string());
            row.notes.push(why.lines().next().unwrap_or(why).to_string());
            rows.push(row);
        }
    }
    rows.retain(|r| filter.selects_row(r));
    rows
}
