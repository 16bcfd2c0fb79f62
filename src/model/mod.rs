//! The model runtime: a decoder-only transformer whose only view of KV storage is
//! [`KvCache`]. One forward serves prefill, chunked prefill, padded prefill and batched
//! decode; nothing here asks which backend it runs on. Attention runs batched (the default) or
//! row by row ([`AttentionMode`]), a comparison of its own.

pub mod attention;
pub mod gemma3;
pub mod layers;
pub mod llama;
pub mod qwen3;
pub mod rope;
mod twin;

use std::path::Path;

use mlx_rs::{Array, Dtype};

use crate::checkpoint::{Arch, ModelConfig, WeightStore};
use crate::dtype::DtypeName;
use crate::error::{Error, Result};
use crate::faults::Faults;
use crate::kv::{KvCache, KvShape, SeqId};

use attention::StepContext;
pub use attention::{Attention, AttentionMode};
pub use layers::{Activation, Embedding, Linear, LoadOptions, Mlp, NormGain, RmsNorm};
use rope::Ropes;

/// What a family contributes beyond the shared decoder (see `llama.rs`, `qwen3.rs`,
/// `gemma3.rs`).
pub struct FamilySpec {
    /// Per-head RMSNorm on q and k before RoPE (Qwen3, Gemma 3).
    pub qk_norm: bool,
    /// Whether the output projection is the embedding when config.json does not say.
    pub tie_by_default: bool,
    /// How every RMSNorm's gain is stored.
    pub norm_gain: NormGain,
    /// Norms on the attention's and the MLP's outputs too, before each residual add (Gemma).
    pub sandwich_norms: bool,
    /// The embedding multiplied by `sqrt(hidden_size)`, rounded to bfloat16 (Gemma).
    pub embed_scale: bool,
    pub activation: Activation,
}

pub struct Block {
    pub input_norm: RmsNorm,
    pub attn: Attention,
    /// Gemma's `post_attention_layernorm`, on the attention's output.
    pub attn_out_norm: Option<RmsNorm>,
    /// Before the MLP: Llama's `post_attention_layernorm`, Gemma's `pre_feedforward_layernorm`.
    pub mlp_norm: RmsNorm,
    pub mlp: Mlp,
    /// Gemma's `post_feedforward_layernorm`, on the MLP's output.
    pub mlp_out_norm: Option<RmsNorm>,
}

pub struct Model {
    pub config: ModelConfig,
    pub dtype: DtypeName,
    pub dequantized: bool,
    embed: Embedding,
    blocks: Vec<Block>,
    norm: RmsNorm,
    /// `None`: tied to the embedding.
    lm_head: Option<Linear>,
    ropes: Ropes,
    /// `sqrt(hidden_size)` in the compute dtype, where the family scales its embedding.
    embed_scale: Option<Array>,
    /// Planted faults (see `faults`); a runtime setting, none by default.
    faults: std::cell::Cell<Faults>,
}

/// Named intermediates of one forward pass, in the order they were computed: what `parity
/// locate` compares between two devices to name the first layer and operation where they part.
/// A pass without taps records nothing and costs nothing; with them, each tapped array is kept
/// alive until the caller evaluates it (both sides of a comparison tap alike).
///
/// Timed taps ([`Taps::timed`], `parity bench --profile`) keep no arrays: each tap evaluates
/// its array at once and records the wall time since the previous tap returned, so every
/// operation between two taps is charged to the later one. A pass run this way is synchronous
/// (no step overlaps the next), which is what a per-operation cost needs.
#[derive(Default)]
pub struct Taps {
    taps: std::cell::RefCell<Vec<(String, Array)>>,
    timer: Option<std::cell::RefCell<Timer>>,
}

struct Timer {
    last: std::time::Instant,
    spans: Vec<Span>,
    error: Option<mlx_rs::error::Exception>,
}

/// One timed tap: the operations since the previous tap, ending at `op` of `layer`.
#[derive(Debug, Clone)]
pub struct Span {
    pub layer: Option<usize>,
    pub op: String,
    pub seconds: f64,
}

impl Taps {
    /// Taps that time the pass instead of recording it; the clock starts now.
    pub fn timed() -> Self {
        let timer = Timer { last: std::time::Instant::now(), spans: Vec::new(), error: None };
        Taps { taps: Default::default(), timer: Some(std::cell::RefCell::new(timer)) }
    }

    /// Record `a` as operation `op` of `layer` (`None`: outside the layers).
    pub fn tap(&self, layer: Option<usize>, op: &str, a: &Array) {
        if let Some(timer) = &self.timer {
            let mut t = timer.borrow_mut();
            if let Err(e) = a.eval() {
                t.error.get_or_insert(e);
            }
            let now = std::time::Instant::now();
            let seconds = (now - t.last).as_secs_f64();
            t.last = now;
            t.spans.push(Span { layer, op: op.to_string(), seconds });
            return;
        }
        let name = match layer {
            Some(l) => format!("layer {l} {op}"),
            None => op.to_string(),
        };
        self.taps.borrow_mut().push((name, a.clone()));
    }

    pub fn into_inner(self) -> Vec<(String, Array)> {
        self.taps.into_inner()
    }

    /// A timed pass's spans, or the first evaluation error it met.
    pub fn into_spans(self) -> Result<Vec<Span>> {
        let Some(timer) = self.timer else { return Ok(Vec::new()) };
        let t = timer.into_inner();
        match t.error {
            Some(e) => Err(e.into()),
            None => Ok(t.spans),
        }
    }
}

/// Whether the pass's taps time it (each evaluates its array at once).
pub(crate) fn timed(taps: Option<&Taps>) -> bool {
    taps.is_some_and(|t| t.timer.is_some())
}

/// Tap `a` when the pass is traced.
pub(crate) fn tap(taps: Option<&Taps>, layer: Option<usize>, op: &str, a: &Array) {
    if let Some(t) = taps {
        t.tap(layer, op, a);
    }
}

/// One row of a forward step: a sequence and the tokens to append to it. Rows in one step
/// share a token count; tokens past `n_real` are padding and the logits are taken at the last
/// real token.
#[derive(Debug, Clone)]
pub struct RowStep {
    pub seq: SeqId,
    pub tokens: Vec<u32>,
    pub logits_at: usize,
}

impl RowStep {
    pub fn new(seq: SeqId, tokens: Vec<u32>) -> Self {
        let logits_at = tokens.len().saturating_sub(1);
        RowStep { seq, tokens, logits_at }
    }
}

impl Model {
    /// Load a checkpoint directory's weights for `config`. `dtype` of `None` keeps the stored
    /// float dtype ("native").
    pub fn load(dir: &Path, config: ModelConfig, dtype: Option<DtypeName>, dequantize: bool) -> Result<Self> {
        let mut weights = WeightStore::load(dir)?;
        Self::from_weights(&mut weights, config, dtype, dequantize)
    }

    pub fn from_weights(
        w: &mut WeightStore,
        config: ModelConfig,
        dtype: Option<DtypeName>,
        dequantize: bool,
    ) -> Result<Self> {
        let spec = match config.arch {
            Arch::Llama => llama::SPEC,
            Arch::Qwen3 => qwen3::SPEC,
            Arch::Gemma3 => gemma3::SPEC,
        };
        let stored = w.dtype_of("model.norm.weight").and_then(DtypeName::from_mlx).unwrap_or(DtypeName::Float32);
        let dtype_name = dtype.unwrap_or(stored);
        let opts = LoadOptions { compute: Some(dtype_name.mlx()), dequantize };
        let q = config.quantization.as_ref();
        let c = &config;
        let embed = Embedding::load(w, q, "model.embed_tokens", c.vocab_size, c.hidden_size, &opts)?;
        let gain = spec.norm_gain;
        let norm = |w: &mut WeightStore, name: &str| RmsNorm::load(w, name, c.hidden_size, c.rms_norm_eps, gain, &opts);
        let mut blocks = Vec::with_capacity(c.num_layers);
        for i in 0..c.num_layers {
            let p = format!("model.layers.{i}");
            let (attn_out_norm, mlp_norm, mlp_out_norm) = if spec.sandwich_norms {
                (
                    Some(norm(w, &format!("{p}.post_attention_layernorm"))?),
                    norm(w, &format!("{p}.pre_feedforward_layernorm"))?,
                    Some(norm(w, &format!("{p}.post_feedforward_layernorm"))?),
                )
            } else {
                (None, norm(w, &format!("{p}.post_attention_layernorm"))?, None)
            };
            blocks.push(Block {
                input_norm: norm(w, &format!("{p}.input_layernorm"))?,
                attn: Attention::load(w, c, &format!("{p}.self_attn"), i, spec.qk_norm, gain, &opts)?,
                attn_out_norm,
                mlp_norm,
                mlp: Mlp::load(w, c, &format!("{p}.mlp"), spec.activation, &opts)?,
                mlp_out_norm,
            });
        }
        let norm = norm(w, "model.norm")?;
        let tied = match c.tie_word_embeddings {
            Some(t) => t,
            None => spec.tie_by_default && !w.contains("lm_head.weight"),
        };
        let lm_head =
            if tied { None } else { Some(Linear::load(w, q, "lm_head", c.hidden_size, c.vocab_size, false, &opts)?) };
        // Every tensor problem the loaders found (missing, shape, dtype, quantized layout), at
        // once: the one validation `inspect` shares.
        w.finish()?;
        let ropes = Ropes::new(c)?;
        let embed_scale = if spec.embed_scale {
            let scale = half::bf16::from_f32((c.hidden_size as f32).sqrt()).to_f32();
            Some(Array::from_f32(scale).as_dtype(dtype_name.mlx())?)
        } else {
            None
        };
        Ok(Model {
            config,
            dtype: dtype_name,
            dequantized: dequantize,
            embed,
            blocks,
            norm,
            lm_head,
            ropes,
            embed_scale,
            faults: std::cell::Cell::new(Faults::NONE),
        })
    }

    /// Each layer's sliding window (`None`: global attention), for a KV store that keeps only
    /// what each layer can see.
    pub fn layer_windows(&self) -> Vec<Option<usize>> {
        (0..self.config.num_layers).map(|l| self.config.layer_window(l)).collect()
    }

    pub fn kv_shape(&self) -> KvShape {
        KvShape {
            layers: self.config.num_layers,
            kv_heads: self.config.num_kv_heads,
            head_dim: self.config.head_dim,
            dtype: self.dtype,
        }
    }

    pub fn faults(&self) -> Faults {
        self.faults.get()
    }

    pub fn set_faults(&self, faults: Faults) {
        self.faults.set(faults);
    }

    /// Bytes of weights read by the matmul that ends each timed tap, over all layers, in a
    /// step of `rows` rows: `q_proj` (q, k and v, one stacked matmul), `o_proj`, `mlp_gated`
    /// (gate and up), `mlp` (down) and `logits` (the head, or the tied embedding). Packed twins
    /// read at that many rows count as what they are.
    pub fn matmul_bytes(&self, rows: usize) -> Vec<(&'static str, u64)> {
        let (mut qkv, mut o, mut gate_up, mut down) = (0, 0, 0, 0);
        for b in &self.blocks {
            let (a, c) = b.attn.read_bytes(rows);
            let (g, d) = b.mlp.read_bytes(rows);
            (qkv, o, gate_up, down) = (qkv + a, o + c, gate_up + g, down + d);
        }
        let head = match &self.lm_head {
            Some(h) => h.read_bytes(rows),
            None => self.embed.read_bytes(rows),
        };
        vec![("q_proj", qkv), ("o_proj", o), ("mlp_gated", gate_up), ("mlp", down), ("logits", head)]
    }

    pub fn tied_embeddings(&self) -> bool {
        self.lm_head.is_none()
    }

    /// Run one step for `rows` with batched attention (see [`Model::forward_mode`]). The mode
    /// is the caller's (a builtin path's), not the model's: one loaded model serves every path.
    pub fn forward(&self, kv: &mut dyn KvCache, rows: &[RowStep]) -> Result<Array> {
        self.forward_mode(kv, rows, AttentionMode::Batched)
    }

    /// Run one step for `rows` and return the logits `[B, vocab]` at each row's `logits_at`.
    ///
    /// Each row's K/V rows are reserved in `kv` first; the row's RoPE offset is derived from
    /// that reservation (the sequence's one counter), never tracked here.
    pub fn forward_mode(&self, kv: &mut dyn KvCache, rows: &[RowStep], mode: AttentionMode) -> Result<Array> {
        self.forward_traced(kv, rows, mode, None)
    }

    /// [`Model::forward_mode`], recording its intermediates in `taps`.
    pub fn forward_traced(
        &self,
        kv: &mut dyn KvCache,
        rows: &[RowStep],
        mode: AttentionMode,
        taps: Option<&Taps>,
    ) -> Result<Array> {
        let t = rows.first().map(|r| r.tokens.len()).unwrap_or(0);
        if t == 0 || rows.iter().any(|r| r.tokens.len() != t) {
            return Err(Error::Invalid("every row of a step needs the same, non-zero number of tokens".into()));
        }
        if let Some(bad) = rows.iter().flat_map(|r| &r.tokens).find(|&&id| id as usize >= self.config.vocab_size) {
            return Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.config.vocab_size
            )));
        }
        if let Some(r) = rows.iter().find(|r| r.logits_at >= t) {
            return Err(Error::Invalid(format!("logits_at {} is past the step's {t} tokens", r.logits_at)));
        }
        let seqs: Vec<SeqId> = rows.iter().map(|r| r.seq).collect();
        let b = rows.len() as i32;
        let ids: Vec<i32> = rows.iter().flat_map(|r| r.tokens.iter().map(|&x| x as i32)).collect();
        let ids = Array::from_slice(&ids, &[b, t as i32]);
        let pick = (t > 1).then(|| rows.iter().map(|r| r.logits_at as i32).collect::<Vec<_>>());
        self.step(kv, seqs, ids, pick, mode, taps)
    }

    /// One decode step (one token per sequence) whose tokens are a device array `[B]`, typically
    /// the previous step's argmax: a caller can queue this step before the previous one has
    /// finished, so the host never waits between steps (as mlx-lm's generators pipeline). The
    /// ids are trusted to be in the vocabulary, as an argmax over the logits always is.
    pub fn decode_next(&self, kv: &mut dyn KvCache, seqs: &[SeqId], ids: &Array, mode: AttentionMode) -> Result<Array> {
        if ids.shape() != [seqs.len() as i32] {
            return Err(Error::Invalid(format!("{} sequences but token ids of shape {:?}", seqs.len(), ids.shape())));
        }
        self.step(kv, seqs.to_vec(), ids.reshape(&[seqs.len() as i32, 1])?, None, mode, None)
    }

    /// The forward pass over `ids` (`[B, T]`) appended to `seqs`; logits at `pick[b]` of each
    /// row (`None`: the only position, T = 1).
    fn step(
        &self,
        kv: &mut dyn KvCache,
        seqs: Vec<SeqId>,
        ids: Array,
        pick: Option<Vec<i32>>,
        mode: AttentionMode,
        taps: Option<&Taps>,
    ) -> Result<Array> {
        if let Some(dup) = seqs.iter().enumerate().find_map(|(i, s)| seqs[..i].contains(s).then_some(s)) {
            // Two rows of one sequence would reserve and write the same rows twice.
            return Err(Error::Invalid(format!("sequence {} appears twice in one step", dup.0)));
        }
        // A device error earlier leaves MLX's empty arrays behind (mlx-c returns one when an
        // operation throws): an error here, never an index panic.
        let [b, t] = *ids.shape() else {
            return Err(Error::Invalid(format!(
                "token ids of shape {:?}, expected [rows, tokens] (a device error upstream?)",
                ids.shape()
            )));
        };
        let t = t as usize;
        let ctx = self.config.max_position_embeddings;
        let mut starts = Vec::with_capacity(seqs.len());
        let mut masked = Vec::with_capacity(seqs.len());
        for &seq in &seqs {
            let len = kv.len(seq)?;
            if len + t > ctx {
                return Err(Error::ContextOverflow { held: len, adding: t, context: ctx });
            }
            masked.push(kv.masked_prefix(seq)?);
            starts.push(kv.reserve(seq, t)?);
        }
        let mut x = self.embed.forward(&ids)?;
        if let Some(scale) = &self.embed_scale {
            x = x.multiply(scale)?;
        }
        tap(taps, None, "embed", &x);
        let step = StepContext::new(mode, seqs, starts, masked, t, &self.ropes, self.faults.get()).traced(taps);
        for (layer, block) in self.blocks.iter().enumerate() {
            let l = Some(layer);
            let normed = block.input_norm.forward(&x)?;
            tap(taps, l, "input_norm", &normed);
            let mut h = block.attn.forward(&normed, layer, kv, &step)?;
            if let Some(n) = &block.attn_out_norm {
                h = n.forward(&h)?;
                tap(taps, l, "attn_out_norm", &h);
            }
            x = x.add(&h)?;
            tap(taps, l, "attn_residual", &x);
            let normed = block.mlp_norm.forward(&x)?;
            tap(taps, l, "mlp_norm", &normed);
            let mut h = block.mlp.forward(&normed, |op, a| tap(taps, l, op, a))?;
            tap(taps, l, "mlp", &h);
            if let Some(n) = &block.mlp_out_norm {
                h = n.forward(&h)?;
                tap(taps, l, "mlp_out_norm", &h);
            }
            x = x.add(&h)?;
            tap(taps, l, "mlp_residual", &x);
        }
        // Only the selected position of each row goes through the final norm and the head.
        let x = match pick {
            None => x.squeeze_axes(&[1])?,
            Some(pick) => x.take_along_axis(Array::from_slice(&pick, &[b, 1, 1]), 1)?.squeeze_axes(&[1])?,
        };
        let x = self.norm.forward(&x)?;
        tap(taps, None, "final_norm", &x);
        let logits = match &self.lm_head {
            Some(head) => head.forward(&x)?,
            None => self.embed.as_linear(&x)?,
        };
        tap(taps, None, "logits", &logits);
        Ok(logits)
    }

    pub fn compute_dtype(&self) -> Dtype {
        self.dtype.mlx()
    }
}
