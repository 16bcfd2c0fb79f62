//! Running a suite: for each checkpoint, load the model once, compute each prompt's dense
//! reference once, run every (scenario, backend) unit against those references, and turn the
//! comparisons into report rows. One checkpoint failing does not stop the others.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::checkpoint::{self, ModelConfig, Tokenizer};
use crate::compare::Verdict;
use crate::engine::{self, EnginePath};
use crate::error::{Error, Result};
use crate::faults::Faults;
use crate::model::Model;
use crate::report::{CheckpointReport, CheckpointStatus, Phase, Report, Row, SCHEMA_VERSION, Shard, Summary, row_id};
use crate::scenario::{self, Harness, Prompt, Scenario};
use crate::suite::{CheckpointSpec, PromptSource, PromptSpec, Suite};

mod rows;
mod select;

pub(crate) use rows::{blanket_rows, empty_row};
use rows::{case_row, floor_for};
pub(crate) use select::selected;
use select::{Filter, unit_selected};
pub use select::{check_selection, nothing_selected};

#[derive(Debug, Clone, Default)]
pub struct RunOptions {
    /// Keep rows whose `checkpoint/prompt/scenario/backend` contains this text.
    pub filter: Option<String>,
    pub scenarios: Option<Vec<Scenario>>,
    /// Only these paths (`--backend`).
    pub backends: Option<Vec<String>>,
    pub shard: Option<Shard>,
    /// An absent checkpoint is an error row instead of a skipped one.
    pub require_models: bool,
    pub faults: Faults,
    /// Where servers under test (kind = "openai") write their logs; none: not kept.
    pub server_logs: Option<std::path::PathBuf>,
}

/// Progress callbacks; the CLI draws bars, tests pass [`NoProgress`].
pub trait Progress {
    fn checkpoint(&self, _name: &str, _units: usize) {}
    fn unit(&self, _label: &str) {}
    /// A unit finished with these rows (stream them: a run killed later keeps its log).
    fn unit_done(&self, _rows: &[Row]) {}
    fn checkpoint_done(&self) {}
}

pub struct NoProgress;
impl Progress for NoProgress {}

/// A (scenario, path) pair of one checkpoint: the unit of work (shards split by scenario).
pub(crate) struct Unit {
    pub scenario: Scenario,
    pub path: String,
    pub prompts: Vec<usize>,
}

pub fn run_suite(suite: &Suite, opts: &RunOptions, progress: &dyn Progress) -> Report {
    let started = Instant::now();
    let mut rows = Vec::new();
    let mut checkpoints = Vec::new();
    let mut unit_index = 0usize;
    for spec in &suite.checkpoints {
        let units = plan(suite, spec, opts, &mut unit_index);
        if units.is_empty() {
            continue;
        }
        progress.checkpoint(&spec.name, units.len());
        let (report, mut r) = run_checkpoint(suite, spec, &units, opts, progress);
        progress.checkpoint_done();
        // A checkpoint none of whose rows was selected is not part of this run: its absence
        // must not make a bisect step unjudgeable, nor its load time show.
        if r.is_empty() && opts.filter.is_some() {
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
        environment: crate::runtime::environment(),
        shard: opts.shard,
        faults: opts.faults.list().iter().map(|f| f.name().to_string()).collect(),
        checkpoints,
        rows,
        summary,
    }
}

/// The units of one checkpoint this run (filters and shard applied). Shards split the suite
/// by (checkpoint, scenario), numbered over the whole suite in file order, so every shard
/// agrees on who runs what and each snapshot file comes from exactly one shard.
fn plan(suite: &Suite, spec: &CheckpointSpec, opts: &RunOptions, index: &mut usize) -> Vec<Unit> {
    let mut units = Vec::new();
    for &scenario in &spec.scenarios {
        if opts.scenarios.as_ref().is_some_and(|s| !s.contains(&scenario)) {
            continue;
        }
        let mine = opts.shard.is_none_or(|s| *index % s.count == s.index - 1);
        *index += 1;
        if !mine {
            continue;
        }
        for path in &spec.paths {
            if opts.backends.as_ref().is_some_and(|b| !b.contains(path)) {
                continue;
            }
            // Every prompt of the checkpoint, whatever the filter: scenarios pair prompts
            // (ragged partners), so a selected row must see the same prompts as in a full run.
            // The filter selects rows inside the scenarios (`Harness::select`).
            let prompts: Vec<usize> = suite
                .prompts
                .iter()
                .enumerate()
                .filter(|(_, p)| spec.prompts.contains(&p.name))
                .map(|(i, _)| i)
                .collect();
            if !prompts.is_empty() {
                units.push(Unit { scenario, path: path.clone(), prompts });
            }
        }
    }
    units
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
        phases: Vec::new(),
        noise_floor: BTreeMap::new(),
        prompt_ids: BTreeMap::new(),
        engine: None,
        reference_engine: None,
        reference_path: None,
    }
}

fn run_checkpoint(
    suite: &Suite,
    spec: &CheckpointSpec,
    units: &[Unit],
    opts: &RunOptions,
    progress: &dyn Progress,
) -> (CheckpointReport, Vec<Row>) {
    let mut report = checkpoint_report(spec, CheckpointStatus::Ran);
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
            return (report, blanket_rows(suite, spec, units, opts, verdict, &why));
        }
    };
    report.resolved = Some(dir.display().to_string());

    let t = Instant::now();
    let meta = ModelConfig::load(&dir).and_then(|c| Ok((c, Tokenizer::load(&dir)?)));
    let (config, tokenizer) = match meta {
        Ok(x) => x,
        Err(e) => {
            let why = e.to_string();
            report.status = CheckpointStatus::Error;
            report.reason = Some(why.clone());
            return (report, blanket_rows(suite, spec, units, opts, Verdict::Error, &why));
        }
    };
    // A server cannot be stepped: it runs the request-level scenarios on its own.
    if let crate::suite::EngineSpec::Openai(o) = &spec.engine {
        let ctx =
            engine::openai::Checkpoint { suite, spec, openai: o, dir: &dir, tokenizer: &tokenizer, config: &config };
        let rows = engine::openai::run_checkpoint(&ctx, units, opts, progress, &mut report);
        return (report, rows);
    }

    // Prompts, encoded once. A prompt that cannot be encoded fails its own rows only.
    let mut prompts: BTreeMap<usize, std::result::Result<Prompt, String>> = BTreeMap::new();
    for u in units {
        for &p in &u.prompts {
            prompts.entry(p).or_insert_with(|| {
                encode(&suite.prompts[p], &tokenizer, &config, config.vocab_size, spec.settings.max_tokens)
                    .map_err(|e| e.to_string())
            });
        }
    }
    report.prompt_ids = encoded_ids(&prompts);
    let pad = config.pad_token_id.or_else(|| config.eos_token_ids.first().copied()).unwrap_or(0);
    let filter = Filter(opts.filter.as_deref());
    let all: Vec<Prompt> = prompts.values().filter_map(|p| p.as_ref().ok().cloned()).collect();
    // Under a filter, only the units with a selected row load or start anything.
    let units: Vec<&Unit> = match opts.filter {
        None => units.iter().collect(),
        Some(_) => {
            units.iter().filter(|u| unit_selected(spec, u, suite, &prompts, &all, filter, pad, &config)).collect()
        }
    };
    if units.is_empty() {
        return (report, Vec::new());
    }

    let model = if spec.engine.needs_builtin() {
        match Model::load(&dir, config.clone(), spec.dtype.resolve(), spec.dequantize) {
            Ok(m) => Some(m),
            Err(e) => {
                let why = e.to_string();
                report.status = CheckpointStatus::Error;
                report.reason = Some(why.clone());
                return (report, blanket_rows(suite, spec, units.iter().copied(), opts, Verdict::Error, &why));
            }
        }
    } else {
        None
    };
    report.phases.push(Phase { name: "load".into(), seconds: t.elapsed().as_secs_f64() });

    // The engine: the reference path first (nothing can be judged without it), then every
    // path a unit needs. A path that cannot start fails its own rows only.
    let t = Instant::now();
    let suite_dir = suite.dir();
    let open = |name: Option<&str>| engine::open(spec, name, model.as_ref(), &dir, &suite_dir);
    let mut reference = match open(None) {
        Ok(r) => r,
        Err(e) => {
            let why = format!("reference path {}: {e}", spec.engine.reference().describe());
            report.status = CheckpointStatus::Error;
            report.reason = Some(why.clone());
            return (report, blanket_rows(suite, spec, units.iter().copied(), opts, Verdict::Error, &why));
        }
    };
    let mut paths: BTreeMap<String, std::result::Result<Box<dyn EnginePath + '_>, String>> = BTreeMap::new();
    for u in &units {
        if !paths.contains_key(&u.path) {
            paths.insert(u.path.clone(), open(Some(&u.path)).map_err(|e| e.to_string()));
        }
    }
    if !matches!(spec.engine, crate::suite::EngineSpec::Builtin) {
        report.phases.push(Phase { name: "start".into(), seconds: t.elapsed().as_secs_f64() });
    }
    let reference_info = reference.info().clone();
    report.dtype = reference_info.dtype.name().to_string();
    report.reference_engine = Some(reference_info.engine.clone());
    report.reference_path = Some(reference_info.name.clone());
    report.engine = paths.values().find_map(|p| p.as_ref().ok()).map(|p| p.info().engine.clone());

    // The engine's vocabulary is what counts (an adapter may pad it differently from config.json).
    for p in prompts.values_mut() {
        if let Ok(prompt) = p
            && let Some(bad) = prompt.ids.iter().find(|&&i| i as usize >= reference_info.vocab_size)
        {
            *p = Err(format!(
                "prompt `{}`: token id {bad} is outside the engine's vocabulary of {}",
                prompt.name, reference_info.vocab_size
            ));
        }
    }
    let mut harness = Harness::new(reference.as_mut(), spec.settings.clone(), opts.faults, pad);
    // References and noise floors are computed when a selected row first needs them, so a
    // narrow `--filter` (bisect) pays for its own rows only.
    let mut floors: BTreeMap<String, Option<f32>> = BTreeMap::new();
    let mut rows = Vec::new();
    for u in units {
        let label = format!("{} {}", u.scenario.name(), u.path);
        progress.unit(&label);
        let t = Instant::now();
        let mut unit_rows = Vec::new();
        let mut ok_prompts = Vec::new();
        for &p in &u.prompts {
            match &prompts[&p] {
                Ok(prompt) => ok_prompts.push(prompt.clone()),
                Err(why) => {
                    let mut row = empty_row(spec, &suite.prompts[p].name, u.scenario, "*", &u.path, Verdict::Error);
                    row.failure = Some(why.clone());
                    unit_rows.push(row);
                }
            }
        }
        let (ck, sc, path_name) = (spec.name.as_str(), u.scenario.name(), u.path.as_str());
        let select: Option<scenario::Selector> = opts.filter.as_ref().map(|_| {
            Box::new(move |prompt: &str, case: &str| filter.selects(&row_id(ck, prompt, sc, case, path_name)))
                as scenario::Selector
        });
        harness.select(select);
        if !ok_prompts.is_empty() {
            match paths.get_mut(&u.path) {
                Some(Ok(path)) => {
                    let info = path.info().clone();
                    for c in u.scenario.run(&mut harness, path.as_mut(), &ok_prompts) {
                        let floor = floor_for(&mut harness, &mut floors, &c.prompt.name, &all);
                        unit_rows.push(case_row(&mut harness, spec, u, &c, &tokenizer, floor, &info));
                    }
                    // Cases the scenario could not form for a prompt: skipped rows, not missing.
                    for (prompt, case, why) in crate::coverage::absent_cases(u.scenario, &ok_prompts) {
                        let mut row = empty_row(spec, &prompt, u.scenario, case, &u.path, Verdict::Skipped);
                        row.pass = true;
                        row.notes.push(why);
                        unit_rows.push(row);
                    }
                }
                Some(Err(why)) => {
                    for p in &ok_prompts {
                        let mut row = empty_row(spec, &p.name, u.scenario, "*", &u.path, Verdict::Error);
                        row.failure = Some(format!("path {} did not start: {why}", u.path));
                        unit_rows.push(row);
                    }
                }
                None => {}
            }
        }
        harness.select(None);
        // Exact: a case yielding several rows (the prefix donor and adopter, a concurrent
        // schedule) runs whole, but only the rows asked for are reported.
        unit_rows.retain(|r| filter.selects_row(r));
        report.phases.push(Phase { name: label, seconds: t.elapsed().as_secs_f64() });
        progress.unit_done(&unit_rows);
        rows.append(&mut unit_rows);
    }
    report.noise_floor = floors;
    (report, rows)
}

/// The ids of every prompt that encoded, by name, for the report (and its prompts snapshot).
pub(crate) fn encoded_ids(
    prompts: &BTreeMap<usize, std::result::Result<Prompt, String>>,
) -> BTreeMap<String, Vec<u32>> {
    prompts.values().filter_map(|p| p.as_ref().ok()).map(|p| (p.name.clone(), p.ids.clone())).collect()
}

/// Encode a suite prompt for this checkpoint, apply `length`, and check it fits the context
/// with the tokens to generate.
pub(crate) fn encode(
    p: &PromptSpec,
    tok: &Tokenizer,
    config: &ModelConfig,
    vocab: usize,
    max_tokens: usize,
) -> Result<Prompt> {
    let mut ids = match &p.source {
        PromptSource::Text(t) => tok.encode_raw(t)?,
        PromptSource::Chat(t) => tok.encode_chat(t)?,
        PromptSource::Ids(ids) => ids.clone(),
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
