//! Weight blob files (`@model_path/weights/NAME.bin`): a 128-byte header,
//! then fp16 data.
//!
//! ```text
//! byte 0      = 1          file header
//! byte 4      = 2
//! byte 64..68 = EF BE AD DE chunk header (the MIL `offset=uint64(64)` points here)
//! byte 68     = 1          data type: fp16
//! u32 LE @ 72 = data size in bytes
//! u32 LE @ 80 = data offset (128)
//! byte 128..  = fp16 little-endian values
//! ```

use std::path::{Component, Path, PathBuf};

use half::f16;

use crate::error::{MilError, Result};

/// The offset MIL programs use to point at a file's only chunk.
pub const CHUNK_OFFSET: u64 = 64;
const DATA_OFFSET: usize = 128;
const MAGIC: [u8; 4] = [0xEF, 0xBE, 0xAD, 0xDE];
/// The prefix every BLOBFILE path carries.
pub const PATH_PREFIX: &str = "@model_path/weights/";

/// Encodes values (rounded to fp16) as a blob file.
pub fn encode(values: &[f32]) -> Vec<u8> {
    let mut b = vec![0u8; DATA_OFFSET + 2 * values.len()];
    b[0] = 1;
    b[4] = 2;
    b[64..68].copy_from_slice(&MAGIC);
    b[68] = 1;
    b[72..76].copy_from_slice(&((2 * values.len()) as u32).to_le_bytes());
    b[80..84].copy_from_slice(&(DATA_OFFSET as u32).to_le_bytes());
    for (i, v) in values.iter().enumerate() {
        b[DATA_OFFSET + 2 * i..][..2].copy_from_slice(&f16::from_f32(*v).to_le_bytes());
    }
    b
}

/// Decodes `count` fp16 values from the chunk at `offset` of a blob file.
pub fn decode(bytes: &[u8], offset: u64, count: usize, what: &str) -> Result<Vec<f32>> {
    let bad = |m: String| Err(MilError::new(format!("{what}: {m}")));
    let off = usize::try_from(offset).unwrap_or(usize::MAX);
    if off.checked_add(24).is_none_or(|end| end > bytes.len()) {
        return bad(format!(
            "offset {offset} is past the end of the file ({} bytes)",
            bytes.len()
        ));
    }
    let chunk = &bytes[off..];
    if chunk[..4] != MAGIC {
        return bad(format!(
            "no blob chunk header (DEADBEEF) at offset {offset}"
        ));
    }
    if chunk[4] != 1 {
        return bad(format!("chunk data type {} is not fp16 (1)", chunk[4]));
    }
    let u32_at = |i: usize| {
        u32::from_le_bytes([chunk[i], chunk[i + 1], chunk[i + 2], chunk[i + 3]]) as usize
    };
    let (size, data) = (u32_at(8), u32_at(16));
    if size != 2 * count {
        return bad(format!(
            "holds {size} bytes but the constant needs {} ({count} fp16 values)",
            2 * count
        ));
    }
    if data.checked_add(size).is_none_or(|end| end > bytes.len()) {
        return bad(format!(
            "data ({size} bytes at {data}) runs past the end of the file ({} bytes)",
            bytes.len()
        ));
    }
    Ok(bytes[data..data + size]
        .chunks_exact(2)
        .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
        .collect())
}

/// Resolves a BLOBFILE path against the weights directory, refusing paths
/// that would leave it (`..`, absolute paths, symlinks pointing outside).
pub fn resolve(weights_dir: &Path, path: &str) -> Result<PathBuf> {
    let rel = path.strip_prefix(PATH_PREFIX).ok_or_else(|| {
        MilError::new(format!(
            "blob path \"{path}\" must start with {PATH_PREFIX}"
        ))
    })?;
    let relp = Path::new(rel);
    if rel.is_empty()
        || relp
            .components()
            .any(|c| !matches!(c, Component::Normal(_)))
    {
        return Err(MilError::new(format!(
            "blob path \"{path}\" must name a file inside the weights directory (no '..', no absolute paths)"
        )));
    }
    let root = weights_dir.canonicalize().map_err(|e| {
        MilError::new(format!(
            "weights directory '{}': {e}",
            weights_dir.display()
        ))
    })?;
    let full = root.join(relp);
    let real = full
        .canonicalize()
        .map_err(|e| MilError::new(format!("blob '{}': {e}", full.display())))?;
    if !real.starts_with(&root) {
        return Err(MilError::new(format!(
            "blob '{}' resolves outside the weights directory '{}'",
            full.display(),
            root.display()
        )));
    }
    Ok(real)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encode_decode_roundtrip_and_header_bytes() {
        let v = [0.0f32, 1.0, -65504.0, 0.333];
        let b = encode(&v);
        assert_eq!(b.len(), 128 + 8);
        assert_eq!((b[0], b[4], b[68]), (1, 2, 1));
        assert_eq!(&b[64..68], &[0xEF, 0xBE, 0xAD, 0xDE]);
        assert_eq!(u32::from_le_bytes(b[72..76].try_into().unwrap()), 8);
        assert_eq!(u32::from_le_bytes(b[80..84].try_into().unwrap()), 128);
        let d = decode(&b, 64, 4, "t").unwrap();
        assert_eq!(d[..3], [0.0, 1.0, -65504.0]);
        assert!((d[3] - 0.333).abs() < 1e-3);
        assert!(decode(&b, 64, 5, "t").unwrap_err().msg.contains("needs 10"));
        assert!(decode(&b, 60, 4, "t").is_err());
        assert!(decode(&b[..100], 64, 4, "t").is_err());
        assert!(decode(&b, u64::MAX, 4, "t").is_err());
    }

    #[test]
    fn resolve_refuses_escapes() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path();
        let w = dir.join("weights");
        std::fs::create_dir_all(&w).unwrap();
        std::fs::write(w.join("a.bin"), encode(&[1.0])).unwrap();
        std::fs::write(dir.join("secret.bin"), encode(&[1.0])).unwrap();
        assert!(resolve(&w, "@model_path/weights/a.bin").is_ok());
        for bad in [
            "@model_path/weights/../secret.bin",
            "@model_path/weights//etc/passwd",
            "/etc/passwd",
            "@model_path/weights/",
            "@model_path/weights/missing.bin",
        ] {
            assert!(resolve(&w, bad).is_err(), "{bad}");
        }
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(dir.join("secret.bin"), w.join("link.bin")).unwrap();
            let e = resolve(&w, "@model_path/weights/link.bin").unwrap_err();
            assert!(e.msg.contains("outside"), "{e}");
        }
    }
}
