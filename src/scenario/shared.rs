//! References and noise floors shared among the workers of one run (`parity run --jobs N`).
//!
//! Every worker judges its cells against the same references (each prompt's greedy run on the
//! reference path) and noise floors. Computed once, by whichever worker needs one first, and
//! read by the others, they cost the run one computation instead of one per worker. The
//! reference path is the same in every worker (one build, one checkpoint, one device), so a
//! reference read back is the one this worker would have computed, bit for bit: logits are
//! kept as float32 (exact for the float dtypes MLX computes logits in) with their dtype.
//!
//! A file per key, written whole and renamed into place, under a lock file per key: a worker
//! that needs what another is computing waits for it rather than computing it twice. Sharing
//! only saves time: a file that cannot be written or read back is computed here instead.

use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};

use mlx_rs::{Array, Dtype};
use serde::{Deserialize, Serialize};

use crate::error::Result;
use crate::names::stable_hash;
use crate::vocab::Trace;

/// One checkpoint's shared references and floors, in a directory the workers hold.
#[derive(Debug, Clone)]
pub struct Shared {
    dir: PathBuf,
}

/// What precedes a reference's logits in its file (one JSON line).
#[derive(Serialize, Deserialize)]
struct Header {
    ids: Vec<u32>,
    steps: usize,
    tokens: Vec<u32>,
    dtype: String,
    shape: Vec<i32>,
    rows: usize,
}

impl Shared {
    /// The shared store of `checkpoint` under `root` (the run's worker directory). The suite
    /// checked the name is one plain path component.
    pub fn new(root: &Path, checkpoint: &str) -> Self {
        Shared { dir: root.join("references").join(checkpoint) }
    }

    /// The reference of `ids` decoded `steps` tokens: read when a worker has stored it, else
    /// computed by `compute` (under the key's lock) and stored. `wait`: for a worker that is
    /// computing it; else `None` while one is.
    pub fn reference(
        &self,
        ids: &[u32],
        steps: usize,
        wait: bool,
        compute: impl FnOnce() -> Result<Trace>,
    ) -> Option<Result<Trace>> {
        let key = format!("ref-{}-{steps}-{:016x}", ids.len(), stable_hash(&le_bytes(ids)));
        let _lock = match self.lock(&key, wait) {
            Lock::Held(f) => f,
            Lock::Busy => return None,
            Lock::Unavailable => return Some(compute()),
        };
        let file = self.dir.join(&key);
        if let Some(t) = read_trace(&file, ids, steps) {
            return Some(Ok(t));
        }
        let trace = compute();
        if let Ok(t) = &trace {
            self.store(&file, |f| write_trace(f, ids, steps, t));
        }
        Some(trace)
    }

    /// The noise floor of the prompt named `prompt` (`ids`): read, or measured and stored.
    /// `wait` as for [`reference`](Self::reference).
    pub fn floor(
        &self,
        prompt: &str,
        ids: &[u32],
        wait: bool,
        measure: impl FnOnce() -> Option<f32>,
    ) -> Option<Option<f32>> {
        let mut keyed = prompt.as_bytes().to_vec();
        keyed.extend(le_bytes(ids));
        let key = format!("floor-{:016x}", stable_hash(&keyed));
        let _lock = match self.lock(&key, wait) {
            Lock::Held(f) => f,
            Lock::Busy => return None,
            Lock::Unavailable => return Some(measure()),
        };
        let file = self.dir.join(&key);
        if let Ok(text) = std::fs::read_to_string(&file) {
            match text.trim() {
                "none" => return Some(None),
                bits => {
                    if let Ok(b) = u32::from_str_radix(bits, 16) {
                        return Some(Some(f32::from_bits(b)));
                    }
                }
            }
        }
        let floor = measure();
        let text = floor.map_or("none".to_string(), |f| format!("{:08x}", f.to_bits()));
        self.store(&file, |f| f.write_all(text.as_bytes()));
        Some(floor)
    }

    /// The key's lock (held until the file is dropped), waiting for it or not.
    fn lock(&self, key: &str, wait: bool) -> Lock {
        let open = || -> std::io::Result<File> {
            std::fs::create_dir_all(&self.dir)?;
            OpenOptions::new().create(true).truncate(false).write(true).open(self.dir.join(format!("{key}.lock")))
        };
        let Ok(f) = open() else { return Lock::Unavailable };
        match if wait { f.lock().map_err(std::fs::TryLockError::Error) } else { f.try_lock() } {
            Ok(()) => Lock::Held(f),
            Err(std::fs::TryLockError::WouldBlock) => Lock::Busy,
            Err(std::fs::TryLockError::Error(_)) => Lock::Unavailable,
        }
    }

    /// Write `file` through a temporary name, so a reader never sees it half written.
    fn store(&self, file: &Path, write: impl FnOnce(&mut File) -> std::io::Result<()>) {
        let part = file.with_extension("part");
        let written = File::create(&part).and_then(|mut f| write(&mut f)).and_then(|_| std::fs::rename(&part, file));
        if written.is_err() {
            let _ = std::fs::remove_file(&part);
        }
    }
}

enum Lock {
    Held(File),
    /// Another worker holds it.
    Busy,
    /// No lock to be had here (a file system without locks): work unshared.
    Unavailable,
}

fn le_bytes(ids: &[u32]) -> Vec<u8> {
    ids.iter().flat_map(|i| i.to_le_bytes()).collect()
}

fn dtype_name(d: Dtype) -> Option<&'static str> {
    match d {
        Dtype::Float32 => Some("float32"),
        Dtype::Float16 => Some("float16"),
        Dtype::Bfloat16 => Some("bfloat16"),
        _ => None,
    }
}

fn write_trace(f: &mut File, ids: &[u32], steps: usize, t: &Trace) -> std::io::Result<()> {
    let invalid = |why: &str| std::io::Error::new(std::io::ErrorKind::InvalidInput, why.to_string());
    let first = t.logits.first();
    let dtype = first.map_or(Some("float32"), |a| dtype_name(a.dtype())).ok_or_else(|| invalid("logits dtype"))?;
    let shape = first.map(|a| a.shape().to_vec()).unwrap_or_default();
    let header = Header {
        ids: ids.to_vec(),
        steps,
        tokens: t.tokens.clone(),
        dtype: dtype.into(),
        shape: shape.clone(),
        rows: t.logits.len(),
    };
    let mut out = std::io::BufWriter::new(f);
    serde_json::to_writer(&mut out, &header).map_err(std::io::Error::other)?;
    out.write_all(b"\n")?;
    for row in &t.logits {
        if row.shape() != shape.as_slice() || dtype_name(row.dtype()) != Some(dtype) {
            return Err(invalid("logits rows of different shapes or dtypes"));
        }
        let row = row.as_dtype(Dtype::Float32).map_err(std::io::Error::other)?;
        row.eval().map_err(std::io::Error::other)?;
        for v in row.as_slice::<f32>() {
            out.write_all(&v.to_le_bytes())?;
        }
    }
    out.flush()
}

/// The trace stored in `file` for exactly `ids` and `steps`, if it is there whole.
fn read_trace(file: &Path, ids: &[u32], steps: usize) -> Option<Trace> {
    let mut r = BufReader::new(File::open(file).ok()?);
    let mut line = String::new();
    r.read_line(&mut line).ok()?;
    let h: Header = serde_json::from_str(&line).ok()?;
    if h.ids != ids || h.steps != steps {
        return None;
    }
    let dtype = match h.dtype.as_str() {
        "float32" => Dtype::Float32,
        "float16" => Dtype::Float16,
        "bfloat16" => Dtype::Bfloat16,
        _ => return None,
    };
    let len: usize = h.shape.iter().map(|&d| d as usize).product();
    let mut bytes = Vec::new();
    r.read_to_end(&mut bytes).ok()?;
    if h.rows == 0 {
        return bytes.is_empty().then(|| Trace { tokens: h.tokens, logits: Vec::new() });
    }
    if len == 0 || bytes.len() != len * 4 * h.rows {
        return None;
    }
    let mut logits = Vec::with_capacity(h.rows);
    for chunk in bytes.chunks_exact(len * 4) {
        let values: Vec<f32> = chunk.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        logits.push(Array::from_slice(&values, &h.shape).as_dtype(dtype).ok()?);
    }
    Some(Trace { tokens: h.tokens, logits })
}
