//! `synth --weights`: how the weights' values are drawn (`legacy`, today's streams, or
//! `gaussian`, realistic MXFP4 experts), the real MXFP4 quantization of Gaussian groups, and
//! the entropy histograms `synth` prints of what it wrote.
//!
//! In `gaussian` mode every routed expert matrix is drawn as BF16-like values from
//! N(0, 1/sqrt(in)) and quantized per group of 32 the OCP MX way: the group's E8M0 scale
//! is `floor(log2(max |v|)) - 2` (E2M1's largest exponent), each code the E2M1 value nearest
//! to `v / scale` (ties to the even code, clamped to ±6). The codes and the scales of one
//! matrix are computed from the same stream (ChaCha8 keyed by the matrix name, group `g` at
//! word `16 g`), so either tensor can be written on its own, chunk by chunk.

use rand::RngCore;
use rand_chacha::ChaCha8Rng;

use k3_model::tensor::Dtype;

use super::{Init, TensorSpec};

/// `synth --weights`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Weights {
    /// Today's streams: MXFP4 experts as uniform random codes with scales around the
    /// right rms (the tiny fixtures were made this way; the default for every shape but
    /// `slice`).
    Legacy,
    /// MXFP4 experts quantized from Gaussian groups (the real code and scale
    /// distribution; the default for `--shape slice`). BF16 tensors are N(0, 1/sqrt(in))
    /// in both modes.
    Gaussian,
}

impl Weights {
    /// The name `config.json`'s `k3_synth.weights` records.
    pub fn name(self) -> &'static str {
        match self {
            Weights::Legacy => "legacy",
            Weights::Gaussian => "gaussian",
        }
    }
}

/// Elements per MXFP4 group.
const GROUP: usize = 32;
/// E2M1 magnitudes by code (bits 0..2).
const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// What a tensor holds in `weights` mode, and the name of the stream its values come from:
/// in `gaussian` mode an expert's `*.weight_packed` and `*.weight_scale` share the stream
/// of their matrix (`*.weight`).
pub fn effective(t: &TensorSpec, weights: Weights) -> (Init, String) {
    let matrix = |suffix: &str| t.name.strip_suffix(suffix).map(|b| format!("{b}weight"));
    match (weights, t.init, t.shape.as_slice()) {
        (Weights::Gaussian, Init::Packed, &[_, half]) => match matrix("weight_packed") {
            Some(m) => (Init::QuantCodes(std_of(half * 2)), m),
            None => (t.init, t.name.clone()),
        },
        (Weights::Gaussian, Init::Scale(_), &[_, groups]) => match matrix("weight_scale") {
            Some(m) => (Init::QuantScales(std_of(groups * GROUP)), m),
            None => (t.init, t.name.clone()),
        },
        _ => (t.init, t.name.clone()),
    }
}

fn std_of(fan_in: usize) -> f32 {
    1.0 / (fan_in.max(1) as f32).sqrt()
}

/// One group's 32 values ~N(0, std): the group at the stream's current word.
fn group_values(rng: &mut ChaCha8Rng, table: &[f32], std: f32) -> [f32; GROUP] {
    let mut r = [0u8; 2 * GROUP];
    rng.fill_bytes(&mut r);
    let mut v = [0f32; GROUP];
    for (o, u) in v.iter_mut().zip(r.chunks_exact(2)) {
        // Rounded to BF16 first, as a trained BF16 weight would be before quantization.
        let x = table[u16::from_le_bytes([u[0], u[1]]) as usize] * std;
        *o = half::bf16::from_f32(x).to_f32();
    }
    v
}

/// The E8M0 scale byte of a group whose largest magnitude is `amax` (255 is NaN in E8M0
/// and never written; an all-zero group gets the smallest scale).
pub fn scale_byte(amax: f32) -> u8 {
    if amax <= 0.0 || !amax.is_finite() {
        return 0;
    }
    let e = amax.log2().floor() as i32 - 2;
    (e + 127).clamp(0, 254) as u8
}

/// The E2M1 code (sign in bit 3) nearest to `x` (already divided by the scale), ties to
/// the even code, magnitudes past 6 clamped to 6.
pub fn e2m1_code(x: f32) -> u8 {
    let a = x.abs();
    let mut best = 0usize;
    for (i, &m) in E2M1.iter().enumerate().skip(1) {
        let (d, db) = ((a - m).abs(), (a - E2M1[best]).abs());
        if d < db || (d == db && i % 2 == 0) {
            best = i;
        }
    }
    let sign = if x.is_sign_negative() && best != 0 {
        8
    } else {
        0
    };
    sign | best as u8
}

/// One group quantized: its scale byte and 16 bytes of codes (element `2i` in the low
/// nibble of byte `i`).
pub fn quantize(v: &[f32; GROUP]) -> (u8, [u8; GROUP / 2]) {
    let amax = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let s = scale_byte(amax);
    let inv = 1.0 / f32::from_bits(((s.max(1)) as u32) << 23);
    let mut codes = [0u8; GROUP / 2];
    for (i, c) in codes.iter_mut().enumerate() {
        let lo = e2m1_code(v[2 * i] * inv);
        let hi = e2m1_code(v[2 * i + 1] * inv);
        *c = lo | (hi << 4);
    }
    (s, codes)
}

/// Fill `out` (codes when `codes`, else scales) from element `first` of a quantized
/// matrix; `first` is at a group boundary (the writer's chunks are multiples of 1024).
pub fn fill_quantized(
    rng: &ChaCha8Rng,
    table: &[f32],
    std: f32,
    codes: bool,
    first: usize,
    out: &mut [u8],
) {
    let per_group = if codes { GROUP / 2 } else { 1 };
    let g0 = first / per_group;
    let mut rng = rng.clone();
    rng.set_word_pos(g0 as u128 * (GROUP as u128 / 2));
    for o in out.chunks_mut(per_group) {
        let (s, c) = quantize(&group_values(&mut rng, table, std));
        if codes {
            o.copy_from_slice(&c[..o.len()]);
        } else {
            o[0] = s;
        }
    }
}

/// Histograms of what was written: BF16 exponents (bits 7..14), E2M1 code nibbles and E8M0
/// scale bytes.
#[derive(Clone, Debug)]
pub struct Entropy {
    pub exponent: [u64; 256],
    pub codes: [u64; 16],
    pub scales: [u64; 256],
}

impl Default for Entropy {
    fn default() -> Self {
        Entropy {
            exponent: [0; 256],
            codes: [0; 16],
            scales: [0; 256],
        }
    }
}

/// Shannon entropy in bits per symbol of a histogram (0 when empty).
pub fn bits(h: &[u64]) -> f64 {
    let n: u64 = h.iter().sum();
    if n == 0 {
        return 0.0;
    }
    h.iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / n as f64;
            -p * p.log2()
        })
        .sum()
}

impl Entropy {
    /// Count the bytes of tensor `t` (held as `init`) just written.
    pub fn count(&mut self, t: &TensorSpec, init: Init, bytes: &[u8]) {
        match (init, t.dtype) {
            (Init::Packed | Init::QuantCodes(_), _) => {
                for &b in bytes {
                    self.codes[(b & 15) as usize] += 1;
                    self.codes[(b >> 4) as usize] += 1;
                }
            }
            (Init::Scale(_) | Init::QuantScales(_), _) => {
                for &b in bytes {
                    self.scales[b as usize] += 1;
                }
            }
            (_, Dtype::BF16) => {
                for w in bytes.chunks_exact(2) {
                    let v = u16::from_le_bytes([w[0], w[1]]);
                    self.exponent[((v >> 7) & 0xff) as usize] += 1;
                }
            }
            _ => {}
        }
    }

    /// The line `synth` prints.
    pub fn line(&self) -> String {
        let mut s = format!(
            "entropy: BF16 exponent {:.2} bits of 8",
            bits(&self.exponent)
        );
        if self.codes.iter().any(|&c| c > 0) {
            s += &format!(
                ", MXFP4 code {:.2} bits of 4, E8M0 scale {:.2} bits of 8",
                bits(&self.codes),
                bits(&self.scales)
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// The scale comes from the group's max (OCP MX: floor(log2 amax) - 2), and every
    /// code is the nearest E2M1 value: catches a scale from the rms or a truncating
    /// rounding (which would shift the code distribution the codec is measured on).
    #[test]
    fn quantize_is_nearest_under_the_max_scale() {
        let mut v = [0f32; GROUP];
        v[0] = 5.9; // amax: log2 = 2.56 -> scale 2^0
        v[1] = -1.26; // nearer 1.5 than 1.0
        v[2] = 0.24; // nearer 0 than 0.5
        v[3] = 2.5; // a tie between 2 and 3: the even code (2.0, code 4)
        v[4] = 7.0; // the max now (log2 2.81: scale 2^0 still), clamped to 6
        let (s, c) = quantize(&v);
        assert_eq!(s, 127);
        assert_eq!(c[0] & 15, 7);
        assert_eq!(c[0] >> 4, 8 | 3);
        assert_eq!(c[1] & 15, 0);
        assert_eq!(c[1] >> 4, 4);
        assert_eq!(c[2] & 15, 7);
        assert_eq!(scale_byte(0.0), 0);
        assert_eq!(scale_byte(1.0), 125);
    }

    /// Codes and scales written in different chunkings agree with one pass over the
    /// groups: catches a stream position that is not the group's (the scale tensor would
    /// describe other groups than the codes).
    #[test]
    fn codes_and_scales_share_their_groups() {
        let table: Vec<f32> = (0..65536).map(|i| (i as f32 - 32768.0) / 8000.0).collect();
        let rng = ChaCha8Rng::seed_from_u64(7);
        let groups = 128;
        let mut codes = vec![0u8; groups * 16];
        fill_quantized(&rng, &table, 0.03, true, 0, &mut codes);
        let mut split = vec![0u8; groups * 16];
        fill_quantized(&rng, &table, 0.03, true, 0, &mut split[..1024]);
        fill_quantized(&rng, &table, 0.03, true, 1024, &mut split[1024..]);
        assert_eq!(codes, split);
        let mut scales = vec![0u8; groups];
        fill_quantized(&rng, &table, 0.03, false, 0, &mut scales);
        let mut r = rng.clone();
        for g in 0..groups {
            let (s, c) = quantize(&group_values(&mut r, &table, 0.03));
            assert_eq!(scales[g], s, "group {g}");
            assert_eq!(&codes[g * 16..g * 16 + 16], &c, "group {g}");
        }
    }

    #[test]
    fn entropy_of_a_histogram() {
        assert_eq!(bits(&[0, 0]), 0.0);
        assert!((bits(&[1, 1, 1, 1]) - 2.0).abs() < 1e-12);
    }
}
