//! The verdict vocabulary every row is judged in, whichever engine produced it.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    Identical,
    NearTie,
    Diverged,
    Error,
    Skipped,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Identical => "identical",
            Verdict::NearTie => "near-tie",
            Verdict::Diverged => "diverged",
            Verdict::Error => "error",
            Verdict::Skipped => "skipped",
        }
    }

    /// Severity for "worst of" aggregation: skipped < identical < near-tie < diverged < error.
    pub fn rank(self) -> u8 {
        match self {
            Verdict::Skipped => 0,
            Verdict::Identical => 1,
            Verdict::NearTie => 2,
            Verdict::Diverged => 3,
            Verdict::Error => 4,
        }
    }
}
