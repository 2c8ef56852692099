//! The dtypes a checkpoint stores tensors in, and the conversions of f32
//! values to and from them.

/// The element types a frozen tensor can stay in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoredDtype {
    F32,
    F16,
    BF16,
}

impl StoredDtype {
    pub fn bytes(self) -> usize {
        match self {
            StoredDtype::F32 => 4,
            StoredDtype::F16 | StoredDtype::BF16 => 2,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            StoredDtype::F32 => "f32",
            StoredDtype::F16 => "f16",
            StoredDtype::BF16 => "bf16",
        }
    }
}

/// `v` rounded to `dtype` (to nearest, ties to even) and back.
#[inline]
pub fn round_to(v: f32, dtype: StoredDtype) -> f32 {
    match dtype {
        StoredDtype::F32 => v,
        StoredDtype::F16 => half::f16::from_f32(v).to_f32(),
        // bf16 is f32's top half: add half an ulp of it (ties to the even
        // neighbour) and cut; what `half` computes, inline (dequantization
        // rounds twice a value). NaN keeps its bits.
        StoredDtype::BF16 if v.is_nan() => v,
        StoredDtype::BF16 => {
            let b = v.to_bits();
            f32::from_bits(b.wrapping_add(0x7fff + ((b >> 16) & 1)) & 0xffff_0000)
        }
    }
}

/// f32 values (already values of `dtype`) as `dtype`'s bytes.
pub fn encode(values: &[f32], dtype: StoredDtype) -> Vec<u8> {
    match dtype {
        StoredDtype::F32 => values.iter().flat_map(|v| v.to_le_bytes()).collect(),
        StoredDtype::F16 => values
            .iter()
            .flat_map(|v| half::f16::from_f32(*v).to_le_bytes())
            .collect(),
        StoredDtype::BF16 => values
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
    }
}
