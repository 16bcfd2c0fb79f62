//! Library errors. Every variant that comes from user input names the file and the field, so
//! that a suite run can report it on the row and keep going.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The first line is a complete sentence with the fix (reports show only it); the places
    /// searched follow.
    #[error("checkpoint `{reference}` not found locally; {hint}\nlooked in:\n{}", searched_list(.searched))]
    CheckpointNotFound { reference: String, searched: Vec<PathBuf>, hint: String },

    #[error("{file}: {message}")]
    Config { file: PathBuf, message: String },

    #[error("{file}: tensor `{tensor}`: {message}")]
    Tensor { file: PathBuf, tensor: String, message: String },

    #[error("{file}: {message}")]
    Weights { file: PathBuf, message: String },

    /// Every problem the loaders found in one pass; the first line is a complete sentence
    /// (reports show only it), one line per problem follows.
    #[error("{} with the tensors config.json describes (first: {})\n{}", count(problems.len()), first(problems), problem_list(problems))]
    Checkpoint { dir: PathBuf, problems: Vec<TensorProblem> },

    #[error("{file}: {message}")]
    Tokenizer { file: PathBuf, message: String },

    #[error("io error on {file}: {source}")]
    Io {
        file: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error(
        "a sequence of {held} tokens plus {adding} new ones exceeds the context of {context} (max_position_embeddings in config.json)"
    )]
    ContextOverflow { held: usize, adding: usize, context: usize },

    #[error(
        "KV pool exhausted: sequence needs {needed} more block(s) of {block_size} rows, {free} free of a budget of {budget}"
    )]
    PoolExhausted { needed: usize, free: usize, budget: usize, block_size: usize },

    #[error("KV cache: {0}")]
    Kv(String),

    /// NaN or inf where only the checkpoint or the runtime can have put it (see
    /// `compare::first_non_finite`).
    #[error("{what} are not finite at step {step}: the checkpoint or the runtime produces NaN/inf")]
    NonFinite { what: &'static str, step: usize },

    /// The pool's books do not balance (a leak or a refcount mismatch), with the block ids.
    #[error("KV pool books: {0}")]
    Books(String),

    #[error("mlx: {0}")]
    Mlx(String),

    #[error(
        "MLX device `{0}` is not available in this build (the GPU needs Metal on Apple Silicon); use --device cpu or auto"
    )]
    DeviceUnavailable(&'static str),

    #[error("{0}")]
    Invalid(String),

    /// The path cannot do what a case needs (no left padding, no prefix sharing, a batch too
    /// large): the case is skipped with this sentence, never failed and never silently passed.
    #[error("{0}")]
    Unsupported(String),

    /// An engine outside parity (an adapter process) failed: what it was asked, what went
    /// wrong, and the tail of its stderr.
    #[error("engine {engine}, path `{path}`: {message}")]
    Engine { engine: String, path: String, message: String },
}

fn count(n: usize) -> String {
    if n == 1 { "1 problem".into() } else { format!("{n} problems") }
}

fn first(p: &[TensorProblem]) -> String {
    p.first().map(ToString::to_string).unwrap_or_default()
}

fn problem_list(p: &[TensorProblem]) -> String {
    p.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n")
}

fn searched_list(p: &[PathBuf]) -> String {
    p.iter().map(|p| format!("  - {}", p.display())).collect::<Vec<_>>().join("\n")
}

impl From<mlx_rs::error::Exception> for Error {
    fn from(e: mlx_rs::error::Exception) -> Self {
        Error::Mlx(e.what().to_string())
    }
}

impl Error {
    pub fn config(file: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::Config { file: file.into(), message: message.into() }
    }
    pub fn io(file: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { file: file.into(), source }
    }
}

/// One thing wrong with a checkpoint's tensors, by tensor name.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorProblem {
    pub tensor: String,
    /// The file holding the tensor, when it exists.
    pub file: Option<PathBuf>,
    pub message: String,
}

impl std::fmt::Display for TensorProblem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "tensor `{}`: {}", self.tensor, self.message)?;
        // The file name only: the directory is the checkpoint's, said once by the caller.
        if let Some(name) = self.file.as_ref().and_then(|p| p.file_name()) {
            write!(f, " (in {})", name.to_string_lossy())?;
        }
        Ok(())
    }
}
