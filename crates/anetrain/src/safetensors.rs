//! The safetensors format: an 8-byte little-endian header length, a JSON
//! header mapping names to `{dtype, shape, data_offsets}`, then raw data.
//! Reading checks every offset and size (truncated or corrupt files give a
//! clear error) and decodes F32, F16 and BF16 to f32.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use half::{bf16, f16};

/// One tensor decoded to f32.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    /// The dtype on disk (`F32`, `F16`, `BF16`).
    pub dtype: String,
    pub data: Vec<f32>,
}

const MAX_HEADER: u64 = 100 << 20;

/// Parses safetensors bytes (the caller names the file in errors).
pub fn parse(bytes: &[u8]) -> Result<BTreeMap<String, Tensor>> {
    if bytes.len() < 8 {
        bail!(
            "file is {} bytes, too short for a safetensors header (truncated?)",
            bytes.len()
        );
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap_or_default());
    if n > MAX_HEADER || n > (bytes.len() - 8) as u64 {
        bail!(
            "header length {n} is larger than the file ({} bytes): truncated or not safetensors",
            bytes.len()
        );
    }
    let header: serde_json::Value =
        serde_json::from_slice(&bytes[8..8 + n as usize]).context("header is not valid JSON")?;
    let obj = header.as_object().context("header is not a JSON object")?;
    let data = &bytes[8 + n as usize..];
    let mut out = BTreeMap::new();
    for (name, info) in obj {
        if name == "__metadata__" {
            continue;
        }
        let dtype = info["dtype"]
            .as_str()
            .with_context(|| format!("tensor '{name}' has no dtype"))?;
        let shape: Vec<usize> = info["shape"]
            .as_array()
            .with_context(|| format!("tensor '{name}' has no shape"))?
            .iter()
            .map(|d| d.as_u64().map(|v| v as usize))
            .collect::<Option<_>>()
            .with_context(|| format!("tensor '{name}' has a malformed shape"))?;
        let offs = info["data_offsets"]
            .as_array()
            .filter(|a| a.len() == 2)
            .with_context(|| format!("tensor '{name}' has malformed data_offsets"))?;
        let (b, e) = (
            offs[0].as_u64().context("bad data offset")? as usize,
            offs[1].as_u64().context("bad data offset")? as usize,
        );
        let size = match dtype {
            "F32" => 4,
            "F16" | "BF16" => 2,
            d => bail!("tensor '{name}' has dtype {d}; only F32, F16 and BF16 are supported"),
        };
        let count = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .with_context(|| format!("tensor '{name}' shape {shape:?} is too large"))?;
        if e < b || e - b != count.saturating_mul(size) {
            bail!(
                "tensor '{name}': data_offsets [{b}, {e}] do not match shape {shape:?} of {dtype}"
            );
        }
        if e > data.len() {
            bail!(
                "tensor '{name}' ends at byte {e} of the data but the file holds {} (truncated download?)",
                data.len()
            );
        }
        let raw = &data[b..e];
        let values: Vec<f32> = match dtype {
            "F32" => raw
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            "F16" => raw
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            _ => raw
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        };
        out.insert(
            name.clone(),
            Tensor {
                shape,
                dtype: dtype.to_string(),
                data: values,
            },
        );
    }
    Ok(out)
}

/// Reads a safetensors file; errors name the file.
pub fn read(path: &Path) -> Result<BTreeMap<String, Tensor>> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read '{}'", path.display()))?;
    parse(&bytes).with_context(|| format!("'{}'", path.display()))
}

/// Encodes f32 tensors (in the given order) with optional metadata.
pub fn encode(tensors: &[(&str, &[usize], &[f32])], metadata: &[(&str, &str)]) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        let m: serde_json::Map<String, serde_json::Value> = metadata
            .iter()
            .map(|(k, v)| (k.to_string(), serde_json::Value::from(*v)))
            .collect();
        header.insert("__metadata__".into(), m.into());
    }
    let mut offset = 0usize;
    for (name, shape, data) in tensors {
        let end = offset + data.len() * 4;
        header.insert(
            name.to_string(),
            serde_json::json!({"dtype": "F32", "shape": shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut h = serde_json::to_vec(&header).unwrap_or_default();
    while !(8 + h.len()).is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + h.len() + offset);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    for (_, _, data) in tensors {
        for v in data.iter() {
            out.extend_from_slice(&v.to_le_bytes());
        }
    }
    out
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
        );
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
}
