//! Checkpoints: where they are (a local directory or a Hugging Face repo id resolved offline in
//! the local HF cache), what they say (config.json) and what they hold (safetensors, tokenizer).

pub mod config;
mod fixture;
pub mod tokenizer;
pub mod weights;

use std::path::{Path, PathBuf};

pub use config::{Arch, ModelConfig, QuantSpec, Quantization, RopeScaling};
pub use tokenizer::Tokenizer;
pub use weights::WeightStore;

use crate::error::{Error, Result};

/// Where the Hugging Face cache is: `HF_HUB_CACHE`, else `HF_HOME/hub`, else
/// `~/.cache/huggingface/hub` (the same order as `huggingface_hub`).
pub fn hf_cache_dir() -> Option<PathBuf> {
    hf_cache_dir_from(|name| std::env::var_os(name))
}

/// [`hf_cache_dir`] over any environment (tests pass their own).
pub fn hf_cache_dir_from(env: impl Fn(&str) -> Option<std::ffi::OsString>) -> Option<PathBuf> {
    let var = |name: &str| env(name).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(p) = var("HF_HUB_CACHE") {
        return Some(p);
    }
    if let Some(p) = var("HF_HOME") {
        return Some(p.join("hub"));
    }
    Some(var("HOME")?.join(".cache").join("huggingface").join("hub"))
}

fn looks_like_repo_id(reference: &str) -> bool {
    let parts: Vec<&str> = reference.split('/').collect();
    parts.len() == 2
        && parts.iter().all(|p| {
            !p.is_empty()
                && p != &"."
                && p != &".."
                && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        })
}

/// Resolve a checkpoint reference to a directory without touching the network.
///
/// `base` is the directory relative paths are resolved against (a suite file's directory, or
/// the current directory on the command line). A reference ending in `.toml` is a fixture
/// spec: the tiny checkpoint it describes is generated on first use (see [`fixture`]).
pub fn resolve(reference: &str, base: &Path) -> Result<PathBuf> {
    resolve_in(reference, base, hf_cache_dir())
}

/// [`resolve`] with an explicit Hugging Face cache directory.
pub fn resolve_in(reference: &str, base: &Path, hf_cache: Option<PathBuf>) -> Result<PathBuf> {
    let expanded = expand_home(reference);
    let local = if expanded.is_absolute() { expanded.clone() } else { base.join(&expanded) };
    if reference.ends_with(".toml") {
        if local.is_file() {
            return fixture::materialize(&local);
        }
        return Err(Error::CheckpointNotFound {
            reference: reference.to_string(),
            searched: vec![local],
            hint: "a `.toml` checkpoint is a fixture spec (see fixtures/)".into(),
        });
    }
    let mut searched = vec![local.clone()];
    if local.join("config.json").is_file() {
        return Ok(local);
    }
    if local.is_dir() {
        return Err(Error::config(local.join("config.json"), "missing: a checkpoint directory needs config.json"));
    }
    if looks_like_repo_id(reference) {
        if let Some(cache) = hf_cache {
            let repo = cache.join(format!("models--{}", reference.replace('/', "--")));
            searched.push(repo.clone());
            if let Some(snapshot) = hf_snapshot(&repo) {
                return Ok(snapshot);
            }
        }
        return Err(Error::CheckpointNotFound {
            reference: reference.to_string(),
            searched,
            hint: format!(
                "fetch it with `huggingface-cli download {reference}` where there is network (parity never \
                 downloads), or point HF_HUB_CACHE / HF_HOME at a cache that has it"
            ),
        });
    }
    Err(Error::CheckpointNotFound {
        reference: reference.to_string(),
        searched,
        hint: "a checkpoint is a directory with config.json, *.safetensors and tokenizer.json, or a Hugging Face repo id (ORG/NAME) in the local cache".into(),
    })
}

/// `refs/main` names the snapshot; without it, the most recently modified snapshot that has a
/// config.json.
fn hf_snapshot(repo: &Path) -> Option<PathBuf> {
    let snapshots = repo.join("snapshots");
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs").join("main")) {
        let dir = snapshots.join(rev.trim());
        if dir.join("config.json").is_file() {
            return Some(dir);
        }
    }
    let mut candidates: Vec<(std::time::SystemTime, PathBuf)> = std::fs::read_dir(&snapshots)
        .ok()?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.join("config.json").is_file())
        .map(|p| (p.metadata().and_then(|m| m.modified()).unwrap_or(std::time::UNIX_EPOCH), p))
        .collect();
    candidates.sort();
    candidates.pop().map(|(_, p)| p)
}

fn expand_home(reference: &str) -> PathBuf {
    if let Some(rest) = reference.strip_prefix("~/")
        && let Some(home) = std::env::var_os("HOME")
    {
        return PathBuf::from(home).join(rest);
    }
    PathBuf::from(reference)
}
