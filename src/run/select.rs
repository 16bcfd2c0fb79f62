//! What a run selects (`--filter`, `--scenario`, `--backend`): which rows and cells, refused
//! before any work when it names nothing the suite has, and said plainly when a run selected
//! no row (a run that selects nothing never passes: `git bisect run` relies on it).

use std::collections::BTreeMap;

use super::{Cell, Resolved, RunOptions, cell_row};
use crate::engine;
use crate::faults::Faults;
use crate::report::{Row, row_id};
use crate::scenario::{self, Setup};
use crate::vocab::{CheckpointSpec, Prompt, Suite, Verdict};

/// `--filter`: a row is selected when its id (`Row::id`) contains the text. Rows standing for
/// a whole unit of a prompt (case `*`: the checkpoint is absent, the prompt does not encode)
/// are selected by an id of any case of that unit.
#[derive(Clone, Copy)]
pub(crate) struct Filter<'a>(pub(crate) Option<&'a str>);

impl Filter<'_> {
    pub(crate) fn selects(&self, id: &str) -> bool {
        self.0.is_none_or(|f| id.contains(f))
    }

    pub(crate) fn selects_row(&self, row: &Row) -> bool {
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

/// Whether cell `c` of a stepped engine yields a row the filter selects. Scenarios name each
/// row (prompt, case) before they touch an engine, so running them against a stand-in that
/// records what is wanted and lets nothing run names exactly the rows a real run would make:
/// the plan and the run cannot disagree.
pub(super) fn cell_selected(
    r: &Resolved,
    c: &Cell,
    prompts: &BTreeMap<usize, std::result::Result<Prompt, String>>,
    all: &[Prompt],
    pad: u32,
) -> bool {
    let (spec, suite, filter) = (r.spec, r.suite, r.filter);
    let (ck, sc, path) = (spec.name.as_str(), c.scenario.name(), c.path.as_str());
    let failed_prompt = c.prompts.iter().any(|p| {
        prompts[p].is_err() && filter.selects_row(&cell_row(spec, c, &suite.prompts[*p].name, "*", Verdict::Error))
    });
    if failed_prompt {
        return true;
    }
    let mut stand_in = engine::Planning::new(r.config.vocab_size);
    let mut reference = engine::Planning::new(r.config.vocab_size);
    let found = std::cell::Cell::new(false);
    let mut setup = Setup::new(&mut reference, spec.settings.clone(), Faults::NONE, pad);
    // The pinned scripts name their rows too: without them a filter for one selects nothing.
    setup.scripts = suite.step_scripts();
    setup.select(Some(Box::new(|prompt: &str, case: &str| {
        if filter.selects(&row_id(ck, prompt, sc, case, path)) {
            found.set(true);
        }
        false
    })));
    let mine: Vec<Prompt> =
        all.iter().filter(|p| c.prompts.iter().any(|&i| suite.prompts[i].name == p.name)).cloned().collect();
    let _ = scenario::run(c.scenario, &mut setup, &mut stand_in, &mine);
    drop(setup);
    found.get()
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
    let names: Vec<&str> = suite.checkpoints.iter().map(|c| c.name.as_str()).collect();
    for c in opts.checkpoints.iter().flatten() {
        if !names.contains(&c.as_str()) {
            return Err(format!(
                "--checkpoint {c}: suite {} has no such checkpoint (it has {})",
                suite.file.display(),
                names.join(", ")
            ));
        }
    }
    let paths = has(&|c| c.paths.clone());
    for b in opts.paths.iter().flatten() {
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

/// Whether the options name a selection (`--filter`, `--scenario`, `--backend`, `--checkpoint`).
pub fn selects_part(opts: &RunOptions) -> bool {
    opts.filter.is_some() || opts.scenarios.is_some() || opts.paths.is_some() || opts.checkpoints.is_some()
}

/// A selection whose every row was skipped tested nothing: like one that matches no row, it
/// must never read as good (a bisect step on a commit whose checkpoint is absent, or a row id
/// whose case this prompt cannot make). `None` when some selected row was judged.
pub fn nothing_tested(suite: &Suite, opts: &RunOptions, rows: &[Row]) -> Option<String> {
    if !selects_part(opts) || rows.is_empty() || rows.iter().any(|r| r.verdict != Verdict::Skipped) {
        return None;
    }
    // A skip's reason is its row's last note (after what the case did, where it did anything).
    let why = rows.iter().find_map(|r| r.notes.last()).map(|n| n.lines().next().unwrap_or_default().to_string());
    Some(format!(
        "the selection of {} in suite {} is {}, every one skipped: nothing was tested{}",
        opts.filter.as_deref().map_or_else(|| "its options".to_string(), |f| format!("--filter {f}")),
        suite.file.display(),
        crate::report::describe::plural(rows.len(), "row"),
        why.map(|w| format!(" ({w})")).unwrap_or_default(),
    ))
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
    for b in opts.paths.iter().flatten() {
        asked.push(format!("--backend {b}"));
    }
    for c in opts.checkpoints.iter().flatten() {
        asked.push(format!("--checkpoint {c}"));
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
         checkpoints: {}; prompts: {} (the prefix scenario's second request of PROMPT is PROMPT/sharedN, N the rows it \
         shares)",
        if asked.is_empty() { "the suite".to_string() } else { asked.join(" ") },
        suite.file.display(),
        example.map(|e| format!(" (e.g. {e})")).unwrap_or_default(),
        list(suite.checkpoints.iter().map(|c| c.name.as_str()).collect()),
        list(suite.prompts.iter().map(|p| p.name.as_str()).collect()),
    )
}
