//! The dtype parity computes in: an explicit, recorded setting (float32 by default, because
//! bfloat16 is 7-20x slower on MLX's CPU backend).

use mlx_rs::Dtype;
use serde::Serialize;

/// A dtype parity can compute in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DtypeName {
    Float32,
    Float16,
    Bfloat16,
}

impl DtypeName {
    pub fn mlx(self) -> Dtype {
        match self {
            DtypeName::Float32 => Dtype::Float32,
            DtypeName::Float16 => Dtype::Float16,
            DtypeName::Bfloat16 => Dtype::Bfloat16,
        }
    }
    pub fn bytes(self) -> usize {
        match self {
            DtypeName::Float32 => 4,
            _ => 2,
        }
    }
    pub fn from_mlx(d: Dtype) -> Option<Self> {
        match d {
            Dtype::Float32 => Some(DtypeName::Float32),
            Dtype::Float16 => Some(DtypeName::Float16),
            Dtype::Bfloat16 => Some(DtypeName::Bfloat16),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            DtypeName::Float32 => "float32",
            DtypeName::Float16 => "float16",
            DtypeName::Bfloat16 => "bfloat16",
        }
    }
}

/// The `--dtype` / suite `dtype` setting: a dtype, or `native` (whatever the checkpoint
/// stores its float tensors in).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DtypeSetting {
    Float32,
    Float16,
    Bfloat16,
    Native,
}

impl DtypeSetting {
    /// The spelling `FromStr` reads back: what a child process is handed.
    pub fn name(self) -> &'static str {
        self.resolve().map_or("native", DtypeName::name)
    }

    pub fn resolve(self) -> Option<DtypeName> {
        match self {
            DtypeSetting::Float32 => Some(DtypeName::Float32),
            DtypeSetting::Float16 => Some(DtypeName::Float16),
            DtypeSetting::Bfloat16 => Some(DtypeName::Bfloat16),
            DtypeSetting::Native => None,
        }
    }
}

impl std::str::FromStr for DtypeSetting {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "float32" | "f32" => Ok(DtypeSetting::Float32),
            "float16" | "f16" => Ok(DtypeSetting::Float16),
            "bfloat16" | "bf16" => Ok(DtypeSetting::Bfloat16),
            "native" => Ok(DtypeSetting::Native),
            other => Err(format!("unknown dtype `{other}`; expected float32, float16, bfloat16 or native")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `locate` hands its children `--dtype NAME`: a name that did not parse back to the same
    /// setting would run one side in another dtype than asked.
    #[test]
    fn every_setting_name_parses_back_to_itself() {
        for s in [DtypeSetting::Float32, DtypeSetting::Float16, DtypeSetting::Bfloat16, DtypeSetting::Native] {
            assert_eq!(s.name().parse::<DtypeSetting>(), Ok(s));
        }
    }
}
