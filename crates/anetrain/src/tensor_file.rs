//! Safetensors files as anetrain uses them: every tensor decoded to f32 on
//! reading (from F32, F16 or BF16), written as F32. Parsing and validation
//! (header length, JSON, offsets against shapes and the file's size) are
//! Hugging Face's `safetensors` crate, which is fuzzed and is what candle
//! uses; this module turns its errors into lines a user can act on.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use safetensors::tensor::{Dtype, SafeTensorError, SafeTensors, TensorView};

use crate::params::{Stored, StoredDtype};

/// One tensor decoded to f32.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    /// The dtype on disk (`F32`, `F16`, `BF16`).
    pub dtype: String,
    pub data: Vec<f32>,
}

/// What went wrong with a file, in the user's terms.
fn describe(e: SafeTensorError, len: usize) -> String {
    match e {
        SafeTensorError::HeaderTooSmall | SafeTensorError::InvalidHeaderLength => format!(
            "the header is longer than the file ({len} bytes): truncated or not safetensors"
        ),
        SafeTensorError::MetadataIncompleteBuffer => format!(
            "the tensors' data does not end where the file does ({len} bytes): truncated download?"
        ),
        SafeTensorError::HeaderTooLarge => "the header is over 100 MB: not safetensors".into(),
        SafeTensorError::InvalidHeader(_) | SafeTensorError::InvalidHeaderDeserialization(_) => {
            format!("the header is not valid JSON ({e})")
        }
        other => format!("not a valid safetensors file: {other}"),
    }
}

/// Parses safetensors bytes (the caller names the file in errors).
pub fn parse(bytes: &[u8]) -> Result<BTreeMap<String, Tensor>> {
    let st =
        SafeTensors::deserialize(bytes).map_err(|e| anyhow::anyhow!(describe(e, bytes.len())))?;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let raw = view.data();
        let data: Vec<f32> = match view.dtype() {
            Dtype::F32 => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Dtype::F16 => raw
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            Dtype::BF16 => raw
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            d => bail!("tensor '{name}' has dtype {d}; only F32, F16 and BF16 are supported"),
        };
        let tensor = Tensor {
            shape: view.shape().to_vec(),
            dtype: view.dtype().to_string(),
            data,
        };
        out.insert(name, tensor);
    }
    Ok(out)
}

/// Reads a safetensors file; errors name the file.
pub fn read(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read '{}'", path.display()))?;
    parse(&bytes).with_context(|| format!("'{}'", path.display()))
}

/// Maps a safetensors file and returns its tensors as [`Stored`] views of
/// the mapping, in the file's dtype (nothing is decoded or copied; the
/// header is validated as [`parse`] does). Errors name the file.
pub fn map(path: &Path) -> Result<BTreeMap<String, (Vec<usize>, Stored)>> {
    let file =
        std::fs::File::open(path).with_context(|| format!("cannot read '{}'", path.display()))?;
    // Safety: the file is opened read-only; a model file changed by another
    // process during a run is outside what any reader can guard against
    // (transformers and candle map weights the same way).
    let map = unsafe { memmap2::Mmap::map(&file) }
        .with_context(|| format!("cannot map '{}'", path.display()))?;
    let map = std::sync::Arc::new(map);
    let st = SafeTensors::deserialize(&map)
        .map_err(|e| anyhow::anyhow!(describe(e, map.len())))
        .with_context(|| format!("'{}'", path.display()))?;
    let base = map.as_ptr() as usize;
    let mut out = BTreeMap::new();
    for (name, view) in st.tensors() {
        let dtype = match view.dtype() {
            Dtype::F32 => StoredDtype::F32,
            Dtype::F16 => StoredDtype::F16,
            Dtype::BF16 => StoredDtype::BF16,
            d => bail!(
                "'{}': tensor '{name}' has dtype {d}; only F32, F16 and BF16 are supported",
                path.display()
            ),
        };
        let stored = Stored {
            map: map.clone(),
            start: view.data().as_ptr() as usize - base,
            len: view.data().len() / dtype.bytes(),
            dtype,
        };
        out.insert(name, (view.shape().to_vec(), stored));
    }
    Ok(out)
}

/// Encodes f32 tensors with optional metadata.
pub fn encode(tensors: &[(&str, &[usize], &[f32])], metadata: &[(&str, &str)]) -> Result<Vec<u8>> {
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, _, data)| data.iter().flat_map(|v| v.to_le_bytes()).collect())
        .collect();
    let views = tensors
        .iter()
        .zip(&bytes)
        .map(|((name, shape, _), b)| Ok((*name, TensorView::new(Dtype::F32, shape.to_vec(), b)?)))
        .collect::<Result<Vec<_>, SafeTensorError>>()
        .map_err(|e| anyhow::anyhow!("cannot encode tensors: {e}"))?;
    let info: Option<HashMap<String, String>> = (!metadata.is_empty()).then(|| {
        metadata
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    });
    safetensors::serialize(views, info).map_err(|e| anyhow::anyhow!("cannot encode tensors: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_and_corruption() {
        let a = [1.0f32, -2.5, 3.25, 0.0];
        let bytes = encode(
            &[("a", &[2, 2], &a), ("b", &[1], &[7.0])],
            &[("format", "pt")],
        )
        .unwrap();
        let t = parse(&bytes).unwrap();
        assert_eq!(t["a"].shape, vec![2, 2]);
        assert_eq!(t["a"].data, a.to_vec());
        assert_eq!(t["b"].data, vec![7.0]);
        let e = format!("{:#}", parse(&bytes[..bytes.len() - 2]).unwrap_err());
        assert!(e.contains("truncated"), "{e}");
        assert!(parse(b"abc").is_err());
        let mut bad = bytes.clone();
        bad[0] = 0xff;
        assert!(parse(&bad).is_err());
    }

    #[test]
    fn half_precision_tensors_decode_to_f32() {
        // What transformers writes for bf16/f16 checkpoints.
        let h: Vec<u8> = [1.5f32, -2.0]
            .iter()
            .flat_map(|&v| f16::from_f32(v).to_le_bytes())
            .collect();
        let b: Vec<u8> = [0.25f32, 3.0]
            .iter()
            .flat_map(|&v| bf16::from_f32(v).to_le_bytes())
            .collect();
        let views = vec![
            ("h", TensorView::new(Dtype::F16, vec![2], &h).unwrap()),
            ("b", TensorView::new(Dtype::BF16, vec![2], &b).unwrap()),
        ];
        let t = parse(&safetensors::serialize(views, None).unwrap()).unwrap();
        assert_eq!(
            (t["h"].dtype.as_str(), t["h"].data.as_slice()),
            ("F16", &[1.5, -2.0][..])
        );
        assert_eq!(
            (t["b"].dtype.as_str(), t["b"].data.as_slice()),
            ("BF16", &[0.25, 3.0][..])
        );
    }
}
