//! `anetrain quantize`: a model directory written in MLX's affine format,
//! as `mlx_lm.convert -q` writes it (mlx-lm 0.32 `convert.py`,
//! `utils.py` `quantize_model`): every matrix whose input width is a
//! multiple of the group size (the projections, the embedding, an untied
//! head) as packed words, scales and biases; norms and narrower matrices
//! as they are; `config.json` with `quantization` and
//! `quantization_config`. The words, scales and biases equal mlx-lm's for
//! the same weights (`tests/quantized.rs`), so mlx-lm loads the result and
//! so does anetrain, as a LoRA base.
//!
//! The source is read memory-mapped, one tensor at a time; each tensor's
//! pages are given back to the kernel once it is quantized, so a base
//! larger than the machine's memory can be converted.

use std::path::Path;

use anyhow::{bail, Context, Result};
use safetensors::tensor::{Dtype, TensorView};

use crate::model::params::StoredDtype;
use crate::model::quant::{encode, quantize, QuantSpec, Quantization};
use crate::model::Model;
use crate::util::fsutil::write_atomic;

/// What `quantize_dir` wrote.
pub struct Written {
    /// Matrices quantized, and left as they were.
    pub quantized: usize,
    pub kept: usize,
    pub bytes: usize,
    pub dtype: StoredDtype,
}

/// One tensor to write: its name, dtype, shape and bytes.
type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

fn dtype_of(d: StoredDtype) -> Dtype {
    match d {
        StoredDtype::F32 => Dtype::F32,
        StoredDtype::F16 => Dtype::F16,
        StoredDtype::BF16 => Dtype::BF16,
    }
}

/// Quantizes the model in `model` into `out` (an MLX model directory),
/// with `spec`, scales and unquantized tensors in `dtype` (default: the
/// source's); tokenizer files and the generation config are copied.
pub fn quantize_dir(
    model: &Path,
    out: &Path,
    spec: QuantSpec,
    dtype: Option<StoredDtype>,
) -> Result<Written> {
    let m = Model::load_frozen(model)?;
    if m.cfg.quantization.is_some() {
        bail!("'{}' is already quantized", model.display());
    }
    let dtype = match dtype {
        Some(d) => d,
        None => crate::plan::memory::file_dtype(model)?,
    };
    let round = |v: f32| crate::model::quant::round_to(v, dtype);
    let mut entries: Vec<Entry> = Vec::new();
    let (mut quantized, mut kept) = (0, 0);
    for p in &m.params {
        let values: Vec<f32> = p.values().iter().map(|v| round(*v)).collect();
        if let Some(st) = &p.stored {
            st.release();
        }
        let module = p.name.strip_suffix(".weight").unwrap_or(&p.name);
        match p.shape[..] {
            [rows, cols] if spec.fits(cols) => {
                let q = quantize(&values, cols, spec, dtype);
                let words = q.packed.iter().flat_map(|w| w.to_le_bytes()).collect();
                let groups = cols / spec.group_size;
                entries.push((
                    p.name.clone(),
                    Dtype::U32,
                    vec![rows, spec.words(cols)],
                    words,
                ));
                entries.push((
                    format!("{module}.scales"),
                    dtype_of(dtype),
                    vec![rows, groups],
                    encode(&q.scales, dtype),
                ));
                entries.push((
                    format!("{module}.biases"),
                    dtype_of(dtype),
                    vec![rows, groups],
                    encode(&q.biases, dtype),
                ));
                quantized += 1;
            }
            _ => {
                entries.push((
                    p.name.clone(),
                    dtype_of(dtype),
                    p.shape.clone(),
                    encode(&values, dtype),
                ));
                kept += usize::from(p.shape.len() == 2);
            }
        }
    }
    entries.sort_by(|a, b| a.0.cmp(&b.0));
    let views = entries
        .iter()
        .map(|(n, d, s, b)| Ok((n.as_str(), TensorView::new(*d, s.clone(), b)?)))
        .collect::<Result<Vec<_>, safetensors::SafeTensorError>>()
        .map_err(|e| anyhow::anyhow!("cannot encode tensors: {e}"))?;
    let metadata = Some([("format".to_string(), "mlx".to_string())].into());
    let bytes = safetensors::serialize(views, metadata)
        .map_err(|e| anyhow::anyhow!("cannot encode tensors: {e}"))?;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create '{}'", out.display()))?;
    write_atomic(&out.join("model.safetensors"), &bytes)?;
    write_atomic(&out.join("config.json"), config(model, spec)?.as_bytes())?;
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        "special_tokens_map.json",
    ] {
        let src = model.join(f);
        if src.is_file() {
            std::fs::copy(&src, out.join(f))
                .with_context(|| format!("cannot copy '{}'", src.display()))?;
        }
    }
    Ok(Written {
        quantized,
        kept,
        bytes: bytes.len(),
        dtype,
    })
}

/// The source's `config.json` with the quantization mlx-lm records.
fn config(model: &Path, spec: QuantSpec) -> Result<String> {
    let path = model.join("config.json");
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read '{}'", path.display()))?;
    let mut v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("'{}'", path.display()))?;
    let q = Quantization {
        default: spec,
        modules: Default::default(),
    }
    .to_config();
    v["quantization"] = q.clone();
    v["quantization_config"] = q;
    Ok(serde_json::to_string_pretty(&v)?)
}
