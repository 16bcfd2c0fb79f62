//! safetensors loading: one `model.safetensors` or shards listed by
//! `model.safetensors.index.json`. Headers and offsets are validated by the `safetensors` crate
//! and [`parse_header`] before any tensor reaches MLX, so a truncated file is an error naming
//! that file, never a crash inside MLX.
//!
//! Validation against the config happens in one place, [`WeightStore::take`]: the model's
//! loaders say which tensor they need with which shape and dtype ([`Expect`], with quantized
//! layouts from [`packed_layout`]); a tensor that is missing or wrong is recorded as a
//! [`TensorProblem`] and loading carries on with a placeholder, so one pass lists every problem.
//! `generate`, `run`, `bench` (through `Model::load`) and `inspect` all go through it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use mlx_rs::{Array, Dtype};
use safetensors::SafeTensors;

use super::QuantSpec;
use crate::error::{Error, Result, TensorProblem};

/// Every tensor of a checkpoint, by name, with the file it came from (for error messages).
pub struct WeightStore {
    tensors: HashMap<String, (Array, PathBuf)>,
    pub files: Vec<PathBuf>,
    pub stored_bytes: u64,
    problems: Vec<TensorProblem>,
}

/// A tensor as a safetensors header describes it, checked: a dtype MLX can hold and a shape
/// MLX can index (int32 dimensions).
#[derive(Debug, Clone, PartialEq)]
pub struct TensorHeader {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<i32>,
}

/// Parse and check a safetensors file's header and offsets: everything about `bytes` that must
/// hold before MLX copies a tensor out of them. Untrusted input (fuzzed: `fuzz/`).
pub fn parse_header<'a>(file: &Path, bytes: &'a [u8]) -> Result<(SafeTensors<'a>, Vec<TensorHeader>)> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| Error::Weights {
        file: file.to_path_buf(),
        message: format!("not a valid safetensors file (truncated or corrupt?): {e}"),
    })?;
    let mut out = Vec::new();
    let mut names: Vec<String> = st.names().into_iter().map(String::from).collect();
    names.sort();
    for name in names {
        let view = st.tensor(&name).map_err(|e| Error::Tensor {
            file: file.to_path_buf(),
            tensor: name.clone(),
            message: format!("unreadable: {e}"),
        })?;
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
            view.shape().iter().map(|&d| i32::try_from(d)).collect::<std::result::Result<_, _>>().map_err(|_| {
                Error::Tensor {
                    file: file.to_path_buf(),
                    tensor: name.clone(),
                    message: format!("dimension too large in shape {:?}", view.shape()),
                }
            })?;
        // MLX sizes are int32 too: a product past it would wrap inside MLX.
        let elements = view.shape().iter().try_fold(1usize, |acc, &d| acc.checked_mul(d));
        if elements.is_none_or(|n| n > i32::MAX as usize) {
            return Err(Error::Tensor {
                file: file.to_path_buf(),
                tensor: name,
                message: format!("{:?} holds more elements than MLX can index", view.shape()),
            });
        }
        out.push(TensorHeader { name, dtype, shape });
    }
    Ok((st, out))
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
        let mut store =
            WeightStore { tensors: HashMap::new(), files: files.clone(), stored_bytes: 0, problems: Vec::new() };
        for file in &files {
            store.load_file(file)?;
        }
        Ok(store)
    }

    fn load_file(&mut self, file: &Path) -> Result<()> {
        let bytes = std::fs::read(file).map_err(|e| Error::io(file, e))?;
        self.stored_bytes += bytes.len() as u64;
        let (st, headers) = parse_header(file, &bytes)?;
        for TensorHeader { name, dtype, shape } in headers {
            let view = st.tensor(&name).map_err(|e| Error::Tensor {
                file: file.to_path_buf(),
                tensor: name.clone(),
                message: format!("unreadable: {e}"),
            })?;
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

    /// Remove and return tensor `name`, checking it is present, of `expect`'s shape and dtype
    /// class. A tensor that is not is recorded as a [`TensorProblem`] and a placeholder of the
    /// expected shape stands in, so loading goes on and finds every problem in one pass;
    /// [`finish`](Self::finish) then fails. Placeholders are lazy and never evaluated.
    pub fn take(&mut self, name: &str, expect: Expect) -> Result<Array> {
        let Some((array, file)) = self.tensors.remove(name) else {
            let files: Vec<String> = self.files.iter().map(|f| f.display().to_string()).collect();
            let message = format!("missing from {} (expected shape {:?})", files.join(", "), expect.shape);
            self.problems.push(TensorProblem { tensor: name.to_string(), file: None, message });
            return expect.placeholder();
        };
        let shape: Vec<usize> = array.shape().iter().map(|&d| d as usize).collect();
        let mut wrong = Vec::new();
        if shape != expect.shape {
            wrong.push(format!("shape {shape:?}, expected {:?} from config.json", expect.shape));
        }
        let dtype = array.dtype();
        let ok = match expect.kind {
            Kind::Float => matches!(dtype, Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16),
            Kind::Packed => dtype == Dtype::Uint32,
        };
        if !ok {
            wrong.push(format!("dtype {}, expected {}", dtype_name(dtype), expect.kind.describe()));
        }
        if wrong.is_empty() {
            return Ok(array);
        }
        self.problems.push(TensorProblem { tensor: name.to_string(), file: Some(file), message: wrong.join("; ") });
        expect.placeholder()
    }

    /// Record a problem found by a loader (e.g. a quantized layout the config makes impossible).
    pub fn problem(&mut self, tensor: &str, message: impl Into<String>) {
        let file = self.tensors.get(tensor).map(|(_, f)| f.clone());
        self.problems.push(TensorProblem { tensor: tensor.to_string(), file, message: message.into() });
    }

    /// Remove tensor `name` without checks (its problem is already recorded).
    pub fn discard(&mut self, name: &str) {
        self.tensors.remove(name);
    }

    pub fn problems(&self) -> &[TensorProblem] {
        &self.problems
    }

    /// Every recorded problem as one error, or `Ok` when there is none.
    pub fn finish(&self) -> Result<()> {
        if self.problems.is_empty() {
            return Ok(());
        }
        Err(Error::Checkpoint {
            dir: self.files.first().and_then(|f| f.parent()).map(Path::to_path_buf).unwrap_or_default(),
            problems: self.problems.clone(),
        })
    }

    /// Float tensors holding NaN or infinity, with how many such values each has. Costs one
    /// reduction per tensor: `inspect` runs it; loading does not (a non-finite reference
    /// catches the effect at run time).
    pub fn non_finite(&self) -> Result<Vec<TensorProblem>> {
        let mut out = Vec::new();
        let mut names: Vec<&String> = self.tensors.keys().collect();
        names.sort();
        for name in names {
            let (a, file) = &self.tensors[name];
            if !matches!(a.dtype(), Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16) {
                continue;
            }
            let bad = a.is_finite()?.logical_not()?.as_dtype(Dtype::Uint32)?.sum(None)?;
            bad.eval()?;
            let count = bad.try_item_cast::<u32>().map_err(|e| Error::Mlx(e.to_string()))?;
            if count > 0 {
                out.push(TensorProblem {
                    tensor: name.clone(),
                    file: Some(file.clone()),
                    message: format!("{count} of {} values are NaN or infinite", a.size()),
                });
            }
        }
        Ok(out)
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

/// What a loader needs of one tensor. Dimensions are kept as config.json gives them (an absurd
/// `vocab_size` must be reported as written, not wrapped to an int32).
pub struct Expect {
    pub shape: Vec<usize>,
    pub kind: Kind,
}

impl Expect {
    pub fn float(shape: &[usize]) -> Self {
        Expect { shape: shape.to_vec(), kind: Kind::Float }
    }
    pub fn packed(shape: &[usize]) -> Self {
        Expect { shape: shape.to_vec(), kind: Kind::Packed }
    }

    /// A lazy array of the expected shape and dtype (a size-0 one when the shape cannot be an
    /// MLX shape), standing in for a missing or wrong tensor.
    pub fn placeholder(&self) -> Result<Array> {
        let dtype = match self.kind {
            Kind::Float => Dtype::Float32,
            Kind::Packed => Dtype::Uint32,
        };
        let shape: Vec<i32> = match self.shape.iter().map(|&d| i32::try_from(d)).collect() {
            Ok(s) => s,
            Err(_) => vec![0],
        };
        Ok(mlx_rs::ops::zeros_dtype(&shape, dtype)?)
    }
}

/// The tensors of an MLX affine-quantized linear from `input` to `output` features: packed
/// `uint32` weight `[output, input * bits / 32]`, float scales and biases
/// `[output, input / group_size]`; or why the config makes that layout impossible.
pub fn packed_layout(input: usize, output: usize, spec: QuantSpec) -> std::result::Result<[Expect; 3], String> {
    let (gs, bits) = (spec.group_size.max(1), spec.bits);
    if !input.is_multiple_of(gs) {
        return Err(format!(
            "{input} input features are not a multiple of group_size {gs} (config.json `quantization`)"
        ));
    }
    if !(input * bits).is_multiple_of(32) {
        return Err(format!("{input} input features at {bits} bits do not fill whole 32-bit words"));
    }
    let groups = input / gs;
    Ok([
        Expect::packed(&[output, input * bits / 32]),
        Expect::float(&[output, groups]),
        Expect::float(&[output, groups]),
    ])
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
            // A shard is a file in this directory: `../x` or `/x` would read outside it.
            let mut parts = Path::new(name).components();
            if !matches!((parts.next(), parts.next()), (Some(std::path::Component::Normal(_)), None)) {
                return Err(Error::Weights {
                    file: index.clone(),
                    message: format!("field `weight_map.{tensor}`: `{name}` is not a file name in this directory"),
                });
            }
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
