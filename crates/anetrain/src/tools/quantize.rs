//! `anetrain quantize`: a model directory written in MLX's affine format,
//! as `mlx_lm.convert -q` writes it (mlx-lm 0.32 `convert.py`,
//! `utils.py` `quantize_model`): every matrix whose input width is a
//! multiple of the group size (the projections, the embedding, an untied
//! head) as packed words, scales and biases; norms and narrower matrices
//! as they are; `config.json` with `quantization` and
//! `quantization_config`. The words, scales and biases equal mlx-lm's for
//! the same weights (`tests/library/quantized.rs`), so mlx-lm loads the result and
//! so does anetrain, as a LoRA base.
//!
//! The source is read memory-mapped, one tensor at a time; each tensor's
//! pages are given back to the kernel once it is quantized, so a base
//! larger than the machine's memory can be converted.

use std::path::Path;

use anyhow::{bail, Context, Result};
use safetensors::tensor::Dtype;

use crate::model::dtype::StoredDtype;
use crate::model::dtype::{encode, round_to};
use crate::model::quant::{quantize, QuantSpec, Quantization};
use crate::model::HfTensor;
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

fn dtype_of(d: StoredDtype) -> Dtype {
    match d {
        StoredDtype::F32 => Dtype::F32,
        StoredDtype::F16 => Dtype::F16,
        StoredDtype::BF16 => Dtype::BF16,
    }
}

/// The tensors a stored tensor becomes: `(name, dtype, shape, bytes)` —
/// its words, scales and biases when quantized, else itself.
fn entries(
    p: &HfTensor,
    spec: QuantSpec,
    dtype: StoredDtype,
) -> Vec<(String, Dtype, Vec<usize>, usize)> {
    let module = p.name.strip_suffix(".weight").unwrap_or(&p.name);
    let numel: usize = p.shape.iter().product();
    let b = dtype.bytes();
    match p.shape[..] {
        [rows, cols] if spec.fits(cols) => {
            let groups = cols / spec.group_size;
            vec![
                (
                    p.name.clone(),
                    Dtype::U32,
                    vec![rows, spec.words(cols)],
                    rows * spec.words(cols) * 4,
                ),
                (
                    format!("{module}.scales"),
                    dtype_of(dtype),
                    vec![rows, groups],
                    rows * groups * b,
                ),
                (
                    format!("{module}.biases"),
                    dtype_of(dtype),
                    vec![rows, groups],
                    rows * groups * b,
                ),
            ]
        }
        _ => vec![(p.name.clone(), dtype_of(dtype), p.shape.clone(), numel * b)],
    }
}

/// Quantizes the model in `model` into `out` (an MLX model directory),
/// with `spec`, scales and unquantized tensors in `dtype` (default: the
/// source's); tokenizer files and the generation config are copied. The
/// file is written as it is made: a tensor at a time is held, in f32.
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
    let source = crate::model::file_dtype(model)?;
    let dtype = dtype.unwrap_or(source);
    // Every packed word tensor first, so each starts 4-byte aligned (as
    // the safetensors crate orders by alignment); the float tensors after.
    // As Hugging Face stores them: a family's fused projections as one
    // matrix, as mlx-lm quantizes them.
    let stored = m.hf_tensors();
    let all: Vec<_> = stored
        .iter()
        .flat_map(|p| entries(p, spec, dtype))
        .collect();
    let (mut plan, floats): (Vec<_>, Vec<_>) = all.into_iter().partition(|e| e.1 == Dtype::U32);
    plan.extend(floats);
    let bytes: usize = plan.iter().map(|e| e.3).sum();
    let quantized = stored
        .iter()
        .filter(|p| entries(p, spec, dtype).len() == 3)
        .count();
    let kept = stored.iter().filter(|p| p.shape.len() == 2).count() - quantized;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create '{}'", out.display()))?;
    crate::util::fsutil::write_atomic_with(&out.join("model.safetensors"), |w| {
        crate::model::tensor_file::write_header(w, &plan, &[("format", "mlx")])?;
        // The float tensors (scales, biases, norms: a few percent of the
        // words' bytes) wait in memory for the words to be written.
        let mut later: Vec<Vec<u8>> = Vec::new();
        for p in &stored {
            let mut values = m.hf_tensor_values(p).into_owned();
            for &id in &p.parts {
                if let Some(st) = &m.params[id].stored {
                    st.release();
                }
            }
            if dtype != source {
                values.iter_mut().for_each(|v| *v = round_to(*v, dtype));
            }
            match p.shape[..] {
                [_, cols] if spec.fits(cols) => {
                    let q = quantize(&values, cols, spec, dtype);
                    drop(values);
                    let words: Vec<u8> = q.packed.iter().flat_map(|w| w.to_le_bytes()).collect();
                    w.write_all(&words)?;
                    later.push(encode(&q.scales, dtype));
                    later.push(encode(&q.biases, dtype));
                }
                _ => later.push(encode(&values, dtype)),
            }
        }
        for b in later {
            w.write_all(&b)?;
        }
        Ok(())
    })?;
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
        bytes,
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
