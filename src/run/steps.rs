//! A checkpoint on a stepped engine (kind = "builtin" or "process"): parity's own load of the
//! weights when a builtin path or reference needs it, the reference path and every path a cell
//! needs opened once, then each cell's step-level scenario run against the references and
//! judged. References and noise floors are computed when a selected row first needs them, so
//! a narrow `--filter` (bisect) pays for its own rows only.

use std::collections::BTreeMap;
use std::time::Instant;

use super::judge::{self, Judge};
use super::select::cell_selected;
use super::{
    Cell, Progress, Resolved, RunOptions, blanket_rows, cell_row, each_cell, encode_all, encoded_ids, unencoded_rows,
};
use crate::engine::{Dirs, Engine, EnginePath};
use crate::report::{CheckpointReport, CheckpointStatus, Phase, Row, row_id};
use crate::scenario::explore::{self, Budget};
use crate::scenario::{self, CaseOutput, Outcome, Selector, Setup};
use crate::vocab::{BuiltinRef, EngineSpec, Prompt, Scenario, Verdict};

pub(super) fn run(
    r: &Resolved,
    cells: &[Cell],
    opts: &RunOptions,
    progress: &dyn Progress,
    report: &mut CheckpointReport,
) -> Vec<Row> {
    let (suite, spec, config) = (r.suite, r.spec, &r.config);
    // The engine's vocabulary is checked once it says what it is (below).
    let mut prompts = encode_all(r, cells, config.vocab_size);
    report.prompt_ids = encoded_ids(&prompts);
    let pad = config.pad_token_id.or_else(|| config.eos_token_ids.first().copied()).unwrap_or(0);
    let all: Vec<Prompt> = prompts.values().filter_map(|p| p.as_ref().ok().cloned()).collect();
    // Under a filter, only the cells with a selected row load or start anything. Explore's
    // rows are not known before it runs: its cell is selected by its path.
    let cells: Vec<&Cell> = match opts.filter {
        None => cells.iter().collect(),
        Some(_) => cells
            .iter()
            .filter(|c| match c.scenario {
                Scenario::Explore => r.filter.selects_row(&cell_row(spec, c, "*", "*", Verdict::Identical)),
                _ => cell_selected(r, c, &prompts, &all, pad),
            })
            .collect(),
    };
    if cells.is_empty() {
        return Vec::new();
    }

    let error = |report: &mut CheckpointReport, why: String| {
        report.status = CheckpointStatus::Error;
        report.reason = Some(why.clone());
        blanket_rows(suite, spec, cells.iter().copied(), opts, r.filter, Verdict::Error, &why)
    };
    let suite_dir = suite.dir();
    let engine = match Engine::load(spec, Dirs { checkpoint: &r.dir, suite_dir: &suite_dir }, config) {
        Ok(e) => e,
        Err(e) => return error(report, e.to_string()),
    };
    report.phases.push(Phase { name: "load".into(), seconds: r.loading.elapsed().as_secs_f64() });

    // The reference path first (nothing can be judged without it), then every path a cell
    // needs. A path that cannot start fails its own rows only.
    let t = Instant::now();
    let mut reference = match engine.open(None) {
        Ok(p) => p,
        Err(e) => return error(report, format!("reference path {}: {e}", spec.engine.reference().describe())),
    };
    let mut paths: BTreeMap<String, std::result::Result<Box<dyn EnginePath + '_>, String>> = BTreeMap::new();
    for c in &cells {
        if !paths.contains_key(&c.path) {
            paths.insert(c.path.clone(), engine.open(Some(&c.path)).map_err(|e| e.to_string()));
        }
    }
    // Starting a child (an adapter, or a reference pinned to another device) is a phase of
    // its own; the in-process builtin starts nothing.
    if !matches!(spec.engine, EngineSpec::Builtin { reference: BuiltinRef { device: None, .. } }) {
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
    let mut setup = Setup::new(reference.as_mut(), spec.settings.clone(), opts.faults, pad);
    setup.scripts = suite.step_scripts();
    if let Some(dir) = &opts.shared {
        setup.share(scenario::shared::Shared::new(dir, &spec.name));
        // Every row needs its prompt's reference and noise floor: the workers split them
        // first. (A narrow --filter needs few: those come when asked for.)
        if opts.filter.is_none() {
            setup.prefetch(&all);
            for (name, t) in [("reference", setup.reference_time()), ("noise-floor", setup.floor_time())] {
                if !t.is_zero() {
                    report.phases.push(Phase { name: name.into(), seconds: t.as_secs_f64() });
                }
            }
        }
    }
    let rows = each_cell(cells.iter().copied(), opts, r.filter, progress, &mut report.phases, |cell, phases| {
        let mut rows = unencoded_rows(r, cell, &prompts);
        let (reference_before, floor_before) = (setup.reference_time(), setup.floor_time());
        let good: Vec<Prompt> = cell.prompts.iter().filter_map(|p| prompts[p].as_ref().ok().cloned()).collect();
        if good.is_empty() {
            return rows;
        }
        let (ck, sc, path_name, filter) = (spec.name.as_str(), cell.scenario.name(), cell.path.clone(), r.filter);
        let select: Option<Selector> = opts.filter.as_ref().map(|_| {
            Box::new(move |prompt: &str, case: &str| filter.selects(&row_id(ck, prompt, sc, case, &path_name)))
                as Selector
        });
        setup.select(select);
        let judge = Judge { spec, cell, tokenizer: &r.tokenizer };
        match paths.get_mut(&cell.path) {
            Some(Ok(path)) if cell.scenario == Scenario::Explore => {
                let budget = opts.explore.clone().unwrap_or_default();
                rows.extend(explore(&mut setup, path.as_mut(), &good, &budget, &judge, config.max_position_embeddings));
            }
            Some(Ok(path)) => {
                let info = path.info().clone();
                for c in scenario::run(cell.scenario, &mut setup, path.as_mut(), &good) {
                    // A repeat is compared with the path's own first run, not the reference:
                    // the reference's noise floor says nothing of it.
                    let floor = match cell.scenario {
                        Scenario::Repeat => None,
                        _ => setup.noise_floor(&c.prompt.name, &all),
                    };
                    rows.push(judge.steps(&c, floor, &info));
                }
            }
            Some(Err(why)) => {
                let why = format!("path {} did not start: {why}", cell.path);
                for c in CaseOutput::for_every_prompt(&good, Outcome::NotRun(why)) {
                    rows.push(judge.steps(&c, None, &reference_info));
                }
            }
            None => {}
        }
        setup.select(None);
        // References and noise floors are computed when a cell first needs them and reused by
        // the later ones: their costs are phases of their own, so a cell's time is what its
        // path took.
        let reference = setup.reference_time() - reference_before;
        if !reference.is_zero() {
            phases.push(Phase { name: "reference".into(), seconds: reference.as_secs_f64() });
        }
        let floor = setup.floor_time() - floor_before;
        if !floor.is_zero() {
            phases.push(Phase { name: "noise-floor".into(), seconds: floor.as_secs_f64() });
        }
        rows
    });
    report.noise_floor = setup.noise_floors().clone();
    rows
}

/// Explore one path within `budget`: a row per distinct failure, shrunk, with its reproducer;
/// or one passing row with what was explored.
fn explore(
    setup: &mut Setup,
    path: &mut dyn EnginePath,
    prompts: &[Prompt],
    budget: &Budget,
    judge: &Judge,
    context: usize,
) -> Vec<Row> {
    let info = path.info().clone();
    let label = [judge.spec.name.as_str(), info.name.as_str()];
    let mut fails = |c: &CaseOutput| judge::signature(&judge.steps(c, None, &info));
    let explored = explore::explore(setup, path, prompts, budget, context, &label, &mut fails);
    if explored.findings.is_empty() {
        return vec![judge.explored_clean(budget.seed, explored.summary)];
    }
    explored
        .findings
        .iter()
        .map(|f| {
            let floor = setup.noise_floor(&f.case.prompt.name, prompts);
            let mut row = judge.steps(&f.case, floor, &info);
            row.notes.extend(f.notes.iter().cloned());
            row
        })
        .collect()
}
