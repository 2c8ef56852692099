//! Reading and writing NumPy `.npy` files (little-endian, C order), the
//! interchange format of `anetrain mil run` and `eval`.

use std::path::Path;

use half::f16;

/// Array contents, widened to a common type per kind.
#[derive(Clone, Debug, PartialEq)]
pub enum NpyData {
    Float(Vec<f32>),
    Int(Vec<i64>),
    Bool(Vec<bool>),
}

#[derive(Clone, Debug, PartialEq)]
pub struct NpyArray {
    pub shape: Vec<usize>,
    /// The file's dtype descriptor, e.g. `<f2`.
    pub descr: String,
    pub data: NpyData,
}

const MAGIC: &[u8] = b"\x93NUMPY";

/// Parses `.npy` bytes. Errors say what is wrong without the file name (the
/// caller adds it).
pub fn parse(bytes: &[u8]) -> Result<NpyArray, String> {
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err("not a .npy file (missing \\x93NUMPY magic)".into());
    }
    let major = bytes[6];
    let (hlen, hstart) = match major {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10usize),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err("truncated .npy header".into());
            }
            (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            )
        }
        v => return Err(format!("unsupported .npy version {v}")),
    };
    let header = bytes
        .get(hstart..hstart.saturating_add(hlen))
        .ok_or("truncated .npy header")?;
    let header = std::str::from_utf8(header).map_err(|_| "the .npy header is not text")?;
    let descr = dict_value(header, "descr")
        .map(|v| v.trim_matches(|c| c == '\'' || c == '"').to_string())
        .ok_or("the .npy header has no 'descr'")?;
    let fortran =
        dict_value(header, "fortran_order").ok_or("the .npy header has no 'fortran_order'")?;
    if fortran.trim() != "False" {
        return Err(
            "Fortran-ordered arrays are not supported; save with np.ascontiguousarray".into(),
        );
    }
    let shape_txt = dict_value(header, "shape").ok_or("the .npy header has no 'shape'")?;
    let shape: Vec<usize> = shape_txt
        .trim_matches(|c| c == '(' || c == ')')
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| format!("bad shape entry '{s}' in the .npy header"))
        })
        .collect::<Result<_, _>>()?;
    let n = shape
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or("the .npy shape is too large")?;
    let body = &bytes[hstart + hlen..];
    if !descr.is_ascii() {
        return Err(format!("unsupported dtype '{descr}'"));
    }
    let (kind, size) = match descr.as_str() {
        "|b1" => ('b', 1),
        d if d.len() >= 3 && (d.starts_with('<') || d.starts_with('|')) => {
            let k = d.as_bytes()[1] as char;
            let s: usize = d[2..]
                .parse()
                .map_err(|_| format!("unsupported dtype '{d}'"))?;
            (k, s)
        }
        d => {
            return Err(format!(
                "unsupported dtype '{d}' (need little-endian float, int, uint or bool)"
            ))
        }
    };
    let need = n.checked_mul(size).ok_or("the .npy shape is too large")?;
    if body.len() != need {
        return Err(format!(
            "data holds {} bytes but shape {shape:?} of {descr} needs {need} (truncated or corrupt file)",
            body.len()
        ));
    }
    let chunks = body.chunks_exact(size.max(1));
    let data = match (kind, size) {
        ('f', 2) => NpyData::Float(
            chunks
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
        ),
        ('f', 4) => NpyData::Float(
            chunks
                .map(|c| f32::from_le_bytes(c.try_into().unwrap_or_default()))
                .collect(),
        ),
        ('f', 8) => NpyData::Float(
            chunks
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or_default()) as f32)
                .collect(),
        ),
        ('i', 1 | 2 | 4 | 8) => NpyData::Int(chunks.map(|c| int_le(c, true)).collect()),
        ('u', 1 | 2 | 4 | 8) => {
            let v: Vec<i64> = chunks.map(|c| int_le(c, false)).collect();
            if v.iter().any(|&x| x < 0) {
                return Err("uint64 values above 2^63 are not supported".into());
            }
            NpyData::Int(v)
        }
        ('b', 1) => NpyData::Bool(body.iter().map(|&b| b != 0).collect()),
        _ => return Err(format!("unsupported dtype '{descr}'")),
    };
    Ok(NpyArray { shape, descr, data })
}

fn int_le(c: &[u8], signed: bool) -> i64 {
    let mut b = [0u8; 8];
    b[..c.len()].copy_from_slice(c);
    if signed && c.len() < 8 && c[c.len() - 1] & 0x80 != 0 {
        b[c.len()..].fill(0xFF);
    }
    i64::from_le_bytes(b)
}

/// The text of `'key': value` in a Python dict literal (value up to the next
/// top-level comma).
fn dict_value<'a>(header: &'a str, key: &str) -> Option<&'a str> {
    let pat1 = format!("'{key}':");
    let pat2 = format!("\"{key}\":");
    let start = header
        .find(&pat1)
        .map(|i| i + pat1.len())
        .or_else(|| header.find(&pat2).map(|i| i + pat2.len()))?;
    let rest = &header[start..];
    let mut depth = 0i32;
    for (i, ch) in rest.char_indices() {
        match ch {
            '(' | '[' => depth += 1,
            ')' | ']' => depth -= 1,
            ',' | '}' if depth == 0 => return Some(rest[..i].trim()),
            _ => {}
        }
    }
    None
}

/// An `.npy` file that cannot be read; displayed as one line naming it.
#[derive(Debug)]
pub enum ReadError {
    /// The file could not be opened or read.
    Io {
        path: std::path::PathBuf,
        error: std::io::Error,
    },
    /// The bytes are not an array this reader takes (see [`parse`]).
    Format {
        path: std::path::PathBuf,
        problem: String,
    },
}

impl std::fmt::Display for ReadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ReadError::Io { path, error } => write!(f, "cannot read '{}': {error}", path.display()),
            ReadError::Format { path, problem } => write!(f, "'{}': {problem}", path.display()),
        }
    }
}

impl std::error::Error for ReadError {}

/// Reads an `.npy` file; errors name the file.
pub fn read(path: &Path) -> Result<NpyArray, ReadError> {
    let bytes = std::fs::read(path).map_err(|error| ReadError::Io {
        path: path.into(),
        error,
    })?;
    parse(&bytes).map_err(|problem| ReadError::Format {
        path: path.into(),
        problem,
    })
}

fn header(descr: &str, shape: &[usize]) -> Vec<u8> {
    let shape_txt = match shape.len() {
        1 => format!("({},)", shape[0]),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut h = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape_txt}, }}");
    // Pad so the data starts on a 64-byte boundary; the header ends in '\n'.
    let total = MAGIC.len() + 4 + h.len() + 1;
    h.push_str(&" ".repeat((64 - total % 64) % 64));
    h.push('\n');
    let mut out = Vec::with_capacity(10 + h.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(h.len() as u16).to_le_bytes());
    out.extend_from_slice(h.as_bytes());
    out
}

/// `.npy` bytes of a float32 array.
pub fn encode_f32(shape: &[usize], data: &[f32]) -> Vec<u8> {
    let mut out = header("<f4", shape);
    out.reserve(data.len() * 4);
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// `.npy` bytes of a float16 array (values rounded to fp16).
pub fn encode_f16(shape: &[usize], data: &[f32]) -> Vec<u8> {
    let mut out = header("<f2", shape);
    for v in data {
        out.extend_from_slice(&f16::from_f32(*v).to_le_bytes());
    }
    out
}

/// `.npy` bytes of an int64 array.
pub fn encode_i64(shape: &[usize], data: &[i64]) -> Vec<u8> {
    let mut out = header("<i8", shape);
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_each_writer() {
        let a = parse(&encode_f32(&[2, 3], &[1.0, 2.0, 3.0, 4.0, 5.0, -6.5])).unwrap();
        assert_eq!(a.shape, vec![2, 3]);
        assert_eq!(a.data, NpyData::Float(vec![1.0, 2.0, 3.0, 4.0, 5.0, -6.5]));
        let b = parse(&encode_f16(&[3], &[0.5, -2.0, 65504.0])).unwrap();
        assert_eq!(b.descr, "<f2");
        assert_eq!(b.data, NpyData::Float(vec![0.5, -2.0, 65504.0]));
        let c = parse(&encode_i64(&[2], &[-3, 151935])).unwrap();
        assert_eq!(c.data, NpyData::Int(vec![-3, 151935]));
        let s = parse(&encode_f32(&[], &[7.0])).unwrap();
        assert_eq!(s.shape, Vec::<usize>::new());
    }

    #[test]
    fn rejects_garbage_and_truncation() {
        assert!(parse(b"hello").is_err());
        let mut f = encode_f32(&[4], &[1.0; 4]);
        f.truncate(f.len() - 1);
        assert!(parse(&f).unwrap_err().contains("truncated"));
        let mut g = encode_f32(&[4], &[1.0; 4]);
        g[6] = 9;
        assert!(parse(&g).unwrap_err().contains("version"));
    }

    #[test]
    fn non_ascii_descr_is_an_error_not_a_panic() {
        // Found by the npy_parse fuzz target.
        let mut f = encode_f32(&[1], &[1.0]);
        let at = f.windows(3).position(|w| w == b"<f4").unwrap();
        f[at + 1] = 0xC3;
        f[at + 2] = 0x99;
        assert!(parse(&f).is_err());
    }
}
