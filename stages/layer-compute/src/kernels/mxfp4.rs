//! MXFP4 (compressed-tensors "mxfp4-pack-quantized") decoding tables.
//!
//! A weight is `E2M1[code] * 2^(scale_byte - 127)`: `code` is a 4-bit nibble (low nibble of
//! byte `j` = column `2j`, high nibble = column `2j+1`), one E8M0 scale byte per row per
//! group of 32 consecutive columns. Scale byte 255 (NaN per the OCP MX spec) zeroes its
//! group. Every decoded value is an exact f32. The GEMV in [`super::matmul`] multiplies
//! straight from the packed bytes; [`dequantize`] exists for tests only.

/// Columns sharing one E8M0 scale byte.
pub const GROUP: usize = 32;

/// E2M1 code → value (bit 3 = sign; code 8 is −0).
pub const E2M1: [f32; 16] = [
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
];

/// E8M0 scale byte → 2^(s − 127), exact (subnormal for s = 0); 255 → 0.
#[inline]
pub fn e8m0(s: u8) -> f32 {
    match s {
        255 => 0.0,
        0 => f32::from_bits(0x0040_0000), // 2^-127, an f32 subnormal
        _ => f32::from_bits((s as u32) << 23),
    }
}

/// Decode a whole `rows × cols` matrix to f32 (tests only; never used by compute).
pub fn dequantize(packed: &[u8], scales: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    let pb = cols.div_ceil(2);
    let sb = cols.div_ceil(GROUP);
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let byte = packed[r * pb + c / 2];
            let code = if c % 2 == 0 { byte & 0x0F } else { byte >> 4 };
            out.push(E2M1[code as usize] * e8m0(scales[r * sb + c / GROUP]));
        }
    }
    out
}
