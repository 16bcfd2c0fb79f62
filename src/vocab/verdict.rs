//! The verdict vocabulary every row is judged in, whichever engine produced it.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Verdict {
    Identical,
    /// A lossy path (`corpus`): its next-token distributions are within the bounds the suite
    /// sets on their distance from the reference's. Not identical, and not meant to be.
    Within,
    NearTie,
    /// The tokens agree, but the path did not do what the case exists to test (a claim its
    /// evidence contradicts): not a pass unless the suite allows it.
    Vacuous,
    Diverged,
    Error,
    Skipped,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Identical => "identical",
            Verdict::Within => "within",
            Verdict::NearTie => "near-tie",
            Verdict::Vacuous => "vacuous",
            Verdict::Diverged => "diverged",
            Verdict::Error => "error",
            Verdict::Skipped => "skipped",
        }
    }

    /// Severity for "worst of" aggregation: skipped < identical < within < near-tie <
    /// vacuous < diverged < error.
    pub fn rank(self) -> u8 {
        match self {
            Verdict::Skipped => 0,
            Verdict::Identical => 1,
            Verdict::Within => 2,
            Verdict::NearTie => 3,
            Verdict::Vacuous => 4,
            Verdict::Diverged => 5,
            Verdict::Error => 6,
        }
    }
}
