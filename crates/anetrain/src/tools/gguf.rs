//! GGUF export: a model (LoRA merged in) as one GGUF v3 file that
//! llama.cpp, Ollama and LM Studio load, with its tokenizer and chat
//! template.
//!
//! The container is small and fully specified (llama.cpp `docs/gguf.md`;
//! `gguf-py/gguf/gguf_writer.py`): a header, typed key/value metadata,
//! tensor descriptors, then the tensors at 32-byte aligned offsets. The
//! Rust GGUF crates are readers, or writers that would still leave us the
//! metadata, the quantisation and the atomic write; the writer here is a
//! page of code and streams tensor by tensor (a model's bytes are never
//! held twice).
//!
//! What llama.cpp reads, and why each choice (learned from llama.cpp's
//! `convert_hf_to_gguf.py`, `gguf-py/gguf/constants.py` and
//! `src/llama-model.cpp`):
//! * Architectures `llama` and `qwen3`, with the hyperparameters under
//!   `{arch}.…` (`Keys.LLM`/`Keys.Attention`/`Keys.Rope` in constants.py).
//! * RoPE: llama.cpp rotates *adjacent* pairs for `llama`
//!   (`LLAMA_ROPE_TYPE_NORM` in `llama_model_rope_type`) and *half-split*
//!   pairs for `qwen3` (`LLAMA_ROPE_TYPE_NEOX`). Hugging Face weights are
//!   half-split, so a llama model's q/k rows are permuted (the inverse of
//!   what `anetrain convert` does to llama2.c weights: `LlamaModel.permute`
//!   in convert_hf_to_gguf.py); qwen3's are written as they are.
//! * Types: 1-D tensors (norms) stay F32; matrices take the requested type,
//!   a row not a multiple of 32 falls back to F16 for q8_0.
//! * Q8_0 (ggml `block_q8_0`): blocks of 32 values as an fp16 scale
//!   d = max|x|/127 and 32 int8 `round(x/d)` (half away from zero), the
//!   reciprocal taken from the f32 scale (`quantize_row_q8_0_ref`,
//!   gguf-py `quants.py` Q8_0).
//! * Tokenizer: byte-level BPE vocabularies as `gpt2` with merges and the
//!   pre-tokenizer llama.cpp names for the regex (`qwen2`, `llama-bpe`,
//!   `gpt-2`); SentencePiece-derived BPE (byte fallback, Llama 2 and the
//!   Stories models) as `llama`, with each token scored by the rank of the
//!   merge that makes it, so llama.cpp's score-ordered merging repeats the
//!   BPE merges. Token types as `get_vocab_base` assigns them; ids the
//!   tokenizer lacks up to `vocab_size` become `[PAD{i}]`, unused.

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::Value as Json;

use crate::data::tokenizer::Tokenizer;
use crate::model::config::{Arch, RopeScaling};
use crate::model::generation::GenerationConfig;
use crate::model::Model;

/// GGUF files start with these bytes, then the version.
const MAGIC: &[u8; 4] = b"GGUF";
const VERSION: u32 = 3;
/// The default alignment of tensor data (`general.alignment` unset).
pub const ALIGNMENT: usize = 32;
/// Values per Q8_0 block.
pub const Q8_0_BLOCK: usize = 32;

/// The tensor type of an export (`--type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExportType {
    F16,
    Bf16,
    Q8_0,
}

impl ExportType {
    pub fn parse(s: &str) -> Result<ExportType> {
        Ok(match s {
            "f16" => ExportType::F16,
            "bf16" => ExportType::Bf16,
            "q8_0" => ExportType::Q8_0,
            _ => bail!("--type must be f16, bf16 or q8_0 (got '{s}')"),
        })
    }

    /// `general.file_type` (llama.cpp `LlamaFileType`: MOSTLY_F16 = 1,
    /// MOSTLY_Q8_0 = 7, MOSTLY_BF16 = 32).
    fn file_type(self) -> u32 {
        match self {
            ExportType::F16 => 1,
            ExportType::Q8_0 => 7,
            ExportType::Bf16 => 32,
        }
    }

    fn tensor_type(self) -> TensorType {
        match self {
            ExportType::F16 => TensorType::F16,
            ExportType::Bf16 => TensorType::Bf16,
            ExportType::Q8_0 => TensorType::Q8_0,
        }
    }
}

/// A ggml tensor type and its id in the file (`GGMLQuantizationType`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorType {
    F32,
    F16,
    Bf16,
    Q8_0,
}

impl TensorType {
    pub fn id(self) -> u32 {
        match self {
            TensorType::F32 => 0,
            TensorType::F16 => 1,
            TensorType::Q8_0 => 8,
            TensorType::Bf16 => 30,
        }
    }

    /// Bytes of `n` values (`n` a multiple of the block for Q8_0).
    pub fn bytes(self, n: usize) -> usize {
        match self {
            TensorType::F32 => 4 * n,
            TensorType::F16 | TensorType::Bf16 => 2 * n,
            TensorType::Q8_0 => n / Q8_0_BLOCK * (2 + Q8_0_BLOCK),
        }
    }

    /// `values` in this type's bytes.
    fn encode(self, values: &[f32]) -> Vec<u8> {
        match self {
            TensorType::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
            TensorType::F16 => values
                .iter()
                .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                .collect(),
            TensorType::Bf16 => values
                .iter()
                .flat_map(|&v| half::bf16::from_f32(v).to_le_bytes())
                .collect(),
            TensorType::Q8_0 => quantize_q8_0(values),
        }
    }
}

/// Q8_0 blocks of `values` (a multiple of 32 long): per block an fp16
/// scale d = max|x| / 127 and 32 int8 values round(x / d).
pub fn quantize_q8_0(values: &[f32]) -> Vec<u8> {
    assert!(values.len().is_multiple_of(Q8_0_BLOCK));
    let mut out = Vec::with_capacity(TensorType::Q8_0.bytes(values.len()));
    for block in values.chunks_exact(Q8_0_BLOCK) {
        let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let inv = if d == 0.0 { 0.0 } else { 1.0 / d };
        out.extend_from_slice(&half::f16::from_f32(d).to_le_bytes());
        out.extend(block.iter().map(|&v| (v * inv).round() as i8 as u8));
    }
    out
}

/// A metadata value (`GGUFValueType`).
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    Str(String),
    Strs(Vec<String>),
    I32s(Vec<i32>),
    F32s(Vec<f32>),
}

impl MetaValue {
    /// The value's type id: UINT32 4, INT32 5, FLOAT32 6, BOOL 7,
    /// STRING 8, ARRAY 9.
    fn type_id(&self) -> u32 {
        match self {
            MetaValue::U32(_) => 4,
            MetaValue::I32(_) => 5,
            MetaValue::F32(_) => 6,
            MetaValue::Bool(_) => 7,
            MetaValue::Str(_) => 8,
            MetaValue::Strs(_) | MetaValue::I32s(_) | MetaValue::F32s(_) => 9,
        }
    }

    fn write(&self, w: &mut dyn Write) -> std::io::Result<()> {
        match self {
            MetaValue::U32(v) => w.write_all(&v.to_le_bytes()),
            MetaValue::I32(v) => w.write_all(&v.to_le_bytes()),
            MetaValue::F32(v) => w.write_all(&v.to_le_bytes()),
            MetaValue::Bool(v) => w.write_all(&[*v as u8]),
            MetaValue::Str(s) => write_str(w, s),
            MetaValue::Strs(v) => {
                w.write_all(&8u32.to_le_bytes())?;
                w.write_all(&(v.len() as u64).to_le_bytes())?;
                v.iter().try_for_each(|s| write_str(w, s))
            }
            MetaValue::I32s(v) => {
                w.write_all(&5u32.to_le_bytes())?;
                w.write_all(&(v.len() as u64).to_le_bytes())?;
                v.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
            }
            MetaValue::F32s(v) => {
                w.write_all(&6u32.to_le_bytes())?;
                w.write_all(&(v.len() as u64).to_le_bytes())?;
                v.iter().try_for_each(|x| w.write_all(&x.to_le_bytes()))
            }
        }
    }
}

fn write_str(w: &mut dyn Write, s: &str) -> std::io::Result<()> {
    w.write_all(&(s.len() as u64).to_le_bytes())?;
    w.write_all(s.as_bytes())
}

/// A tensor to write: its GGUF name, its shape as the model holds it
/// (rows first), its type, and where its f32 values come from.
struct TensorPlan<'a> {
    name: String,
    shape: Vec<usize>,
    ty: TensorType,
    values: std::borrow::Cow<'a, [f32]>,
}

/// What an export wrote: tensor count and types, for the summary line.
#[derive(Debug)]
pub struct Written {
    pub tensors: usize,
    pub bytes: u64,
    pub metadata: usize,
}

/// Writes `model` (adapters already merged) with `tok` and `gen` as a GGUF
/// file at `out`, atomically (nothing is left at `out` or beside it on
/// failure, a full disk included).
pub fn export(
    model: &Model,
    tok: &Tokenizer,
    gen: Option<&GenerationConfig>,
    ty: ExportType,
    name: &str,
    out: &Path,
) -> Result<Written> {
    if model.lora.is_some() {
        bail!("merge the adapter before exporting");
    }
    if let (Arch::Phi3, Some(w)) = (model.cfg.arch, model.cfg.sliding_window) {
        // llama.cpp's phi3 loader turns the window off ("Phi SWA is
        // currently disabled", llama-model.cpp), so its logits would part
        // from this model's past the window.
        bail!(
            "GGUF export of a phi3 model with an attention window ({w} positions): llama.cpp's phi3 attends without one, so the file would compute another model past {w} tokens"
        );
    }
    // Phi-3's LongRoPE is written (its factors as tensors); any other
    // scaling is not yet.
    let phi_longrope = model.cfg.arch == Arch::Phi3
        && matches!(model.cfg.rope_scaling, RopeScaling::Longrope { .. });
    if !(model.cfg.rope_scaling.is_default() || phi_longrope) {
        // llama.cpp wants the scaled frequencies as a `rope_freqs` tensor
        // (or scaling keys), not written here yet.
        bail!(
            "GGUF export of a model with scaled RoPE ({}) is not built yet; the model directory itself loads in transformers and mlx-lm",
            model.cfg.rope_scaling.hf_keys()["rope_type"]
        );
    }
    let c = &model.cfg;
    if c.arch == Arch::Gemma3 {
        // llama.cpp's gemma3 fixes what the file does not carry: a full
        // layer every sixth, the windowed layers' RoPE base 10000, scores
        // scaled by 1/√head_dim (models other than the 27B).
        let sixth: Vec<usize> = (5..c.num_hidden_layers).step_by(6).collect();
        let scalar = c.score_scale().powi(-2);
        if c.full_attention_layers != sixth
            || c.local_rope_theta != Some(10000.0)
            || (scalar - c.head_dim as f64).abs() > 1e-6 * scalar
        {
            bail!(
                "GGUF export of this Gemma 3 model: llama.cpp's gemma3 assumes a full-attention layer every sixth, a windowed RoPE base of 10000 and query_pre_attn_scalar = head_dim, and this model differs"
            );
        }
    }
    if c.arch == Arch::Gemma2 {
        // llama.cpp's gemma2 fixes what the file does not carry: windowed
        // and full layers in turn from a windowed one, scores scaled by
        // 1/√head_dim (models other than the 27B), both soft caps on
        // (50 and 30 where the file has no key).
        let odd: Vec<usize> = (1..c.num_hidden_layers).step_by(2).collect();
        let scalar = c.score_scale().powi(-2);
        if c.sliding_window.is_some() && c.full_attention_layers != odd
            || (scalar - c.head_dim as f64).abs() > 1e-6 * scalar
            || c.scales.attention_cap.is_none()
            || c.scales.logits_cap.is_none()
        {
            bail!(
                "GGUF export of this Gemma 2 model: llama.cpp's gemma2 assumes windowed and full layers in turn, query_pre_attn_scalar = head_dim and both soft caps, and this model differs"
            );
        }
    }
    let every_fourth: Vec<usize> = (3..c.num_hidden_layers).step_by(4).collect();
    if c.arch == Arch::SmolLM3 && c.no_rope_layers != every_fourth {
        // llama.cpp's smollm3 leaves RoPE out of every fourth layer, a
        // step it does not read from the file (`n_no_rope_layer_step`).
        bail!(
            "GGUF export of a SmolLM3 model whose layers without RoPE are {:?}: llama.cpp leaves RoPE out of every fourth layer only",
            c.no_rope_layers
        );
    }
    model.check_finite("export")?;
    let mut meta = model_metadata(model, ty, name);
    meta.extend(tokenizer_metadata(tok, model, gen)?);
    let tensors = tensor_plan(model, ty)?;
    // Offsets of each tensor's data, from the start of the data section.
    let mut offsets = Vec::with_capacity(tensors.len());
    let mut at = 0usize;
    for t in &tensors {
        offsets.push(at);
        at = (at + t.ty.bytes(t.values.len())).next_multiple_of(ALIGNMENT);
    }
    // The header (metadata and tensor descriptors: a few MB for a 150k
    // vocabulary) is assembled first; the tensors are then streamed.
    let mut head = vec![];
    head.extend_from_slice(MAGIC);
    head.extend_from_slice(&VERSION.to_le_bytes());
    head.extend_from_slice(&(tensors.len() as u64).to_le_bytes());
    head.extend_from_slice(&(meta.len() as u64).to_le_bytes());
    for (key, value) in &meta {
        write_str(&mut head, key)?;
        head.extend_from_slice(&value.type_id().to_le_bytes());
        value.write(&mut head)?;
    }
    for (t, off) in tensors.iter().zip(&offsets) {
        write_str(&mut head, &t.name)?;
        head.extend_from_slice(&(t.shape.len() as u32).to_le_bytes());
        // ne[0] is the innermost (fastest-varying) dimension.
        for &d in t.shape.iter().rev() {
            head.extend_from_slice(&(d as u64).to_le_bytes());
        }
        head.extend_from_slice(&t.ty.id().to_le_bytes());
        head.extend_from_slice(&(*off as u64).to_le_bytes());
    }
    head.resize(head.len().next_multiple_of(ALIGNMENT), 0);
    crate::util::fsutil::write_atomic_with(out, |w| {
        w.write_all(&head)?;
        let mut at = 0usize;
        for (t, off) in tensors.iter().zip(&offsets) {
            debug_assert_eq!(at, *off);
            let bytes = t.ty.encode(&t.values);
            w.write_all(&bytes)?;
            at += bytes.len();
            let padded = at.next_multiple_of(ALIGNMENT);
            w.write_all(&vec![0u8; padded - at])?;
            at = padded;
        }
        Ok(())
    })?;
    Ok(Written {
        tensors: tensors.len(),
        bytes: std::fs::metadata(out).map(|m| m.len()).unwrap_or(0),
        metadata: meta.len(),
    })
}

/// The architecture's name in GGUF.
fn arch_name(arch: Arch) -> &'static str {
    match arch {
        // llama.cpp's converter writes Mistral (Ministral) as `llama`.
        Arch::Llama | Arch::Mistral | Arch::Ministral => "llama",
        Arch::Qwen3 => "qwen3",
        Arch::Qwen2 => "qwen2",
        Arch::Granite => "granite",
        Arch::SmolLM3 => "smollm3",
        Arch::Gemma3 => "gemma3",
        Arch::Gemma2 => "gemma2",
        Arch::Olmo2 => "olmo2",
        Arch::Phi3 => "phi3",
    }
}

/// Whether llama.cpp's architecture rotates adjacent pairs, so q and k
/// rows are permuted from Hugging Face's half-split order (its
/// converter's `LlamaModel.permute`, which Mistral and Granite inherit).
fn rotates_adjacent_pairs(arch: Arch) -> bool {
    match arch {
        Arch::Llama | Arch::Mistral | Arch::Ministral | Arch::Granite | Arch::SmolLM3 => true,
        Arch::Qwen3 | Arch::Qwen2 | Arch::Gemma2 | Arch::Gemma3 | Arch::Olmo2 | Arch::Phi3 => false,
    }
}

fn model_metadata(model: &Model, ty: ExportType, name: &str) -> Vec<(String, MetaValue)> {
    let c = &model.cfg;
    let a = arch_name(c.arch);
    let u = |v: usize| MetaValue::U32(v as u32);
    let f = |v: f64| MetaValue::F32(v as f32);
    let mut meta = vec![
        ("general.architecture".into(), MetaValue::Str(a.into())),
        ("general.name".into(), MetaValue::Str(name.into())),
        ("general.file_type".into(), MetaValue::U32(ty.file_type())),
        // GGML_QUANT_VERSION.
        ("general.quantization_version".into(), MetaValue::U32(2)),
        (format!("{a}.vocab_size"), u(c.vocab_size)),
        (format!("{a}.context_length"), u(c.max_position_embeddings)),
        (format!("{a}.embedding_length"), u(c.hidden_size)),
        (format!("{a}.block_count"), u(c.num_hidden_layers)),
        (format!("{a}.feed_forward_length"), u(c.intermediate_size)),
        (
            format!("{a}.attention.head_count"),
            u(c.num_attention_heads),
        ),
        (
            format!("{a}.attention.head_count_kv"),
            u(c.num_key_value_heads),
        ),
        (format!("{a}.attention.key_length"), u(c.head_dim)),
        (format!("{a}.attention.value_length"), u(c.head_dim)),
        (format!("{a}.rope.dimension_count"), u(c.rotary_dim())),
        (
            format!("{a}.rope.freq_base"),
            MetaValue::F32(c.rope_theta as f32),
        ),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            MetaValue::F32(c.rms_norm_eps as f32),
        ),
    ];
    if c.arch.is_gemma() {
        // llama.cpp's Gemma2Model and Gemma3Model keys (the norms are
        // written as the scale 1 + w they apply, as its converter adds 1).
        if let Some(w) = c.sliding_window {
            meta.push((format!("{a}.attention.sliding_window"), u(w)));
        }
    }
    for (key, cap) in [
        ("attn_logit_softcapping", c.scales.attention_cap),
        ("final_logit_softcapping", c.scales.logits_cap),
    ] {
        if let Some(cap) = cap {
            meta.push((format!("{a}.{key}"), f(cap)));
        }
    }
    if let RopeScaling::Longrope {
        original_max_position_embeddings,
        attention_factor,
        ..
    } = c.rope_scaling
    {
        // llama.cpp's Phi3MiniModel keys; the factors are tensors
        // (`rope_factors_long`, `rope_factors_short`), and llama.cpp takes
        // the long ones when its context passes the original one.
        meta.extend([
            (format!("{a}.rope.scaling.attn_factor"), f(attention_factor)),
            (
                format!("{a}.rope.scaling.original_context_length"),
                u(original_max_position_embeddings),
            ),
        ]);
    }
    if c.arch == Arch::Granite {
        // llama.cpp's GraniteModel keys.
        meta.extend([
            (format!("{a}.embedding_scale"), f(c.scales.embedding)),
            (format!("{a}.residual_scale"), f(c.scales.residual)),
            (format!("{a}.attention.scale"), f(c.score_scale())),
            (format!("{a}.logit_scale"), f(c.scales.logits)),
        ]);
    }
    meta
}

/// GGUF names of a Gemma or OLMo 2 layer's norms where they differ from
/// [`LAYER_TENSORS`] (their `post_attention_layernorm` follows the
/// attention; the MLP's norms are `pre_`/`post_feedforward_layernorm`).
const GEMMA_NORMS: [(&str, &str); 3] = [
    (
        "post_attention_layernorm.weight",
        "post_attention_norm.weight",
    ),
    ("pre_feedforward_layernorm.weight", "ffn_norm.weight"),
    ("post_feedforward_layernorm.weight", "post_ffw_norm.weight"),
];

/// GGUF names of a layer's tensors, by the Hugging Face suffix.
const LAYER_TENSORS: [(&str, &str); 16] = [
    ("input_layernorm.weight", "attn_norm.weight"),
    // Phi-3's fused projections (llama.cpp splits `ffn_up`'s rows into
    // gate and up as Hugging Face stacks them).
    ("self_attn.qkv_proj.weight", "attn_qkv.weight"),
    ("mlp.gate_up_proj.weight", "ffn_up.weight"),
    ("self_attn.q_proj.weight", "attn_q.weight"),
    ("self_attn.k_proj.weight", "attn_k.weight"),
    ("self_attn.v_proj.weight", "attn_v.weight"),
    ("self_attn.o_proj.weight", "attn_output.weight"),
    ("self_attn.q_proj.bias", "attn_q.bias"),
    ("self_attn.k_proj.bias", "attn_k.bias"),
    ("self_attn.v_proj.bias", "attn_v.bias"),
    ("self_attn.q_norm.weight", "attn_q_norm.weight"),
    ("self_attn.k_norm.weight", "attn_k_norm.weight"),
    ("post_attention_layernorm.weight", "ffn_norm.weight"),
    ("mlp.gate_proj.weight", "ffn_gate.weight"),
    ("mlp.up_proj.weight", "ffn_up.weight"),
    ("mlp.down_proj.weight", "ffn_down.weight"),
];

/// The GGUF name of a Hugging Face tensor name in a model of `arch`.
pub fn gguf_name(hf: &str, arch: Arch) -> Option<String> {
    match hf {
        "model.embed_tokens.weight" => return Some("token_embd.weight".into()),
        "model.norm.weight" => return Some("output_norm.weight".into()),
        "lm_head.weight" => return Some("output.weight".into()),
        _ => {}
    }
    let rest = hf.strip_prefix("model.layers.")?;
    let (layer, suffix) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let gemma = match arch {
        Arch::Gemma2 | Arch::Gemma3 | Arch::Olmo2 => &GEMMA_NORMS[..],
        _ => &[],
    };
    let (_, g) = gemma
        .iter()
        .chain(&LAYER_TENSORS)
        .find(|(h, _)| *h == suffix)?;
    Some(format!("blk.{layer}.{g}"))
}

fn tensor_plan(model: &Model, ty: ExportType) -> Result<Vec<TensorPlan<'_>>> {
    let c = &model.cfg;
    let mut plan = Vec::with_capacity(model.params.len());
    // As Hugging Face stores them (Phi-3's projections fused), with the
    // values training holds (Gemma's norms as the scale 1 + w they apply,
    // as llama.cpp's converter writes them).
    // A multimodal checkpoint's text model alone (llama.cpp keeps a vision
    // tower in a file of its own, `mmproj`).
    let prefix = c.tensor_prefix();
    for mut t in model.hf_tensors().into_iter().filter(|t| t.extra.is_none()) {
        t.name = t.name.strip_prefix(prefix).unwrap_or(&t.name).to_string();
        let mut values = match t.parts[..] {
            [id] => std::borrow::Cow::Borrowed(model.params[id].data.as_slice()),
            _ => std::borrow::Cow::Owned(
                t.parts
                    .iter()
                    .flat_map(|&id| model.params[id].data.iter().copied())
                    .collect(),
            ),
        };
        let name = gguf_name(&t.name, c.arch)
            .with_context(|| format!("no GGUF name for the tensor '{}'", t.name))?;
        // llama.cpp's `llama` rotates adjacent pairs: permute the q and k
        // rows from the half-split order Hugging Face weights have.
        if rotates_adjacent_pairs(c.arch) {
            let heads = if t.name.ends_with("q_proj.weight") {
                Some(c.num_attention_heads)
            } else if t.name.ends_with("k_proj.weight") {
                Some(c.num_key_value_heads)
            } else {
                None
            };
            if let Some(h) = heads {
                values = std::borrow::Cow::Owned(half_split_to_adjacent(&values, h, t.shape[1]));
            }
        }
        let kind = match t.shape.len() {
            1 => TensorType::F32,
            _ => match ty.tensor_type() {
                TensorType::Q8_0 if !t.shape[t.shape.len() - 1].is_multiple_of(Q8_0_BLOCK) => {
                    TensorType::F16
                }
                k => k,
            },
        };
        plan.push(TensorPlan {
            name,
            shape: t.shape,
            ty: kind,
            values,
        });
    }
    if let RopeScaling::Longrope {
        short_factor,
        long_factor,
        ..
    } = &c.rope_scaling
    {
        for (name, factors) in [
            ("rope_factors_long.weight", long_factor),
            ("rope_factors_short.weight", short_factor),
        ] {
            plan.push(TensorPlan {
                name: name.into(),
                shape: vec![factors.len()],
                ty: TensorType::F32,
                values: std::borrow::Cow::Owned(factors.iter().map(|&v| v as f32).collect()),
            });
        }
    }
    Ok(plan)
}

/// Rows of a `[heads·d, cols]` projection moved from half-split RoPE order
/// (row j pairs with row j + d/2 in each head) to adjacent pairs (row 2j
/// with 2j + 1): new row 2j + s of a head is old row s·d/2 + j.
pub fn half_split_to_adjacent(w: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    let d = w.len() / cols / heads;
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for j in 0..d / 2 {
            for s in 0..2 {
                let from = (h * d + s * d / 2 + j) * cols;
                let to = (h * d + 2 * j + s) * cols;
                out[to..to + cols].copy_from_slice(&w[from..from + cols]);
            }
        }
    }
    out
}

/// Token types (`gguf.TokenType`).
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

/// The pre-tokenizer regexes llama.cpp knows, by the name it gives them
/// (`get_vocab_base_pre`): Qwen2/Qwen3 and Llama 3 split digits
/// differently, which is how they are told apart.
const PRE_TOKENIZERS: [(&str, &str); 2] = [
    ("qwen2", r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"),
    ("llama-bpe", r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"),
];

fn tokenizer_metadata(
    tok: &Tokenizer,
    model: &Model,
    gen: Option<&GenerationConfig>,
) -> Result<Vec<(String, MetaValue)>> {
    let path = &tok.path;
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read '{}'", path.display()))?;
    let json: Json =
        serde_json::from_str(&text).with_context(|| format!("'{}' is not JSON", path.display()))?;
    let m = &json["model"];
    if m["type"] != "BPE" {
        bail!(
            "'{}': a {} tokenizer cannot be exported (anetrain exports BPE tokenizers: byte-level as llama.cpp's gpt2, byte-fallback as its llama)",
            path.display(),
            m["type"]
        );
    }
    let byte_fallback = m["byte_fallback"].as_bool().unwrap_or(false);
    let n = model.cfg.vocab_size;
    let (tokens, types) = vocabulary(&json, path, n, byte_fallback)?;
    let merges = merges_of(m);
    let mut out: Vec<(String, MetaValue)> = vec![];
    if byte_fallback {
        // Score = minus the rank of the merge that makes the token, so
        // llama.cpp's highest-score-first merging applies BPE's order.
        let mut scores = vec![0f32; n];
        for (rank, merge) in merges.iter().enumerate() {
            let made: String = merge.split(' ').collect();
            if let Some(id) = tok.token_id(&made).map(|i| i as usize).filter(|&i| i < n) {
                if scores[id] == 0.0 {
                    scores[id] = -(rank as f32) - 1.0;
                }
            }
        }
        out.push((
            "tokenizer.ggml.model".into(),
            MetaValue::Str("llama".into()),
        ));
        out.push((
            "tokenizer.ggml.pre".into(),
            MetaValue::Str("default".into()),
        ));
        out.push(("tokenizer.ggml.scores".into(), MetaValue::F32s(scores)));
    } else {
        let pre = pre_tokenizer_name(&json["pre_tokenizer"]).with_context(|| {
            format!(
                "'{}': its pre-tokenizer is not one llama.cpp knows by name (GPT-2, Qwen2/3 or Llama 3 byte-level BPE)",
                path.display()
            )
        })?;
        out.push(("tokenizer.ggml.model".into(), MetaValue::Str("gpt2".into())));
        out.push(("tokenizer.ggml.pre".into(), MetaValue::Str(pre.into())));
    }
    out.push(("tokenizer.ggml.tokens".into(), MetaValue::Strs(tokens)));
    out.push(("tokenizer.ggml.token_type".into(), MetaValue::I32s(types)));
    if !merges.is_empty() && !byte_fallback {
        out.push(("tokenizer.ggml.merges".into(), MetaValue::Strs(merges)));
    }
    out.extend(special_tokens(tok, model, gen, byte_fallback));
    Ok(out)
}

/// Every id's token and its type (normal, byte, control for special added
/// tokens, user-defined), ids no token names padded as `[PAD<id>]`.
fn vocabulary(
    json: &Json,
    path: &Path,
    n: usize,
    byte_fallback: bool,
) -> Result<(Vec<String>, Vec<i32>)> {
    let m = &json["model"];
    let mut tokens: Vec<Option<String>> = vec![None; n];
    let mut types = vec![UNUSED; n];
    for (t, id) in m["vocab"].as_object().into_iter().flatten() {
        if let Some(id) = id.as_u64().map(|i| i as usize).filter(|&i| i < n) {
            tokens[id] = Some(t.clone());
            types[id] = if byte_fallback && is_byte_token(t) {
                BYTE
            } else {
                NORMAL
            };
        }
    }
    for a in json["added_tokens"].as_array().into_iter().flatten() {
        let (Some(id), Some(content)) = (a["id"].as_u64(), a["content"].as_str()) else {
            continue;
        };
        let id = id as usize;
        if id >= n {
            bail!(
                "'{}': added token '{content}' has id {id}, beyond the model's vocab_size {n}",
                path.display()
            );
        }
        tokens[id] = Some(content.to_string());
        types[id] = match a["special"].as_bool().unwrap_or(false) {
            true => CONTROL,
            false => USER_DEFINED,
        };
    }
    let tokens = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.unwrap_or_else(|| format!("[PAD{i}]")))
        .collect();
    Ok((tokens, types))
}

/// The merges, as "a b" strings (tokenizer.json writes them as strings or
/// as pairs).
fn merges_of(m: &Json) -> Vec<String> {
    m["merges"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| match v {
            Json::String(s) => Some(s.clone()),
            Json::Array(pair) => Some(format!(
                "{} {}",
                pair.first()?.as_str()?,
                pair.get(1)?.as_str()?
            )),
            _ => None,
        })
        .collect()
}

/// The special token ids (the tokenizer's, else the generation config's,
/// else config.json's), whether to add BOS, and the chat template.
fn special_tokens(
    tok: &Tokenizer,
    model: &Model,
    gen: Option<&GenerationConfig>,
    byte_fallback: bool,
) -> Vec<(String, MetaValue)> {
    let mut out = vec![];
    let id_of = |name: &str| tok.special_token(name).and_then(|t| tok.token_id(t));
    let config_id = |v: &Option<Json>| match v {
        Some(Json::Array(a)) => a.first().and_then(|x| x.as_u64()).map(|x| x as u32),
        Some(x) => x.as_u64().map(|x| x as u32),
        None => None,
    };
    let bos = id_of("bos_token")
        .or(gen.and_then(|g| g.bos_token_id))
        .or(config_id(&model.cfg.bos_token_id));
    let eos = id_of("eos_token")
        .or(gen.and_then(|g| g.eos_token_ids.first().copied()))
        .or(config_id(&model.cfg.eos_token_id));
    if let Some(b) = bos {
        out.push(("tokenizer.ggml.bos_token_id".into(), MetaValue::U32(b)));
    }
    if let Some(e) = eos {
        out.push(("tokenizer.ggml.eos_token_id".into(), MetaValue::U32(e)));
    }
    if let Some(p) = id_of("pad_token") {
        out.push(("tokenizer.ggml.padding_token_id".into(), MetaValue::U32(p)));
    }
    let add_bos = tok.config_flag("add_bos_token").unwrap_or(byte_fallback);
    out.push((
        "tokenizer.ggml.add_bos_token".into(),
        MetaValue::Bool(add_bos),
    ));
    if let Some(chat) = &tok.chat {
        out.push((
            "tokenizer.chat_template".into(),
            MetaValue::Str(chat.source().to_string()),
        ));
    }
    out
}

fn is_byte_token(t: &str) -> bool {
    t.len() == 6
        && t.starts_with("<0x")
        && t.ends_with('>')
        && t[3..5].chars().all(|c| c.is_ascii_hexdigit())
}

/// llama.cpp's name for a byte-level BPE pre-tokenizer: a `ByteLevel`
/// with its own (GPT-2) regex, or a `Split` whose regex is Qwen2's or
/// Llama 3's followed by a `ByteLevel` without one.
fn pre_tokenizer_name(pre: &Json) -> Option<&'static str> {
    match pre["type"].as_str()? {
        "ByteLevel" if pre["use_regex"].as_bool().unwrap_or(true) => Some("gpt-2"),
        "Sequence" => {
            let parts = pre["pretokenizers"].as_array()?;
            let mut name = None;
            for p in parts {
                match p["type"].as_str()? {
                    "Split" => {
                        let regex = p["pattern"]["Regex"].as_str()?;
                        name = PRE_TOKENIZERS
                            .iter()
                            .find(|(_, marker)| regex.contains(marker))
                            .map(|(n, _)| *n);
                        name?;
                    }
                    "ByteLevel" if p["use_regex"].as_bool().unwrap_or(true) => {
                        name = name.or(Some("gpt-2"))
                    }
                    "ByteLevel" => {}
                    _ => return None,
                }
            }
            name
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_blocks_hold_a_scale_and_rounded_quotients() {
        let mut x: Vec<f32> = (0..64).map(|i| (i as f32 - 20.0) * 0.37).collect();
        x[40] = -100.0;
        let q = quantize_q8_0(&x);
        assert_eq!(q.len(), 2 * 34);
        for (b, block) in x.chunks(32).enumerate() {
            let bytes = &q[b * 34..(b + 1) * 34];
            let d = half::f16::from_le_bytes([bytes[0], bytes[1]]).to_f32();
            let amax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            assert!((d - amax / 127.0).abs() <= amax / 127.0 * 1e-3);
            for (i, &v) in block.iter().enumerate() {
                let back = bytes[2 + i] as i8 as f32 * d;
                assert!((back - v).abs() <= d * 0.51, "{v} -> {back}");
            }
        }
        // A block of zeros has scale 0 and quotients 0.
        assert!(quantize_q8_0(&[0.0; 32]).iter().all(|&b| b == 0));
    }

    #[test]
    fn permuting_to_adjacent_pairs_moves_whole_rows() {
        // 2 heads of d = 4, 1 column: rows [0..8).
        let w: Vec<f32> = (0..8).map(|i| i as f32).collect();
        assert_eq!(
            half_split_to_adjacent(&w, 2, 1),
            vec![0.0, 2.0, 1.0, 3.0, 4.0, 6.0, 5.0, 7.0]
        );
    }

    #[test]
    fn hugging_face_names_map_to_llama_cpp_names() {
        assert_eq!(
            gguf_name("model.embed_tokens.weight", Arch::Qwen3).unwrap(),
            "token_embd.weight"
        );
        assert_eq!(
            gguf_name("model.layers.11.self_attn.k_norm.weight", Arch::Qwen3).unwrap(),
            "blk.11.attn_k_norm.weight"
        );
        assert_eq!(
            gguf_name("model.layers.0.mlp.down_proj.weight", Arch::Qwen3).unwrap(),
            "blk.0.ffn_down.weight"
        );
        assert_eq!(
            gguf_name("model.layers.x.mlp.down_proj.weight", Arch::Qwen3),
            None
        );
        // Gemma's norm after the attention, and its MLP's two.
        let gemma = |n: &str| gguf_name(&format!("model.layers.2.{n}.weight"), Arch::Gemma3);
        assert_eq!(
            [
                "post_attention_layernorm",
                "pre_feedforward_layernorm",
                "post_feedforward_layernorm"
            ]
            .map(|n| gemma(n).unwrap()),
            [
                "blk.2.post_attention_norm.weight",
                "blk.2.ffn_norm.weight",
                "blk.2.post_ffw_norm.weight"
            ]
        );
    }
}
