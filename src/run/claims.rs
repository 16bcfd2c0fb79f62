//! Cells shared out among the worker processes of one run (`parity run --jobs N`).
//!
//! Every worker plans the same cells in the same order (the same suite and selection) and,
//! before it runs one, claims it through a counter in a file they all hold, read and bumped
//! under an exclusive lock: a cell goes to whichever worker asks for it first. So the cells
//! spread by how long each actually takes (a padded cell runs several times as long as a
//! single one), not by a guess made before the run, and each runs exactly once.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// The counter file: the index of the first cell no worker has taken (every cell before it
/// is taken, or skipped by every worker alike). Empty means 0.
#[derive(Debug, Clone)]
pub struct Claims {
    file: PathBuf,
    /// The first I/O error met: the worker then claims nothing more and must fail its run
    /// (its unclaimed cells would otherwise go missing from a report that says it passed).
    failed: Arc<Mutex<Option<String>>>,
}

impl Claims {
    /// Claims shared through `file` (created empty by whoever starts the workers).
    pub fn new(file: &Path) -> Self {
        Claims { file: file.to_path_buf(), failed: Arc::new(Mutex::new(None)) }
    }

    /// Whether this worker runs cell `index`: it does when no worker has taken it (nor any
    /// cell after it). Workers ask in increasing order of index.
    pub fn take(&self, index: usize) -> bool {
        if self.failure().is_some() {
            return false;
        }
        match self.bump(|next| (next <= index).then_some(index + 1)) {
            Ok((_, taken)) => taken,
            Err(e) => {
                let why = format!("cell claims in {}: {e}", self.file.display());
                if let Ok(mut f) = self.failed.lock() {
                    f.get_or_insert(why);
                }
                false
            }
        }
    }

    /// Whether any cell with an index of `last` or less is still free: a worker that finds none
    /// free in a checkpoint's cells need not load its model.
    pub fn any_free_through(&self, last: usize) -> bool {
        self.failure().is_none() && self.bump(|_| None).is_ok_and(|(next, _)| next <= last)
    }

    /// The I/O error that stopped this worker claiming, if one did.
    pub fn failure(&self) -> Option<String> {
        self.failed.lock().ok().and_then(|f| f.clone())
    }

    /// Under the lock: read the counter and write back what `update` makes of it (`None`:
    /// leave it). Returns the counter read and whether it was written.
    fn bump(&self, update: impl Fn(usize) -> Option<usize>) -> std::io::Result<(usize, bool)> {
        let mut f = OpenOptions::new().read(true).write(true).open(&self.file)?;
        f.lock()?;
        let next = read_counter(&mut f)?;
        let Some(n) = update(next) else { return Ok((next, false)) };
        f.seek(SeekFrom::Start(0))?;
        f.set_len(0)?;
        f.write_all(n.to_string().as_bytes())?;
        // Dropping the file unlocks it.
        Ok((next, true))
    }
}

fn read_counter(f: &mut File) -> std::io::Result<usize> {
    let mut text = String::new();
    f.read_to_string(&mut text)?;
    let text = text.trim();
    if text.is_empty() {
        return Ok(0);
    }
    text.parse()
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("not a cell index: `{text}`")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two workers asking for the same cells in the same order must split them, every cell to
    /// exactly one: a cell run twice would put its rows in the merged report twice, one run
    /// by nobody would leave them out.
    #[test]
    fn workers_asking_in_turn_take_every_cell_once() {
        let dir = std::env::temp_dir().join(format!("parity-claims-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("claims");
        std::fs::write(&file, "").unwrap();
        let (a, b) = (Claims::new(&file), Claims::new(&file));
        let mut taken = Vec::new();
        // Worker a is quick on cells 0..3, worker b reaches cell 2 late; then they alternate.
        for i in 0..3 {
            taken.push((i, a.take(i)));
        }
        assert!(!b.take(0) && !b.take(1) && !b.take(2), "cells a took are not b's");
        assert!(b.any_free_through(3) && !b.any_free_through(2));
        for i in 3..8 {
            let first = if i % 2 == 0 { &a } else { &b };
            let second = if i % 2 == 0 { &b } else { &a };
            assert!(first.take(i), "cell {i} is free");
            assert!(!second.take(i), "cell {i} is taken once");
        }
        assert!(taken.iter().all(|&(_, t)| t));
        // A cell every worker skipped (a filter) leaves no hole: the next one asked is free.
        assert!(a.take(10) && !b.take(9) && !b.take(10) && b.take(11));
        assert_eq!((a.failure(), b.failure()), (None, None));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_unreadable_counter_stops_claiming_and_says_why() {
        let missing = std::env::temp_dir().join(format!("parity-claims-missing-{}/claims", std::process::id()));
        let c = Claims::new(&missing);
        assert!(!c.take(0));
        assert!(c.failure().is_some_and(|why| why.contains("claims")), "{:?}", c.failure());
        assert!(!c.take(1), "a failed worker claims nothing more");
    }
}
