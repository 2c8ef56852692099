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

use crate::model::dtype::StoredDtype;
use crate::model::params::Stored;

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

/// A tensor of a mapped file: values in a float dtype, or the packed
/// `uint32` words of a quantized matrix (offset in the mapping, count).
pub enum Mapped {
    Values(Vec<usize>, Stored),
    Words(Vec<usize>, std::sync::Arc<memmap2::Mmap>, usize),
}

impl Mapped {
    pub fn shape(&self) -> &[usize] {
        match self {
            Mapped::Values(s, _) | Mapped::Words(s, _, _) => s,
        }
    }
}

/// Maps a safetensors file and returns its tensors as [`Stored`] views of
/// the mapping, in the file's dtype (nothing is decoded or copied; the
/// header is validated as [`parse`] does), and packed `uint32` words as
/// they are. Errors name the file.
pub fn map(path: &Path) -> Result<BTreeMap<String, Mapped>> {
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
        let start = view.data().as_ptr() as usize - base;
        let dtype = match view.dtype() {
            Dtype::F32 => StoredDtype::F32,
            Dtype::F16 => StoredDtype::F16,
            Dtype::BF16 => StoredDtype::BF16,
            Dtype::U32 => {
                let words = view.data().len() / 4;
                out.insert(name, Mapped::Words(view.shape().to_vec(), map.clone(), start));
                debug_assert!(words * 4 == view.data().len());
                continue;
            }
            d => bail!(
                "'{}': tensor '{name}' has dtype {d}; only F32, F16 and BF16 (and MLX's packed U32) are supported",
                path.display()
            ),
        };
        let stored = Stored {
            map: map.clone(),
            start,
            len: view.data().len() / dtype.bytes(),
            dtype,
            affine: None,
        };
        out.insert(name, Mapped::Values(view.shape().to_vec(), stored));
    }
    Ok(out)
}

/// Encodes f32 tensors with optional metadata. The values are read in
/// place (safetensors is little-endian, like every target we build for),
/// so the encoding is the only copy: a checkpoint save holds its file's
/// bytes once, not twice.
pub fn encode(tensors: &[(&str, &[usize], &[f32])], metadata: &[(&str, &str)]) -> Result<Vec<u8>> {
    let bytes: Vec<std::borrow::Cow<[u8]>> = tensors
        .iter()
        .map(|(_, _, data)| match cfg!(target_endian = "little") {
            true => bytemuck::cast_slice(data).into(),
            false => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        })
        .collect();
    serialize(tensors, Dtype::F32, &bytes, metadata)
}

/// `tensors`' names and shapes with their `bytes` (of `dtype`) as one
/// safetensors file.
fn serialize<B: AsRef<[u8]>>(
    tensors: &[(&str, &[usize], &[f32])],
    dtype: Dtype,
    bytes: &[B],
    metadata: &[(&str, &str)],
) -> Result<Vec<u8>> {
    let views = tensors
        .iter()
        .zip(bytes)
        .map(|((name, shape, _), b)| {
            Ok((*name, TensorView::new(dtype, shape.to_vec(), b.as_ref())?))
        })
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

/// [`encode`] with every tensor stored as `dtype` (rounded to nearest,
/// ties to even, as PyTorch's `.to(dtype)` rounds). Refuses a value that
/// is finite in f32 but not in `dtype` (beyond f16's ±65504), naming it.
pub fn encode_as(
    tensors: &[(&str, &[usize], &[f32])],
    metadata: &[(&str, &str)],
    dtype: StoredDtype,
) -> Result<Vec<u8>> {
    use crate::model::dtype::{encode as encode_values, round_to};
    let st = match dtype {
        StoredDtype::F32 => return encode(tensors, metadata),
        StoredDtype::F16 => Dtype::F16,
        StoredDtype::BF16 => Dtype::BF16,
    };
    let mut bytes = Vec::with_capacity(tensors.len());
    for (name, _, data) in tensors {
        if let Some(i) = data.iter().position(|v| !round_to(*v, dtype).is_finite()) {
            bail!(
                "tensor '{name}' holds {} at index {i}, beyond what {} can hold; write f32 or bf16 instead",
                data[i],
                dtype.name()
            );
        }
        bytes.push(encode_values(data, dtype));
    }
    serialize(tensors, st, &bytes, metadata)
}

/// Writes f32 tensors with optional metadata to `w` as safetensors, as it
/// goes: the header, then each tensor's bytes straight from its slice. The
/// same file `encode` makes (tensors in the order given), without holding
/// it in memory: a checkpoint of a full fine-tune's AdamW moments is
/// twice the model in f32 (4.8 GB at 0.6B), which the safetensors crate
/// can only encode into one `Vec` (`serialize`) or write to a path
/// (`serialize_to_file`, neither atomic nor hashed as it goes).
pub fn write_to(
    w: &mut dyn std::io::Write,
    tensors: &[(&str, &[usize], &[f32])],
    metadata: &[(&str, &str)],
) -> Result<()> {
    let mut entries = Vec::with_capacity(tensors.len());
    for (name, shape, data) in tensors {
        if shape.iter().product::<usize>() != data.len() {
            bail!(
                "tensor '{name}': shape {shape:?} does not hold {} values",
                data.len()
            );
        }
        entries.push((name.to_string(), Dtype::F32, shape.to_vec(), 4 * data.len()));
    }
    write_header(w, &entries, metadata)?;
    for (_, _, data) in tensors {
        match cfg!(target_endian = "little") {
            true => w.write_all(bytemuck::cast_slice(data))?,
            false => {
                for v in data.iter() {
                    w.write_all(&v.to_le_bytes())?;
                }
            }
        }
    }
    Ok(())
}

/// Writes a safetensors header for tensors of any dtype, given as
/// `(name, dtype, shape, bytes)` in the order their data will follow; the
/// caller then writes each tensor's bytes in that order (so a file larger
/// than memory is written as it is made).
pub fn write_header(
    w: &mut dyn std::io::Write,
    tensors: &[(String, Dtype, Vec<usize>, usize)],
    metadata: &[(&str, &str)],
) -> Result<()> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        let m: serde_json::Map<String, serde_json::Value> = metadata
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
            .collect();
        header.insert("__metadata__".into(), m.into());
    }
    let mut offset = 0usize;
    for (name, dtype, shape, bytes) in tensors {
        let end = offset + bytes;
        header.insert(
            name.clone(),
            serde_json::json!({ "dtype": dtype.to_string(), "shape": shape, "data_offsets": [offset, end] }),
        );
        offset = end;
    }
    let mut text = serde_json::to_vec(&header)?;
    // Data starts 8-byte aligned, as the safetensors crate writes it.
    text.resize(text.len().next_multiple_of(8), b' ');
    w.write_all(&(text.len() as u64).to_le_bytes())?;
    w.write_all(&text)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A streamed file reads back as what `encode` holds.
    #[test]
    fn written_files_read_back_like_encoded_ones() {
        let (a, b) = ([1.0f32, -2.5, 3.25, 0.0, 5.0, 6.0], [7.0f32]);
        let tensors: [(&str, &[usize], &[f32]); 2] = [("w", &[2, 3], &a), ("b", &[1], &b)];
        let mut written = Vec::new();
        write_to(&mut written, &tensors, &[("format", "pt")]).unwrap();
        let encoded = encode(&tensors, &[("format", "pt")]).unwrap();
        assert_eq!(written.len(), encoded.len());
        assert_eq!(parse(&written).unwrap(), parse(&encoded).unwrap());
        let st = SafeTensors::deserialize(&written).unwrap();
        assert_eq!(st.tensor("w").unwrap().shape(), &[2, 3]);
        let bad: [(&str, &[usize], &[f32]); 1] = [("w", &[4], &a)];
        assert!(write_to(&mut Vec::new(), &bad, &[]).is_err());
    }

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
