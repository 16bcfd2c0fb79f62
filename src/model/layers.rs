//! The building blocks shared by every family: linear (dense or MLX affine-quantized),
//! embedding (whose quantized form doubles as a tied output projection), RMSNorm (with
//! Gemma's `1 + w` gain), gated MLP (SwiGLU, or GELU for Gemma).

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{Ellipsis, IndexOp};
use mlx_rs::{Array, Dtype};

use super::twin::Twin;
use crate::fused::Fused;

use crate::checkpoint::weights::{Expect, packed_layout};
use crate::checkpoint::{ModelConfig, QuantSpec, Quantization, WeightStore};
use crate::error::Result;

/// How float tensors are converted at load: everything floating (weights, norms, quantization
/// scales and biases) is cast to `compute`, as mlx-lm's `model.set_dtype` does, so the whole
/// forward runs in one dtype. `None` keeps what the file stores.
#[derive(Debug, Clone, Copy)]
pub struct LoadOptions {
    pub compute: Option<Dtype>,
    /// Dequantize quantized linears at load (an opt-in speed trade on CPU; recorded in reports).
    pub dequantize: bool,
}

pub(crate) fn cast(a: Array, opts: &LoadOptions) -> Result<Array> {
    match opts.compute {
        Some(d) if a.dtype() != d => Ok(a.as_dtype(d)?),
        _ => Ok(a),
    }
}

/// `x @ W^T` with `W` in MLX's packed affine layout.
fn qmatmul_t(x: &Array, weight: &Array, scales: &Array, biases: &Array, spec: QuantSpec) -> Result<Array> {
    Ok(mlx_rs::ops::quantized_matmul(x, weight, scales, biases, true, spec.group_size as i32, spec.bits as i32)?)
}

/// Transposed once at load into contiguous `[in, out]`: MLX's CPU matmul hands `x @ W^T` to
/// BLAS as a transposed operand, and OpenBLAS's kernel for a transposed B reads a decode step's
/// weights 3-27% slower than for a plain one (measured cold, 1 to 8 rows; the products are
/// bit-identical either way, checked at every shape a suite runs).
/// Over a store that has found problems the load fails anyway: its placeholders (shaped by a
/// config that may be absurd) are left lazy, never materialised.
fn transposed(w: &WeightStore, a: &Array) -> Result<Array> {
    let t = a.t().contiguous()?;
    if w.problems().is_empty() {
        // Materialise now: the cost belongs to loading, and the `[out, in]` original is freed.
        t.eval()?;
    }
    Ok(t)
}

pub enum Linear {
    /// `weight_t`: `[in, out]` (see [`transposed`]); `twin`: its packed form where it was
    /// dequantized at load and the BLAS reads it (declared first: dropped before the matrix).
    Dense {
        twin: Option<Twin>,
        weight_t: Array,
        bias: Option<Array>,
    },
    Quantized {
        weight: Array,
        scales: Array,
        biases: Array,
        bias: Option<Array>,
        spec: QuantSpec,
    },
}

impl Linear {
    /// Load `{path}.weight` (and `scales`/`biases` when quantized, `bias` when `has_bias`) for a
    /// projection from `input` to `output` features.
    pub fn load(
        w: &mut WeightStore,
        quant: Option<&Quantization>,
        path: &str,
        input: usize,
        output: usize,
        has_bias: bool,
        opts: &LoadOptions,
    ) -> Result<Self> {
        let bias =
            if has_bias { Some(cast(w.take(&format!("{path}.bias"), Expect::float(&[output]))?, opts)?) } else { None };
        match quantized_spec(w, quant, path) {
            Some(spec) => {
                let (weight, scales, biases) = load_packed(w, path, input, output, spec, opts)?;
                Linear::Quantized { weight, scales, biases, bias, spec }.dequantized(w, opts)
            }
            None => {
                let weight = cast(w.take(&format!("{path}.weight"), Expect::float(&[output, input]))?, opts)?;
                Ok(Linear::Dense { twin: None, weight_t: transposed(w, &weight)?, bias })
            }
        }
    }

    /// Dequantized to float32 `[in, out]` where the load asks for it, its packed form registered
    /// as the matrix's twin; anything else as it is.
    fn dequantized(self, w: &WeightStore, opts: &LoadOptions) -> Result<Self> {
        match self {
            // Not over placeholders: the load fails anyway, and an absurd shape must not be
            // materialised.
            Linear::Quantized { weight, scales, biases, bias, spec } if opts.dequantize && w.problems().is_empty() => {
                let dense =
                    mlx_rs::ops::dequantize(&weight, &scales, &biases, spec.group_size as i32, spec.bits as i32)?;
                // Materialised by the transpose: the cost belongs to loading, and the packed form
                // is freed (the BLAS keeps its own copy as the twin).
                let weight_t = transposed(w, &dense)?;
                let twin = Twin::packed(&weight_t, &weight, &scales, &biases, spec);
                Ok(Linear::Dense { twin, weight_t, bias })
            }
            other => Ok(other),
        }
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let y = match self {
            Linear::Dense { weight_t, .. } => x.matmul(weight_t)?,
            Linear::Quantized { weight, scales, biases, spec, .. } => qmatmul_t(x, weight, scales, biases, *spec)?,
        };
        match self.bias() {
            Some(b) => Ok(y.add(b)?),
            None => Ok(y),
        }
    }

    fn bias(&self) -> Option<&Array> {
        match self {
            Linear::Dense { bias, .. } | Linear::Quantized { bias, .. } => bias.as_ref(),
        }
    }

    /// Bytes a forward of `rows` rows reads from the weights (packed, scales and biases
    /// included; a twin's where the BLAS reads it at that many rows).
    pub fn read_bytes(&self, rows: usize) -> u64 {
        let arrays: Vec<&Array> = match self {
            Linear::Dense { twin: Some(twin), bias, .. } if rows <= Twin::max_rows() => {
                return twin.nbytes() + bias.iter().map(|b| b.nbytes() as u64).sum::<u64>();
            }
            Linear::Dense { weight_t, bias, .. } => std::iter::once(weight_t).chain(bias).collect(),
            Linear::Quantized { weight, scales, biases, bias, .. } => {
                [weight, scales, biases].into_iter().chain(bias).collect()
            }
        };
        arrays.iter().map(|a| a.nbytes() as u64).sum()
    }

    /// Output features (rows of the weight, packed or not).
    fn outputs(&self) -> i32 {
        match self {
            Linear::Dense { weight_t, .. } => weight_t.shape()[1],
            Linear::Quantized { weight, .. } => weight.shape()[0],
        }
    }
}

/// Projections of one input computed together: their weights stacked on the output axis, so a
/// step runs one matmul where it would run several (each BLAS call has its own threading cost,
/// and a decode step is made of small calls), then the result is split. Every output is the
/// same dot product over the same weights as in its own projection. Quantized parts with
/// different bits or group sizes cannot share a matmul and stay separate.
pub enum Stacked {
    One { linear: Linear, split_at: Vec<i32> },
    Many(Vec<Linear>),
}

impl Stacked {
    /// `{path}` of each `(path, input, output)`, stacked as stored and then dequantized where the
    /// load asks for it: quantized parts stack into one packed matrix, dequantized (and its twin
    /// checked and registered) once, not part by part and again stacked.
    pub fn load(
        w: &mut WeightStore,
        quant: Option<&Quantization>,
        parts: &[(String, usize, usize)],
        has_bias: bool,
        opts: &LoadOptions,
    ) -> Result<Self> {
        let as_stored = LoadOptions { dequantize: false, ..*opts };
        let stored = parts
            .iter()
            .map(|(path, input, output)| Linear::load(w, quant, path, *input, *output, has_bias, &as_stored))
            .collect::<Result<Vec<_>>>()?;
        Ok(match Stacked::new(stored)? {
            Stacked::One { linear, split_at } => Stacked::One { linear: linear.dequantized(w, opts)?, split_at },
            Stacked::Many(parts) => {
                Stacked::Many(parts.into_iter().map(|p| p.dequantized(w, opts)).collect::<Result<_>>()?)
            }
        })
    }

    fn new(parts: Vec<Linear>) -> Result<Self> {
        let mut split_at: Vec<i32> = Vec::with_capacity(parts.len());
        for p in &parts[..parts.len().saturating_sub(1)] {
            split_at.push(split_at.last().copied().unwrap_or(0) + p.outputs());
        }
        let stack_on = |xs: Vec<&Array>, axis: i32| -> Result<Array> {
            let a = mlx_rs::ops::concatenate(&xs, axis)?;
            // Materialise now: the cost belongs to loading, and the parts are freed.
            a.eval()?;
            Ok(a)
        };
        // Outputs stack on axis 0 of `[out, ...]` arrays, on axis 1 of a dense `[in, out]`.
        let stack = |xs: Vec<&Array>| stack_on(xs, 0);
        let bias = match parts.iter().map(Linear::bias).collect::<Option<Vec<_>>>() {
            Some(biases) => Some(stack(biases)?),
            None if parts.iter().any(|p| p.bias().is_some()) => return Ok(Stacked::Many(parts)),
            None => None,
        };
        let dense: Option<Vec<&Array>> = parts
            .iter()
            .map(|p| match p {
                Linear::Dense { weight_t, .. } => Some(weight_t),
                Linear::Quantized { .. } => None,
            })
            .collect();
        let quantized: Option<Vec<_>> = parts
            .iter()
            .map(|p| match p {
                Linear::Quantized { weight, scales, biases, spec, .. } => Some((weight, scales, biases, *spec)),
                Linear::Dense { .. } => None,
            })
            .collect();
        let linear = match (dense, quantized) {
            // Float parts of a float checkpoint: a dequantized checkpoint's parts are stacked
            // packed, before they are dequantized (see `Stacked::load`).
            (Some(weights), _) => Linear::Dense { twin: None, weight_t: stack_on(weights, 1)?, bias },
            (None, Some(q)) if q.iter().all(|x| x.3 == q[0].3) => Linear::Quantized {
                weight: stack(q.iter().map(|x| x.0).collect())?,
                scales: stack(q.iter().map(|x| x.1).collect())?,
                biases: stack(q.iter().map(|x| x.2).collect())?,
                bias,
                spec: q[0].3,
            },
            _ => return Ok(Stacked::Many(parts)),
        };
        Ok(Stacked::One { linear, split_at })
    }

    pub fn read_bytes(&self, rows: usize) -> u64 {
        match self {
            Stacked::One { linear, .. } => linear.read_bytes(rows),
            Stacked::Many(parts) => parts.iter().map(|p| p.read_bytes(rows)).sum(),
        }
    }

    /// Each projection of `x`, in the order given to [`Stacked::load`].
    pub fn forward(&self, x: &Array) -> Result<Vec<Array>> {
        match self {
            // Slices, not `split`: MLX 0.32's CUDA RoPE allocates its output at a split
            // piece's element count but writes through the piece's strides, past the buffer
            // (llama and SmolLM2 garbage on a GPU; docs/gpu.md). A slice of the same strides
            // is read correctly on every backend.
            Stacked::One { linear, split_at } => {
                let y = linear.forward(x)?;
                let total = *y.shape().last().unwrap_or(&0);
                let bounds: Vec<i32> = std::iter::once(0).chain(split_at.iter().copied()).chain([total]).collect();
                Ok(bounds.windows(2).map(|w| y.index((Ellipsis, w[0]..w[1]))).collect())
            }
            Stacked::Many(parts) => parts.iter().map(|p| p.forward(x)).collect(),
        }
    }
}

/// A module is quantized when the config says so and its `scales` are present; a config that
/// says quantized but a file without scales is caught by the shape check on `weight`.
fn quantized_spec(w: &WeightStore, quant: Option<&Quantization>, path: &str) -> Option<QuantSpec> {
    let spec = quant?.for_module(path)?;
    w.contains(&format!("{path}.scales")).then_some(spec)
}

fn load_packed(
    w: &mut WeightStore,
    path: &str,
    input: usize,
    output: usize,
    spec: QuantSpec,
    opts: &LoadOptions,
) -> Result<(Array, Array, Array)> {
    let names = ["weight", "scales", "biases"].map(|t| format!("{path}.{t}"));
    let [weight, scales, biases] = match packed_layout(input, output, spec) {
        Ok(layout) => layout,
        Err(why) => {
            // The layout itself is impossible: one problem, and the tensors are set aside
            // rather than each reported as a shape mismatch against a meaningless layout.
            w.problem(&names[0], why);
            for n in &names {
                w.discard(n);
            }
            let p = Expect::packed(&[output, 1]).placeholder()?;
            let f = Expect::float(&[output, 1]).placeholder()?;
            return Ok((p, f.clone(), f));
        }
    };
    let [nw, ns, nb] = &names;
    let weight = w.take(nw, weight)?;
    let scales = cast(w.take(ns, scales)?, opts)?;
    let biases = cast(w.take(nb, biases)?, opts)?;
    Ok((weight, scales, biases))
}

pub enum Embedding {
    /// `weight_t`: `[hidden, vocab]` (see [`transposed`]): the tied output projection reads it
    /// whole every step; a lookup takes a few of its columns.
    /// `twin`: as [`Linear::Dense`]'s.
    Dense {
        twin: Option<Twin>,
        weight_t: Array,
    },
    Quantized {
        weight: Array,
        scales: Array,
        biases: Array,
        spec: QuantSpec,
    },
}

impl Embedding {
    pub fn load(
        w: &mut WeightStore,
        quant: Option<&Quantization>,
        path: &str,
        vocab: usize,
        hidden: usize,
        opts: &LoadOptions,
    ) -> Result<Self> {
        match quantized_spec(w, quant, path) {
            Some(spec) => {
                let (weight, scales, biases) = load_packed(w, path, hidden, vocab, spec, opts)?;
                if opts.dequantize {
                    // The embedding too: tied, it is also the output projection, the largest
                    // matmul of a decode step, and MLX's CPU quantized matmul is single-threaded
                    // (mlx-lm's dequantize_model converts it as well).
                    let dense =
                        mlx_rs::ops::dequantize(&weight, &scales, &biases, spec.group_size as i32, spec.bits as i32)?;
                    let weight_t = transposed(w, &dense)?;
                    let twin = Twin::packed(&weight_t, &weight, &scales, &biases, spec);
                    return Ok(Embedding::Dense { twin, weight_t });
                }
                Ok(Embedding::Quantized { weight, scales, biases, spec })
            }
            None => {
                let weight = cast(w.take(&format!("{path}.weight"), Expect::float(&[vocab, hidden]))?, opts)?;
                Ok(Embedding::Dense { twin: None, weight_t: transposed(w, &weight)? })
            }
        }
    }

    /// `ids` of any shape -> `[..., hidden]`.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        match self {
            Embedding::Dense { weight_t, .. } => {
                // Columns `ids` of `[hidden, vocab]`: `[hidden, ...ids]`, hidden moved last.
                let cols = weight_t.take_axis(ids, 1)?;
                let n = cols.ndim() as i32;
                let axes: Vec<i32> = (1..n).chain([0]).collect();
                Ok(cols.transpose_axes(&axes)?)
            }
            Embedding::Quantized { weight, scales, biases, spec } => {
                let w = weight.take_axis(ids, 0)?;
                let s = scales.take_axis(ids, 0)?;
                let b = biases.take_axis(ids, 0)?;
                Ok(mlx_rs::ops::dequantize(&w, &s, &b, spec.group_size as i32, spec.bits as i32)?)
            }
        }
    }

    /// Bytes the tied output projection reads for `rows` rows (see [`Linear::read_bytes`]).
    pub fn read_bytes(&self, rows: usize) -> u64 {
        let arrays = match self {
            Embedding::Dense { twin: Some(twin), .. } if rows <= Twin::max_rows() => return twin.nbytes(),
            Embedding::Dense { weight_t, .. } => vec![weight_t],
            Embedding::Quantized { weight, scales, biases, .. } => vec![weight, scales, biases],
        };
        arrays.iter().map(|a| a.nbytes() as u64).sum()
    }

    /// The tied output projection: `x @ E^T`.
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        match self {
            Embedding::Dense { weight_t, .. } => Ok(x.matmul(weight_t)?),
            Embedding::Quantized { weight, scales, biases, spec } => qmatmul_t(x, weight, scales, biases, *spec),
        }
    }
}

pub struct RmsNorm {
    weight: Array,
    eps: f32,
}

/// How a checkpoint stores an RMSNorm's gain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormGain {
    /// The gain itself (Llama, Qwen3).
    Stored,
    /// Its offset from 1: the norm multiplies by `1 + w` (Gemma). Added once at load, in the
    /// compute dtype, the same addition mlx-lm makes on every call.
    OffsetFromOne,
}

impl RmsNorm {
    pub fn load(
        w: &mut WeightStore,
        path: &str,
        dim: usize,
        eps: f32,
        gain: NormGain,
        opts: &LoadOptions,
    ) -> Result<Self> {
        let weight = cast(w.take(&format!("{path}.weight"), Expect::float(&[dim]))?, opts)?;
        let weight = match gain {
            NormGain::Stored => weight,
            NormGain::OffsetFromOne => weight.add(Array::from_f32(1.0).as_dtype(weight.dtype())?)?,
        };
        Ok(RmsNorm { weight, eps })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(mlx_rs::fast::rms_norm(x, Some(&self.weight), self.eps)?)
    }
}

/// The gate's nonlinearity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU (Llama, Qwen3).
    Silu = 0,
    /// GELU, tanh approximation (Gemma's `gelu_pytorch_tanh`; mlx-lm's `nn.gelu_approx`).
    GeluTanh = 1,
}

thread_local! {
    /// [`gated`] fused, one per [`Activation`] (indexed by it). Unfused it is two operations a
    /// layer, the activation among them compiled by mlx-rs afresh, so traced afresh, on every
    /// call.
    static GATE: [Fused; 2] = [Activation::Silu, Activation::GeluTanh]
        .map(|a| Fused::new(move |args: &[Array]| gated(&args[0], &args[1], a)));
}

/// `act(g) * u`, with `act` the operations of mlx-rs's `nn::silu` and `nn::gelu_approximate`
/// in their order and dtypes (see [`crate::fused`]; `tests::the_fused_gate_is_the_activation_times_up_bit_for_bit`).
fn gated(g: &Array, u: &Array, activation: Activation) -> std::result::Result<Array, Exception> {
    use mlx_rs::array;
    use mlx_rs::ops::{sigmoid, sqrt, tanh};
    let act = match activation {
        Activation::Silu => g.multiply(sigmoid(g)?)?,
        // 0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))
        Activation::GeluTanh => {
            let cubic = g.add(array!(0.044715).multiply(g.power(&array!(3))?)?)?;
            let inner = sqrt(&array!(2.0 / std::f32::consts::PI))?.multiply(cubic)?;
            array!(0.5).multiply(g)?.multiply(array!(1.0).add(tanh(&inner)?)?)?
        }
    };
    act.multiply(u)
}

/// Gated MLP: `down(act(gate(x)) * up(x))`, gate and up in one matmul.
pub struct Mlp {
    gate_up: Stacked,
    down: Linear,
    activation: Activation,
}

impl Mlp {
    /// `{path}.{gate,up,down}_proj` of a checkpoint with config `c`.
    pub fn load(
        w: &mut WeightStore,
        c: &ModelConfig,
        path: &str,
        activation: Activation,
        opts: &LoadOptions,
    ) -> Result<Self> {
        let (quant, hidden, intermediate, bias) =
            (c.quantization.as_ref(), c.hidden_size, c.intermediate_size, c.mlp_bias);
        let parts = ["gate_proj", "up_proj"].map(|p| (format!("{path}.{p}"), hidden, intermediate));
        Ok(Mlp {
            gate_up: Stacked::load(w, quant, &parts, bias, opts)?,
            down: Linear::load(w, quant, &format!("{path}.down_proj"), intermediate, hidden, bias, opts)?,
            activation,
        })
    }

    /// Weight bytes the gate/up and the down projections read for `rows` rows.
    pub fn read_bytes(&self, rows: usize) -> (u64, u64) {
        (self.gate_up.read_bytes(rows), self.down.read_bytes(rows))
    }

    /// `x` -> the MLP's output; `tap` sees the gated product before the down projection.
    pub fn forward(&self, x: &Array, tap: impl Fn(&str, &Array)) -> Result<Array> {
        let [g, u]: [Array; 2] = self
            .gate_up
            .forward(x)?
            .try_into()
            .map_err(|_| crate::error::Error::Invalid("gate/up projection did not split in two".into()))?;
        let h = GATE.with(|fused| fused[self.activation as usize].call(&[g, u]))?;
        tap("mlp_gated", &h);
        self.down.forward(&h)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Guards the fused gate against moving a bit from what every snapshot was computed with:
    /// mlx-rs's activation, then the product, as two operations. A constant rounded otherwise,
    /// an operation reordered or a multiply and add contracted would move every row's logits.
    #[test]
    fn the_fused_gate_is_the_activation_times_up_bit_for_bit() {
        crate::environment::use_device(crate::environment::DeviceChoice::Cpu).expect("the CPU is always there");
        for activation in [Activation::Silu, Activation::GeluTanh] {
            for shape in [&[1, 1, 1536][..], &[2, 37, 640], &[3, 5, 7]] {
                for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                    let normal = || {
                        let x = mlx_rs::random::normal::<f32>(shape, None, None, None).unwrap();
                        x.multiply(Array::from_f32(4.0)).unwrap().as_dtype(dtype).unwrap()
                    };
                    let (g, u) = (normal(), normal());
                    let act = match activation {
                        Activation::Silu => mlx_rs::nn::silu(&g).unwrap(),
                        Activation::GeluTanh => mlx_rs::nn::gelu_approximate(&g).unwrap(),
                    };
                    let unfused = act.multiply(&u).unwrap();
                    let fused = GATE.with(|f| f[activation as usize].call(&[g, u])).unwrap();
                    assert_eq!(fused.dtype(), unfused.dtype(), "{activation:?} {shape:?} {dtype:?}");
                    let (a, b) = (fused.as_dtype(Dtype::Float32).unwrap(), unfused.as_dtype(Dtype::Float32).unwrap());
                    let differ = a
                        .as_slice::<f32>()
                        .iter()
                        .zip(b.as_slice::<f32>())
                        .filter(|(x, y)| x.to_bits() != y.to_bits())
                        .count();
                    assert_eq!(differ, 0, "{activation:?} {shape:?} {dtype:?}: {differ} values differ");
                }
            }
        }
    }
}
