//! safetensors loading: one `model.safetensors` or shards listed by
//! `model.safetensors.index.json`. Headers and offsets are validated by the `safetensors` crate
//! before any tensor reaches MLX, so a truncated file is an error naming that file, never a
//! crash inside MLX.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use mlx_rs::{Array, Dtype};
use safetensors::SafeTensors;

use crate::error::{Error, Result};

/// Every tensor of a checkpoint, by name, with the file it came from (for error messages).
pub struct WeightStore {
    tensors: HashMap<String, (Array, PathBuf)>,
    pub files: Vec<PathBuf>,
    pub stored_bytes: u64,
}

/// The on-disk dtype of the float tensors (norms, scales, unquantized weights), for `inspect`.
pub fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::Float32 => "float32",
        Dtype::Float16 => "float16",
        Dtype::Bfloat16 => "bfloat16",
        Dtype::Uint32 => "uint32",
        Dtype::Int32 => "int32",
        Dtype::Uint8 => "uint8",
        Dtype::Int8 => "int8",
        Dtype::Bool => "bool",
        _ => "other",
    }
}

impl WeightStore {
    pub fn load(dir: &Path) -> Result<Self> {
        let files = shard_files(dir)?;
        let mut store = WeightStore { tensors: HashMap::new(), files: files.clone(), stored_bytes: 0 };
        for file in &files {
            store.load_file(file)?;
        }
        Ok(store)
    }

    fn load_file(&mut self, file: &Path) -> Result<()> {
        let bytes = std::fs::read(file).map_err(|e| Error::io(file, e))?;
        self.stored_bytes += bytes.len() as u64;
        let st = SafeTensors::deserialize(&bytes).map_err(|e| Error::Weights {
            file: file.to_path_buf(),
            message: format!("not a valid safetensors file (truncated or corrupt?): {e}"),
        })?;
        for (name, view) in st.tensors() {
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => Dtype::Float32,
                safetensors::Dtype::F16 => Dtype::Float16,
                safetensors::Dtype::BF16 => Dtype::Bfloat16,
                safetensors::Dtype::U32 => Dtype::Uint32,
                safetensors::Dtype::I32 => Dtype::Int32,
                safetensors::Dtype::U8 => Dtype::Uint8,
                safetensors::Dtype::I8 => Dtype::Int8,
                other => {
                    return Err(Error::Tensor {
                        file: file.to_path_buf(),
                        tensor: name,
                        message: format!("unsupported dtype {other:?}"),
                    });
                }
            };
            let shape: Vec<i32> =
                view.shape().iter().map(|&d| i32::try_from(d)).collect::<std::result::Result<_, _>>().map_err(
                    |_| Error::Tensor {
                        file: file.to_path_buf(),
                        tensor: name.clone(),
                        message: "dimension too large".into(),
                    },
                )?;
            let data = view.data();
            // SAFETY: the safetensors crate checked that `data` holds exactly
            // product(shape) * size_of(dtype) bytes; MLX copies them.
            let array = if data.is_empty() {
                mlx_rs::ops::zeros_dtype(&shape, dtype)?
            } else {
                unsafe { Array::from_raw_data(data.as_ptr().cast(), &shape, dtype) }
            };
            if let Some((_, other)) = self.tensors.insert(name.clone(), (array, file.to_path_buf())) {
                return Err(Error::Tensor {
                    file: file.to_path_buf(),
                    tensor: name,
                    message: format!("also present in {}", other.display()),
                });
            }
        }
        Ok(())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    /// Remove and return tensor `name`, checking dtype class and shape.
    pub fn take(&mut self, name: &str, expect: Expect) -> Result<Array> {
        let (array, file) = self.tensors.remove(name).ok_or_else(|| Error::Tensor {
            file: self.files.first().cloned().unwrap_or_default(),
            tensor: name.to_string(),
            message: format!(
                "missing from {} (expected shape {:?})",
                self.files.iter().map(|f| f.display().to_string()).collect::<Vec<_>>().join(", "),
                expect.shape
            ),
        })?;
        if array.shape() != expect.shape.as_slice() {
            return Err(Error::Tensor {
                file,
                tensor: name.to_string(),
                message: format!("shape {:?}, expected {:?} from config.json", array.shape(), expect.shape),
            });
        }
        let dtype = array.dtype();
        let ok = match expect.kind {
            Kind::Float => matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16),
            Kind::Packed => dtype == Dtype::Uint32,
        };
        if !ok {
            return Err(Error::Tensor {
                file,
                tensor: name.to_string(),
                message: format!("dtype {}, expected {}", dtype_name(dtype), expect.kind.describe()),
            });
        }
        Ok(array)
    }

    /// The dtype of tensor `name` if present (without removing it).
    pub fn dtype_of(&self, name: &str) -> Option<Dtype> {
        self.tensors.get(name).map(|(a, _)| a.dtype())
    }

    /// Tensors no module asked for, minus ones every converter leaves behind harmlessly.
    pub fn leftovers(&self) -> Vec<String> {
        let mut v: Vec<String> = self.tensors.keys().filter(|n| !n.ends_with("rotary_emb.inv_freq")).cloned().collect();
        v.sort();
        v
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Float,
    Packed,
}

impl Kind {
    fn describe(self) -> &'static str {
        match self {
            Kind::Float => "a float dtype (float32, float16, bfloat16)",
            Kind::Packed => "uint32 (MLX packed quantized weights)",
        }
    }
}

pub struct Expect {
    pub shape: Vec<i32>,
    pub kind: Kind,
}

impl Expect {
    pub fn float(shape: &[usize]) -> Self {
        Expect { shape: shape.iter().map(|&d| d as i32).collect(), kind: Kind::Float }
    }
    pub fn packed(shape: &[usize]) -> Self {
        Expect { shape: shape.iter().map(|&d| d as i32).collect(), kind: Kind::Packed }
    }
}

/// The safetensors files of a checkpoint directory, in a stable order.
pub fn shard_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    let single = dir.join("model.safetensors");
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io(&index, e))?;
        let value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| Error::Weights { file: index.clone(), message: format!("not valid JSON: {e}") })?;
        let map = value.get("weight_map").and_then(|m| m.as_object()).ok_or_else(|| Error::Weights {
            file: index.clone(),
            message: "field `weight_map`: missing or not an object".into(),
        })?;
        let mut files = BTreeMap::new();
        for (tensor, f) in map {
            let name = f.as_str().ok_or_else(|| Error::Weights {
                file: index.clone(),
                message: format!("field `weight_map.{tensor}`: expected a file name"),
            })?;
            files.insert(name.to_string(), ());
        }
        let mut out = Vec::new();
        for name in files.keys() {
            let path = dir.join(name);
            if !path.is_file() {
                return Err(Error::Weights {
                    file: index.clone(),
                    message: format!("lists shard `{name}`, which does not exist at {}", path.display()),
                });
            }
            out.push(path);
        }
        if out.is_empty() {
            return Err(Error::Weights { file: index, message: "field `weight_map` is empty".into() });
        }
        Ok(out)
    } else if single.is_file() {
        Ok(vec![single])
    } else {
        Err(Error::Weights {
            file: dir.to_path_buf(),
            message: "no model.safetensors or model.safetensors.index.json in this directory".into(),
        })
    }
}

impl WeightStore {
    /// Element count of a tensor and whether it is packed (uint32).
    pub fn numel_and_packed(&self, name: &str) -> (u64, bool) {
        match self.tensors.get(name) {
            Some((a, _)) => (a.size() as u64, a.dtype() == Dtype::Uint32),
            None => (0, false),
        }
    }
}
