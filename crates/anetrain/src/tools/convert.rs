//! Import of llama2.c checkpoints (the `stories15M/42M/110M.bin` format):
//! a header of seven int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads,
//! vocab_size — negative when the classifier is stored separately —,
//! seq_len), then f32 tensors grouped by kind across layers.
//!
//! llama2.c rotates adjacent pairs (2i, 2i+1); Hugging Face rotates halves
//! (i, i + HD/2). The query and key rows are permuted on import — within
//! each head, row 2i+t moves to t·HD/2 + i — so the model computes the same
//! function with Hugging Face's RoPE, exactly as `transformers`'
//! conversion script does.

use std::path::Path;

use anyhow::{bail, Context, Result};

use crate::model::config::{Arch, ModelConfig};
use crate::model::{Model, Projection};

/// Moves rows of a `[heads·HD, cols]` matrix from interleaved to half-split order.
fn permute_rope_rows(w: &[f32], heads: usize, hd: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; w.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for t in 0..2 {
                let src = h * hd + 2 * i + t;
                let dst = h * hd + t * (hd / 2) + i;
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Reads a llama2.c checkpoint into a Hugging Face-layout model: the
/// header's configuration, the file's size against it, then the tensors.
pub fn load_llama2c(path: &Path) -> Result<Model> {
    use std::io::Read;
    let what = path.display().to_string();
    let mut file = std::fs::File::open(path).with_context(|| format!("cannot read '{what}'"))?;
    let len = file
        .metadata()
        .with_context(|| format!("cannot read '{what}'"))?
        .len();
    if !file.metadata().map(|m| m.is_file()).unwrap_or(false) {
        bail!("'{what}' is not a file");
    }
    let not_llama2c = |why: String| anyhow::anyhow!("'{what}' is not a llama2.c checkpoint: {why}");
    let mut header = [0u8; 28];
    if len < 28 || file.read_exact(&mut header).is_err() {
        return Err(not_llama2c(format!(
            "{len} bytes, shorter than the 28-byte header"
        )));
    }
    let cfg = header_config(&header).map_err(not_llama2c)?;
    let sizes = tensor_sizes(&cfg);
    let need = 28 + 4 * sizes.iter().sum::<usize>() as u64;
    if len != need {
        return Err(not_llama2c(format!(
            "the header (dim {}, {} layers, vocab {}) implies {need} bytes, the file holds {len}{}",
            cfg.hidden_size,
            cfg.num_hidden_layers,
            cfg.vocab_size,
            if len < need { " (truncated?)" } else { "" }
        )));
    }
    let bytes = std::fs::read(path).with_context(|| format!("cannot read '{what}'"))?;
    model_from_tensors(&cfg, &bytes, &sizes, &what)
}

/// The model configuration a llama2.c header (seven little-endian i32:
/// dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size — negative
/// for an untied classifier — and seq_len) describes, or why it is not one.
fn header_config(header: &[u8; 28]) -> std::result::Result<ModelConfig, String> {
    let hdr: Vec<i64> = header
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as i64)
        .collect();
    let (dim, hidden, layers, heads, kv_heads, vocab_signed, seq_len) =
        (hdr[0], hdr[1], hdr[2], hdr[3], hdr[4], hdr[5], hdr[6]);
    // Sizes any llama2.c model has (the largest, Llama-2 70B, has dim
    // 8192, 80 layers, 64 heads).
    let sane = [
        ("dim", dim, 1 << 16),
        ("hidden_dim", hidden, 1 << 18),
        ("n_layers", layers, 1 << 10),
        ("n_heads", heads, 1 << 10),
        ("n_kv_heads", kv_heads, 1 << 10),
        ("vocab_size", vocab_signed.abs(), 1 << 24),
        ("seq_len", seq_len, 1 << 20),
    ];
    if let Some((name, v, max)) = sane.iter().find(|(_, v, max)| *v <= 0 || v > max) {
        return Err(format!("header field {name} is {v} (expected 1 to {max})"));
    }
    if dim % heads != 0 || heads % kv_heads != 0 {
        return Err(format!(
            "dim {dim}, n_heads {heads} and n_kv_heads {kv_heads} do not divide"
        ));
    }
    let shared = vocab_signed > 0;
    let cfg = ModelConfig {
        arch: Arch::Llama,
        hidden_size: dim as usize,
        intermediate_size: hidden as usize,
        num_hidden_layers: layers as usize,
        num_attention_heads: heads as usize,
        num_key_value_heads: kv_heads as usize,
        head_dim: (dim / heads) as usize,
        vocab_size: vocab_signed.unsigned_abs() as usize,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: shared,
        max_position_embeddings: seq_len as usize,
        qk_norm: false,
        // llama2.c models use the Llama SentencePiece ids.
        bos_token_id: Some(1.into()),
        eos_token_id: Some(2.into()),
        pad_token_id: None,
        quantization: None,
        scales: Default::default(),
        sliding_window: None,
        no_rope_layers: vec![],
        full_attention_layers: vec![],
        local_rope_theta: None,
        rope_scaling: Default::default(),
        partial_rotary: None,
        multimodal: None,
    };
    cfg.validate().map_err(|e| e.to_string())?;
    Ok(cfg)
}

/// Elements of the checkpoint's tensors in file order: embedding, the
/// layers' norms and projections (stacked), the final norm, the RoPE
/// tables (unused), and the classifier when it is not tied.
fn tensor_sizes(cfg: &ModelConfig) -> [usize; 14] {
    let (d, h, l, v) = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_hidden_layers,
        cfg.vocab_size,
    );
    let (q, kv) = (cfg.q_dim(), cfg.kv_dim());
    let half_hd = cfg.head_dim / 2;
    [
        v * d,
        l * d,
        l * d * q,
        l * d * kv,
        l * d * kv,
        l * q * d,
        l * d,
        l * h * d,
        l * d * h,
        l * h * d,
        d,
        cfg.max_position_embeddings * half_hd,
        cfg.max_position_embeddings * half_hd,
        if cfg.tie_word_embeddings { 0 } else { v * d },
    ]
}

/// The model from a checkpoint's bytes (`sizes` as [`tensor_sizes`]),
/// q/k rows permuted to half-split RoPE; a non-finite value is refused.
fn model_from_tensors(
    cfg: &ModelConfig,
    bytes: &[u8],
    sizes: &[usize; 14],
    what: &str,
) -> Result<Model> {
    let (d, h, l) = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_hidden_layers,
    );
    let (q, kv, hd) = (cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
    let mut at = 28;
    let mut next = |n: usize| -> Vec<f32> {
        let v = bytes[at..at + 4 * n]
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        at += 4 * n;
        v
    };
    let embed = next(sizes[0]);
    let per = |all: &[f32], i: usize, n: usize| all[i * n..(i + 1) * n].to_vec();
    let (rms_att, wq, wk, wv, wo) = (
        next(sizes[1]),
        next(sizes[2]),
        next(sizes[3]),
        next(sizes[4]),
        next(sizes[5]),
    );
    let (rms_ffn, w1, w2, w3) = (
        next(sizes[6]),
        next(sizes[7]),
        next(sizes[8]),
        next(sizes[9]),
    );
    let final_norm = next(sizes[10]);
    next(sizes[11]);
    next(sizes[12]);
    let wcls = next(sizes[13]);
    let mut m = Model::init(cfg, 0)?;
    m.params[m.embed].data = embed;
    for i in 0..l {
        let ids = m.layers[i];
        m.params[ids.mixer_norm.expect("a Llama layer's norms")].data = per(&rms_att, i, d);
        m.params[Projection::Q.base(&ids)].data =
            permute_rope_rows(&per(&wq, i, q * d), cfg.num_attention_heads, hd, d);
        m.params[Projection::K.base(&ids)].data =
            permute_rope_rows(&per(&wk, i, kv * d), cfg.num_key_value_heads, hd, d);
        m.params[Projection::V.base(&ids)].data = per(&wv, i, kv * d);
        m.params[Projection::O.base(&ids)].data = per(&wo, i, d * q);
        m.params[ids.mlp_norm.expect("a Llama layer's norms")].data = per(&rms_ffn, i, d);
        m.params[Projection::Gate.base(&ids)].data = per(&w1, i, h * d);
        m.params[Projection::Down.base(&ids)].data = per(&w2, i, d * h);
        m.params[Projection::Up.base(&ids)].data = per(&w3, i, h * d);
    }
    m.params[m.final_norm].data = final_norm;
    if let Some(head) = m.lm_head {
        m.params[head].data = wcls;
    }
    for p in &m.params {
        if let Some(i) = p.data.iter().position(|x| !x.is_finite()) {
            bail!(
                "'{what}': tensor '{}' holds a non-finite value at index {i}",
                p.name
            );
        }
    }
    Ok(m)
}
