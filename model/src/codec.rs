//! The lossless trunk codec (`pack-trunk --codec bf16-zstd`): byte grouping of BF16 words
//! into an exponent plane and a sign+mantissa plane, then zstd (whose Huffman-coded
//! literals do the work: trained or Gaussian BF16 exponents carry about 2.6 bits of
//! information in 8) on the exponent plane; the sign+mantissa plane is stored as it is
//! (7 random mantissa bits and a random sign do not compress).
//!
//! One encoded chunk is self-describing but for its decoded length (the manifest keeps
//! it): `[exp_len: u32 LE][zstd frame of the exponent plane: exp_len bytes][sign+mantissa
//! plane: len/2 bytes][the last byte when len is odd]`. Word `i` (little endian `w`) puts
//! `(w >> 7) & 0xff` in the exponent plane and `(w >> 8) & 0x80 | w & 0x7f` in the other,
//! so any bytes round-trip (F32 tensors, NaN and Inf patterns, odd lengths): the codec is
//! a function of bytes, not of values.
//!
//! [`decode`] never writes outside the `out` slice it is given and checks every length
//! before it touches it: a corrupted chunk is an error, never a panic or an overrun.
//!
//! ```
//! use k3_model::codec::{decode, encode, Codec};
//! let raw: Vec<u8> = (0..1000u32).flat_map(|i| ((i % 7) as u16 + 0x3c00).to_le_bytes()).collect();
//! let enc = encode(Codec::Bf16Zstd, &raw).unwrap();
//! let mut out = vec![0u8; raw.len()];
//! decode(Codec::Bf16Zstd, &enc, &mut out).unwrap();
//! assert_eq!(out, raw);
//! ```

use std::cell::RefCell;

/// A codec a packed trunk can be stored with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    /// Exponent plane through zstd, sign+mantissa plane raw.
    Bf16Zstd,
}

/// How hard the encoder searches the exponent plane for matches (the decoder does not
/// care: every effort writes a plain zstd frame). Measured on Gaussian BF16 with
/// `benches/codec.rs` (docs/measurements.md): zstd level 19's optimal parser stores almost
/// only Huffman-coded literals, which gives both the best ratio (0.662 of raw, at 2.54 bits
/// of exponent entropy) and the fastest decoding (no match copies), but encodes at 5-7
/// MB/s; level 1 encodes ~60x faster at 0.680 and decodes slower; [`Effort::Literals`]
/// stores as little and decodes as fast as level 19, and encodes faster than level 1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effort {
    /// Literals, found fast (the default): zstd's `fast` strategy with a 64-entry hash
    /// table and 7-byte minimum matches, so that a match is almost never found and almost
    /// every exponent is a Huffman-coded literal, as level 19's parser decides after a long
    /// search. On Gaussian BF16 (`benches/codec.rs`, 2026-12-05, quiet Zen 5): 0.6623 of raw
    /// against level 19's 0.6621, decoding at 4.9-5.0 GB/s against 5.2, encoding at 910
    /// MB/s against 6-7. A smaller window (2^12) made its blocks smaller and decoded at 3.4
    /// GB/s; 6-byte matches or a 256-entry table found matches that slowed the decoder.
    Literals,
    /// zstd's own level (1..=22).
    Level(i32),
}

/// The effort `pack-trunk --codec` uses without `--level`.
pub const DEFAULT_EFFORT: Effort = Effort::Literals;

impl std::fmt::Display for Effort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Effort::Literals => write!(f, "zstd fast literals: min match 7, hash log 6"),
            Effort::Level(l) => write!(f, "zstd level {l}"),
        }
    }
}

/// Bytes of the chunk header (`exp_len`).
const HEADER: usize = 4;

impl Codec {
    /// The name the manifest records and `--codec` takes.
    pub fn name(self) -> &'static str {
        match self {
            Codec::Bf16Zstd => "bf16-zstd",
        }
    }

    /// The codec called `name`, if this build has it.
    pub fn from_name(name: &str) -> Option<Codec> {
        match name {
            "bf16-zstd" => Some(Codec::Bf16Zstd),
            _ => None,
        }
    }

    /// Every codec this build has, by name.
    pub const NAMES: &'static [&'static str] = &["bf16-zstd"];
}

/// A chunk that does not decode.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    #[error("{got} stored bytes, shorter than the {HEADER}-byte chunk header")]
    NoHeader { got: usize },
    #[error("the chunk's planes take {want} bytes, it has {got}")]
    Length { want: u64, got: usize },
    #[error("the exponent plane does not decode: {0}")]
    Entropy(String),
    #[error("the exponent plane decodes to {got} bytes, the chunk needs {want}")]
    Plane { got: usize, want: usize },
    #[error("the exponent plane does not encode: {0}")]
    Encode(String),
}

/// Split `raw` into its planes: exponents and sign+mantissa, one byte per word each (an
/// odd last byte is in neither).
pub fn split(raw: &[u8], exp: &mut Vec<u8>, sm: &mut Vec<u8>) {
    let n = raw.len() / 2;
    exp.clear();
    sm.clear();
    exp.reserve(n);
    sm.reserve(n);
    for w in raw.chunks_exact(2) {
        let v = u16::from_le_bytes([w[0], w[1]]);
        exp.push((v >> 7) as u8);
        sm.push(((v >> 8) as u8 & 0x80) | (v as u8 & 0x7f));
    }
}

/// Interleave the planes back into words: `out.len() == 2 * exp.len() == 2 * sm.len()`.
pub fn join(exp: &[u8], sm: &[u8], out: &mut [u8]) {
    for ((o, &e), &s) in out.chunks_exact_mut(2).zip(exp).zip(sm) {
        let v = ((s as u16 & 0x80) << 8) | ((e as u16) << 7) | (s as u16 & 0x7f);
        o.copy_from_slice(&v.to_le_bytes());
    }
}

/// Encode one chunk with the default effort ([`DEFAULT_EFFORT`]).
pub fn encode(codec: Codec, raw: &[u8]) -> Result<Vec<u8>, CodecError> {
    encode_with(codec, raw, DEFAULT_EFFORT)
}

/// Encode one chunk with the entropy coder at zstd `level` (1..=22; the decoder does not
/// care).
pub fn encode_level(codec: Codec, raw: &[u8], level: i32) -> Result<Vec<u8>, CodecError> {
    encode_with(codec, raw, Effort::Level(level))
}

/// The exponent plane as one zstd frame, searched with `effort`.
fn compress_plane(exp: &[u8], effort: Effort) -> Result<Vec<u8>, CodecError> {
    use zstd::zstd_safe::{CParameter, Strategy};
    let err = |e: std::io::Error| CodecError::Encode(e.to_string());
    match effort {
        Effort::Level(level) => zstd::bulk::compress(exp, level).map_err(err),
        Effort::Literals => {
            let mut c = zstd::bulk::Compressor::new(1).map_err(err)?;
            for p in [
                CParameter::Strategy(Strategy::ZSTD_fast),
                CParameter::MinMatch(7),
                CParameter::HashLog(6),
                CParameter::WindowLog(17),
            ] {
                c.set_parameter(p).map_err(err)?;
            }
            c.compress(exp).map_err(err)
        }
    }
}

/// Encode one chunk, the exponent plane searched with `effort`.
pub fn encode_with(codec: Codec, raw: &[u8], effort: Effort) -> Result<Vec<u8>, CodecError> {
    match codec {
        Codec::Bf16Zstd => {
            let (mut exp, mut sm) = (Vec::new(), Vec::new());
            split(raw, &mut exp, &mut sm);
            let z = compress_plane(&exp, effort)?;
            let zl = u32::try_from(z.len()).map_err(|e| CodecError::Encode(e.to_string()))?;
            let mut out = Vec::with_capacity(HEADER + z.len() + sm.len() + 1);
            out.extend_from_slice(&zl.to_le_bytes());
            out.extend_from_slice(&z);
            out.extend_from_slice(&sm);
            if raw.len() % 2 == 1 {
                out.push(raw[raw.len() - 1]);
            }
            Ok(out)
        }
    }
}

/// A decoder's reusable state: one zstd decompression context and the exponent plane's
/// buffer. Creating a context allocates (and zstd sizes its tables on first use), so a
/// caller that decodes many chunks keeps one per thread and reuses it from chunk to chunk
/// and layer to layer ([`crate::codec_trunk::CodedReader`] pools them across its reader
/// threads); [`decode`] uses one per calling thread.
#[derive(Default)]
pub struct Decoder {
    /// Created on the first decode (so that `new` cannot fail).
    dctx: Option<zstd::bulk::Decompressor<'static>>,
    exp: Vec<u8>,
}

impl Decoder {
    /// A decoder with no context yet.
    pub fn new() -> Decoder {
        Decoder::default()
    }

    /// Whether a zstd context has been created (by a decode).
    pub fn has_context(&self) -> bool {
        self.dctx.is_some()
    }

    /// Decode one chunk into `out` (exactly its decoded length). Writes only inside `out`.
    pub fn decode(
        &mut self,
        codec: Codec,
        stored: &[u8],
        out: &mut [u8],
    ) -> Result<(), CodecError> {
        match codec {
            Codec::Bf16Zstd => self.decode_split(stored, out),
        }
    }

    fn decode_split(&mut self, stored: &[u8], out: &mut [u8]) -> Result<(), CodecError> {
        let head: [u8; HEADER] = stored
            .get(..HEADER)
            .and_then(|h| h.try_into().ok())
            .ok_or(CodecError::NoHeader { got: stored.len() })?;
        let zl = u32::from_le_bytes(head) as u64;
        let n = out.len() / 2;
        let odd = out.len() % 2;
        let want = HEADER as u64 + zl + n as u64 + odd as u64;
        if want != stored.len() as u64 {
            return Err(CodecError::Length {
                want,
                got: stored.len(),
            });
        }
        let zl = zl as usize;
        let z = &stored[HEADER..HEADER + zl];
        let sm = &stored[HEADER + zl..HEADER + zl + n];
        if self.dctx.is_none() {
            let d =
                zstd::bulk::Decompressor::new().map_err(|e| CodecError::Entropy(e.to_string()))?;
            self.dctx = Some(d);
        }
        let (Some(dctx), exp) = (self.dctx.as_mut(), &mut self.exp) else {
            return Err(CodecError::Entropy("no decompression context".into()));
        };
        exp.clear();
        exp.reserve(n);
        // zstd writes only inside `exp`'s own allocation (its capacity, at least `n`: more
        // when the buffer served a larger chunk before); a frame that decodes to any other
        // length than `n` fails the check below, and `out` is written only after it.
        let got = dctx
            .decompress_to_buffer(z, exp)
            .map_err(|e| CodecError::Entropy(e.to_string()))?;
        if got != n {
            return Err(CodecError::Plane { got, want: n });
        }
        join(exp, sm, &mut out[..2 * n]);
        if odd == 1 {
            out[2 * n] = stored[stored.len() - 1];
        }
        Ok(())
    }
}

thread_local! {
    /// The calling thread's [`Decoder`] for [`decode`].
    static SCRATCH: RefCell<Decoder> = RefCell::new(Decoder::new());
}

/// Decode one chunk into `out` (exactly its decoded length) with the calling thread's
/// [`Decoder`]. Writes only inside `out`.
pub fn decode(codec: Codec, stored: &[u8], out: &mut [u8]) -> Result<(), CodecError> {
    SCRATCH.with(|d| d.borrow_mut().decode(codec, stored, out))
}

/// Shannon entropy in bits per byte of `bytes`' histogram (what an ideal order-0 coder
/// would spend).
pub fn byte_entropy(bytes: &[u8]) -> f64 {
    let mut h = [0u64; 256];
    for &b in bytes {
        h[b as usize] += 1;
    }
    let n = bytes.len() as f64;
    h.iter()
        .filter(|&&c| c > 0)
        .map(|&c| {
            let p = c as f64 / n;
            -p * p.log2()
        })
        .sum()
}
