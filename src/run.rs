//! Running a suite: for each checkpoint, load the model once, compute each prompt's dense
//! reference once, run every (scenario, backend) unit against those references, and turn the
//! comparisons into report rows. One checkpoint failing does not stop the others.

use std::collections::BTreeMap;
use std::time::Instant;

use crate::checkpoint::{self, ModelConfig, Tokenizer};
use crate::compare::{self, PathComparison, Verdict, nan_max};
use crate::engine::{self, EnginePath, PathInfo};
use crate::error::{Error, Result};
use crate::faults::Faults;
use crate::model::Model;
use crate::report::{
    CheckpointReport, CheckpointStatus, DivergenceReport, Phase, Report, Row, SCHEMA_VERSION, Shard, StepPlace,
    Summary, finite, row_id,
};
use crate::scenario::{self, CaseOutput, Harness, Live, Outcome, Prompt, Scenario};
use crate::suite::{CheckpointSpec, PromptSource, PromptSpec, Suite};

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

/// `--filter`: a row is selected when its id (`Row::id`) contains the text. Rows standing for
/// a whole unit of a prompt (case `*`: the checkpoint is absent, the prompt does not encode)
/// are selected by an id of any case of that unit.
#[derive(Clone, Copy)]
struct Filter<'a>(Option<&'a str>);

impl Filter<'_> {
    fn selects(&self, id: &str) -> bool {
        self.0.is_none_or(|f| id.contains(f))
    }

    fn selects_row(&self, row: &Row) -> bool {
        let id = row.id();
        if row.case != "*" {
            return self.selects(&id);
        }
        self.0.is_none_or(|f| {
            // `ck/p/sc:case/path` -> `ck/p/sc:*/path`, to compare with a `*` row's id.
            let any_case = match (f.find(':'), f.rfind('/')) {
                (Some(colon), Some(slash)) if slash > colon => format!("{}*{}", &f[..=colon], &f[slash..]),
                _ => f.to_string(),
            };
            id.contains(f) || id.contains(&any_case)
        })
    }
}

/// `--filter` on a row an engine built itself (kind = "openai" plans its own units).
pub(crate) fn selected(opts: &RunOptions, row: &Row) -> bool {
    Filter(opts.filter.as_deref()).selects_row(row)
}

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

/// Rows for units that could not run at all (checkpoint absent or broken).
pub(crate) fn blanket_rows<'u>(
    suite: &Suite,
    spec: &CheckpointSpec,
    units: impl IntoIterator<Item = &'u Unit>,
    opts: &RunOptions,
    verdict: Verdict,
    why: &str,
) -> Vec<Row> {
    let mut rows = Vec::new();
    for u in units {
        for &p in &u.prompts {
            let mut row = empty_row(spec, &suite.prompts[p].name, u.scenario, "*", &u.path, verdict);
            row.pass = verdict == Verdict::Skipped;
            row.failure = (verdict != Verdict::Skipped).then(|| why.to_string());
            row.notes.push(why.lines().next().unwrap_or(why).to_string());
            rows.push(row);
        }
    }
    rows.retain(|r| Filter(opts.filter.as_deref()).selects_row(r));
    rows
}

pub(crate) fn empty_row(
    spec: &CheckpointSpec,
    prompt: &str,
    scenario: Scenario,
    case: &str,
    path: &str,
    verdict: Verdict,
) -> Row {
    Row {
        checkpoint: spec.name.clone(),
        prompt: prompt.to_string(),
        scenario: scenario.name().to_string(),
        case: case.to_string(),
        backend: path.to_string(),
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

/// Whether unit `u` yields a row `filter` selects. Scenarios name each row (prompt, case)
/// before they touch an engine, so running them against a stand-in that records what is
/// wanted and lets nothing run names exactly the rows a real run would make: the plan and the
/// run cannot disagree.
#[allow(clippy::too_many_arguments)]
fn unit_selected(
    spec: &CheckpointSpec,
    u: &Unit,
    suite: &Suite,
    prompts: &BTreeMap<usize, std::result::Result<Prompt, String>>,
    all: &[Prompt],
    filter: Filter,
    pad: u32,
    config: &ModelConfig,
) -> bool {
    let (ck, sc, path) = (spec.name.as_str(), u.scenario.name(), u.path.as_str());
    let failed_prompt = u.prompts.iter().any(|p| {
        prompts[p].is_err()
            && filter.selects_row(&empty_row(spec, &suite.prompts[*p].name, u.scenario, "*", path, Verdict::Error))
    });
    if failed_prompt {
        return true;
    }
    let mut stand_in = engine::Planning::new(config.vocab_size);
    let mut reference = engine::Planning::new(config.vocab_size);
    let found = std::cell::Cell::new(false);
    let mut h = Harness::new(&mut reference, spec.settings.clone(), Faults::NONE, pad);
    h.select(Some(Box::new(|prompt: &str, case: &str| {
        if filter.selects(&row_id(ck, prompt, sc, case, path)) {
            found.set(true);
        }
        false
    })));
    let mine: Vec<Prompt> =
        all.iter().filter(|p| u.prompts.iter().any(|&i| suite.prompts[i].name == p.name)).cloned().collect();
    let _ = u.scenario.run(&mut h, &mut stand_in, &mine);
    drop(h);
    found.get()
}

/// The noise floor of a row's base prompt (`p` of `p/shared7`), measured once per prompt.
fn floor_for(h: &mut Harness, floors: &mut BTreeMap<String, Option<f32>>, prompt: &str, all: &[Prompt]) -> Option<f32> {
    let base = prompt.split('/').next().unwrap_or(prompt);
    if let Some(f) = floors.get(base) {
        return *f;
    }
    let p = all.iter().find(|p| p.name == base)?;
    // A measurement aid: if it cannot be taken, the floor is unknown (null), not a failure.
    let floor = noise_floor(h, p, all).ok().flatten();
    floors.insert(base.to_string(), floor);
    floor
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

/// The reference re-run in a different batch composition (as row 1 of a batch of two on the
/// reference path, next to another prompt): how far apart two correct runs are on this machine.
fn noise_floor(h: &mut Harness, p: &Prompt, all: &[Prompt]) -> Result<Option<f32>> {
    let partner = all
        .iter()
        .find(|q| q.ids != p.ids)
        .cloned()
        .unwrap_or_else(|| Prompt { name: "reversed".into(), ids: p.ids.iter().rev().copied().collect() });
    let (reference, partner_ref) = (h.reference(&p.ids)?, h.reference(&partner.ids)?);
    let steps = h.settings.max_tokens;
    let info = h.reference_info().clone();
    if info.capabilities.max_batch.is_some_and(|m| m < 2) {
        return Ok(None);
    }
    let mut s = h.reference_session()?;
    let mut lives = [Live::new(s.create(0)?, &partner_ref, steps), Live::new(s.create(0)?, &reference, steps)];
    scenario::prefill(s.as_mut(), &mut lives[0], &partner.ids)?;
    scenario::prefill(s.as_mut(), &mut lives[1], &p.ids)?;
    scenario::decode_all(s.as_mut(), &mut lives)?;
    let cmp = compare::compare(&reference, &lives[1].trace, info.dtype, f32::INFINITY)?;
    Ok(finite(cmp.max_rel_rms))
}

/// Compare every path of a case with its reference and fold them into one row.
fn case_row(
    h: &mut Harness,
    spec: &CheckpointSpec,
    u: &Unit,
    c: &CaseOutput,
    tok: &Tokenizer,
    floor: Option<f32>,
    path: &PathInfo,
) -> Row {
    let mut row = empty_row(spec, &c.prompt.name, u.scenario, &c.case, &u.path, Verdict::Identical);
    row.notes = c.notes.clone();
    match &c.outcome {
        Outcome::Ran => {}
        Outcome::Skipped(why) => {
            row.verdict = Verdict::Skipped;
            row.pass = true;
            row.notes.push(why.clone());
            return row;
        }
        Outcome::Failed(why) => {
            row.verdict = Verdict::Error;
            row.failure = Some(format!("{} on {}: {why}", u.scenario.name(), u.path));
            return row;
        }
    }
    row.paths = c.paths.len();
    row.kv = c.kv;
    row.noise_floor_rel_rms = floor;
    // A case that tested nothing of its scenario is skipped with the reason, never a pass.
    if let Some(why) = crate::coverage::skip_reason(u.scenario, path.kv_backend(), c, &spec.settings) {
        row.verdict = Verdict::Skipped;
        row.pass = true;
        row.notes.push(why);
        return row;
    }
    let reference = match h.reference(&c.prompt.ids) {
        Ok(r) => r,
        Err(e) => {
            row.verdict = Verdict::Error;
            row.failure = Some(format!("reference: {e}"));
            return row;
        }
    };
    let mut comparisons: Vec<PathComparison> = Vec::new();
    for trace in &c.paths {
        match compare::compare(&reference, trace, path.dtype, spec.tolerance.max_rel_rms) {
            Ok(cmp) => comparisons.push(cmp),
            Err(e) => {
                row.verdict = Verdict::Error;
                row.failure = Some(format!("comparison: {e}"));
                return row;
            }
        }
    }
    // The worst path speaks for the row; among equals, the earliest divergence.
    let worst = comparisons
        .iter()
        .enumerate()
        .max_by_key(|(_, cmp)| {
            (cmp.verdict.rank(), std::cmp::Reverse(cmp.first_divergence.as_ref().map_or(usize::MAX, |d| d.choice.step)))
        })
        .map(|(i, _)| i);
    let Some(w) = worst else {
        row.verdict = Verdict::Error;
        row.failure = Some("case produced no paths".into());
        return row;
    };
    let cmp = &comparisons[w];
    row.verdict = cmp.verdict;
    row.tokens = cmp.tokens.clone();
    row.reference_tokens = cmp.reference_tokens.clone();
    let steps = comparisons.iter().map(|c| c.steps.len()).max().unwrap_or(0);
    let mut step_rms = vec![0f32; steps];
    let mut step_kl = vec![0f32; steps];
    let (mut max_rms, mut max_kl) = (0f32, 0f32);
    for cmp in &comparisons {
        for (i, m) in cmp.steps.iter().enumerate() {
            step_rms[i] = nan_max(step_rms[i], m.rel_rms);
            step_kl[i] = nan_max(step_kl[i], m.kl);
        }
        max_rms = nan_max(max_rms, cmp.max_rel_rms);
        max_kl = nan_max(max_kl, cmp.max_kl);
    }
    row.nan = max_rms.is_nan();
    row.max_rel_rms = finite(max_rms);
    row.max_kl = finite(max_kl);
    row.step_rel_rms = step_rms.into_iter().map(finite).collect();
    row.step_kl = step_kl.into_iter().map(finite).collect();
    row.step_layout = StepPlace::runs(c.paths[w].layout.iter().map(|l| StepPlace {
        step: 0,
        kv_row: l.kv_row,
        position: l.position,
        pads_trimmed: l.pads_trimmed,
        rolled_back: l.rolled_back,
    }));
    row.block_size = path.capabilities.block_size.filter(|&bs| bs > 0);
    row.first_divergence = cmp.first_divergence.as_ref().map(|d| {
        let blocks = path.capabilities.block_size.filter(|&bs| bs > 0);
        DivergenceReport {
            choice: d.choice.clone(),
            path: w,
            position: d.layout.position,
            position_mod_tile: d.layout.position % spec.settings.tile.max(1),
            kv_row: d.layout.kv_row,
            block_index: blocks.map(|bs| d.layout.kv_row / bs),
            offset_in_block: blocks.map(|bs| d.layout.kv_row % bs),
            pads_trimmed: d.layout.pads_trimmed,
            batch_row: d.layout.batch_row,
            batch_size: d.layout.batch_size,
        }
    });
    row.text = tok.decode(&row.tokens).ok();
    row.reference_text = tok.decode(&row.reference_tokens).ok();
    judge(&mut row, spec);
    // Same tokens from a pool that leaks is still a broken engine: the books fail the row.
    if let Some(books) = &c.audit {
        row.verdict = Verdict::Error;
        row.pass = false;
        row.failure = Some(row.failure.take().map_or_else(|| books.clone(), |f| format!("{f}; {books}")));
    }
    row
}

/// A row passes when its verdict is allowed and its largest relative RMS is within the
/// tolerance (a NaN never is).
fn judge(row: &mut Row, spec: &CheckpointSpec) {
    let tol = spec.tolerance.max_rel_rms;
    let mut why = Vec::new();
    if !spec.tolerance.allow.contains(&row.verdict) {
        why.push(match &row.first_divergence {
            Some(d) => format!("{} at step {} (position {})", row.verdict.name(), d.choice.step, d.position),
            None => row.verdict.name().to_string(),
        });
    }
    match row.max_rel_rms {
        None if row.nan => why.push("NaN logits from a finite reference (a poisoned or freed row was read)".into()),
        Some(r) if r > tol => why.push(format!("max relative RMS {r:.3e} > tolerance {tol:.1e}")),
        _ => {}
    }
    row.pass = why.is_empty();
    row.failure = (!why.is_empty()).then(|| why.join("; "));
}

/// Refuse, before any work, a `--scenario` or `--backend` that no checkpoint of the suite has.
pub fn check_selection(suite: &Suite, opts: &RunOptions) -> std::result::Result<(), String> {
    let has = |f: &dyn Fn(&CheckpointSpec) -> Vec<String>| -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        for c in &suite.checkpoints {
            for n in f(c) {
                if !names.contains(&n) {
                    names.push(n);
                }
            }
        }
        names
    };
    let scenarios = has(&|c| c.scenarios.iter().map(|s| s.name().to_string()).collect());
    for s in opts.scenarios.iter().flatten() {
        if !scenarios.iter().any(|x| x == s.name()) {
            return Err(format!(
                "--scenario {}: suite {} does not run it (it runs {})",
                s.name(),
                suite.file.display(),
                scenarios.join(", ")
            ));
        }
    }
    let paths = has(&|c| c.paths.clone());
    for b in opts.backends.iter().flatten() {
        if !paths.contains(b) {
            return Err(format!(
                "--backend {b}: suite {} has no such path (it has {})",
                suite.file.display(),
                paths.join(", ")
            ));
        }
    }
    Ok(())
}

/// Why a run produced no row, with what the suite has, so the next try can hit.
pub fn nothing_selected(suite: &Suite, opts: &RunOptions) -> String {
    let mut asked = Vec::new();
    if let Some(f) = &opts.filter {
        asked.push(format!("--filter {f}"));
    }
    for s in opts.scenarios.iter().flatten() {
        asked.push(format!("--scenario {}", s.name()));
    }
    for b in opts.backends.iter().flatten() {
        asked.push(format!("--backend {b}"));
    }
    if let Some(s) = opts.shard {
        asked.push(format!("--shard {}/{}", s.index, s.count));
    }
    let example = suite.checkpoints.first().and_then(|c| {
        let p = suite.prompts.iter().find(|p| c.prompts.contains(&p.name))?;
        let path = c.paths.first()?;
        Some(row_id(&c.name, &p.name, "single", "plain", path))
    });
    let list = |v: Vec<&str>| v.join(", ");
    format!(
        "{} selects no row of suite {}. Row ids are checkpoint/prompt/scenario:case/path{}, as every report prints them; \
         checkpoints: {}; prompts: {}",
        if asked.is_empty() { "the suite".to_string() } else { asked.join(" ") },
        suite.file.display(),
        example.map(|e| format!(" (e.g. {e})")).unwrap_or_default(),
        list(suite.checkpoints.iter().map(|c| c.name.as_str()).collect()),
        list(suite.prompts.iter().map(|p| p.name.as_str()).collect()),
    )
}
