//! The weight formats, described once (as ggml's `type_traits_cpu` table): for BF16, F32
//! and MXFP4 the bytes of a row and of a 32-column group, where group `q` of row `r`
//! lives, how a partial group is padded, how a group is decoded (into an instruction
//! set's registers through [`Ops`], or in plain Rust for the portable twin) and whether
//! every weight is exactly a bf16.
//!
//! [`FORMATS`] holds the numbers; [`Format`] is the same description as code, implemented
//! by one view per format ([`Bf16Rows`], [`F32Rows`], [`Mxfp4Rows`]). Every path reaches a
//! matrix's format through [`with_format`], the one `match` on [`MatData`] of the
//! product kernels, so each driver is written once and monomorphised per format;
//! [`rows`] is the row-block entry every instruction set's `rows_f32` shares.

use super::matmul::{Mat, MatData};
use super::mxfp4;
use super::ops::Ops;
use super::portable::{groups, lane_col, E8M0, GROUP_COLS, LANES};
use super::tuning::DriverTuning;

/// A weight encoding of [`Mat`]; indexes [`FORMATS`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FormatKind {
    /// Row-major bf16, widened exactly to f32 by a 16-bit shift.
    Bf16 = 0,
    /// Row-major f32.
    F32 = 1,
    /// compressed-tensors MXFP4: packed E2M1 nibbles plus one E8M0 scale byte per row
    /// and 32 columns (see [`super::mxfp4`]).
    Mxfp4 = 2,
}

/// What every path needs to know about a weight format.
#[derive(Clone, Copy, Debug)]
pub struct FormatInfo {
    /// Name for reports.
    pub name: &'static str,
    /// Bits per weight; a row of `cols` weights takes `(cols · bits).div_ceil(8)` bytes,
    /// rows back to back.
    pub bits: usize,
    /// Weight bytes of one full 32-column group of a row.
    pub group_bytes: usize,
    /// Scale bytes per 32-column group of a row, kept in their own array (0: none).
    pub scale_bytes: usize,
    /// Every weight is exactly a bf16, so a group can be staged (or multiplied) as bf16
    /// without rounding: BF16 itself, and MXFP4, whose weights `E2M1[code] · 2^(s−127)`
    /// have at most two mantissa bits and are zero or at least 2^-128 in magnitude (so
    /// their f32 bits end in 16 zero bits; `kernels_bitexact` checks every one).
    pub bf16_exact: bool,
}

impl FormatInfo {
    /// Weight bytes of one row of `cols` columns.
    pub const fn row_bytes(&self, cols: usize) -> usize {
        (cols * self.bits).div_ceil(8)
    }

    /// Scale bytes of one row of `cols` columns.
    pub const fn row_scale_bytes(&self, cols: usize) -> usize {
        groups(cols) * self.scale_bytes
    }
}

/// The format table, indexed by [`FormatKind`].
pub const FORMATS: [FormatInfo; 3] = [
    FormatInfo {
        name: "bf16",
        bits: 16,
        group_bytes: 64,
        scale_bytes: 0,
        bf16_exact: true,
    },
    FormatInfo {
        name: "f32",
        bits: 32,
        group_bytes: 128,
        scale_bytes: 0,
        bf16_exact: false,
    },
    FormatInfo {
        name: "mxfp4",
        bits: 4,
        group_bytes: 16,
        scale_bytes: 1,
        bf16_exact: true,
    },
];

impl FormatKind {
    /// This format's row of [`FORMATS`].
    pub const fn info(self) -> &'static FormatInfo {
        &FORMATS[self as usize]
    }
}

impl MatData<'_> {
    /// The format of these bytes.
    pub fn kind(&self) -> FormatKind {
        match self {
            MatData::Bf16(_) => FormatKind::Bf16,
            MatData::F32(_) => FormatKind::F32,
            MatData::Mxfp4 { .. } => FormatKind::Mxfp4,
        }
    }
}

/// A matrix's weights seen as groups of its format: the table's [`FormatInfo`] as code.
/// The views are small `Copy` values (pointers and strides) that the drivers pass by
/// value; every method is `#[inline(always)]`.
pub(crate) trait Format: Copy {
    /// The format's row of [`FORMATS`].
    const KIND: FormatKind;

    /// Start of group `q` of row `r` and its scale byte (127, i.e. ×1, for formats
    /// without scales).
    ///
    /// # Safety
    /// `r` and `q` must address a full group inside the matrix.
    unsafe fn at(&self, r: usize, q: usize) -> (*const u8, u8);

    /// The bytes of rows `r0..r1` (consecutive in memory): the weights, and the scales
    /// where the format has them (else an empty span). Addresses only, never read.
    fn spans(&self, r0: usize, r1: usize) -> [(*const u8, usize); 2];

    /// Group `q` of row `r`: its bytes (the valid prefix of a partial group) and scale
    /// byte. Bounds-checked: the portable twin's access.
    fn group_bytes(&self, r: usize, q: usize) -> (&[u8], u8);

    /// Decode one full group at `p` (scale byte `s`) into `I`'s registers.
    ///
    /// # Safety
    /// `p` points to the group's [`FormatInfo::group_bytes`] bytes; as [`Ops`].
    unsafe fn decode<I: Ops>(p: *const u8, s: u8) -> I::Lanes;

    /// Decode one full (or zero-padded) group's bytes into its 32 weights in lane order:
    /// the portable twin's decode.
    fn decode_portable(bytes: &[u8], s: u8, w: &mut [f32; LANES]);
}

/// Widen one bf16 (little-endian bytes) to f32 exactly.
#[inline(always)]
pub fn bf16_at(b: &[u8], i: usize) -> f32 {
    f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16)
}

/// Read one little-endian f32.
#[inline(always)]
pub fn f32_at(b: &[u8], i: usize) -> f32 {
    f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]])
}

/// BF16 rows.
#[derive(Clone, Copy)]
pub(crate) struct Bf16Rows<'a> {
    w: &'a [u8],
    cols: usize,
    /// Bytes per row.
    stride: usize,
}

impl Format for Bf16Rows<'_> {
    const KIND: FormatKind = FormatKind::Bf16;
    #[inline(always)]
    unsafe fn at(&self, r: usize, q: usize) -> (*const u8, u8) {
        // SAFETY: the caller guarantees (r, q) is a full group of this matrix.
        (
            unsafe { self.w.as_ptr().add(r * self.stride + 64 * q) },
            127,
        )
    }
    #[inline(always)]
    fn spans(&self, r0: usize, r1: usize) -> [(*const u8, usize); 2] {
        let p = self.w.as_ptr().wrapping_add(r0 * self.stride);
        [(p, (r1 - r0) * self.stride), (p, 0)]
    }
    #[inline(always)]
    fn group_bytes(&self, r: usize, q: usize) -> (&[u8], u8) {
        let (c0, c1) = group_cols(self.cols, q);
        (
            &self.w[2 * (r * self.cols + c0)..2 * (r * self.cols + c1)],
            127,
        )
    }
    #[inline(always)]
    unsafe fn decode<I: Ops>(p: *const u8, _s: u8) -> I::Lanes {
        // SAFETY: forwarded (64 bytes at p).
        unsafe { I::bf16(p) }
    }
    #[inline(always)]
    fn decode_portable(bytes: &[u8], _s: u8, w: &mut [f32; LANES]) {
        for (l, o) in w.iter_mut().enumerate() {
            *o = bf16_at(bytes, lane_col(l));
        }
    }
}

/// F32 rows.
#[derive(Clone, Copy)]
pub(crate) struct F32Rows<'a> {
    w: &'a [u8],
    cols: usize,
    /// Bytes per row.
    stride: usize,
}

impl Format for F32Rows<'_> {
    const KIND: FormatKind = FormatKind::F32;
    #[inline(always)]
    unsafe fn at(&self, r: usize, q: usize) -> (*const u8, u8) {
        // SAFETY: the caller guarantees (r, q) is a full group of this matrix.
        (
            unsafe { self.w.as_ptr().add(r * self.stride + 128 * q) },
            127,
        )
    }
    #[inline(always)]
    fn spans(&self, r0: usize, r1: usize) -> [(*const u8, usize); 2] {
        let p = self.w.as_ptr().wrapping_add(r0 * self.stride);
        [(p, (r1 - r0) * self.stride), (p, 0)]
    }
    #[inline(always)]
    fn group_bytes(&self, r: usize, q: usize) -> (&[u8], u8) {
        let (c0, c1) = group_cols(self.cols, q);
        (
            &self.w[4 * (r * self.cols + c0)..4 * (r * self.cols + c1)],
            127,
        )
    }
    #[inline(always)]
    unsafe fn decode<I: Ops>(p: *const u8, _s: u8) -> I::Lanes {
        // SAFETY: forwarded (128 bytes at p).
        unsafe { I::f32(p) }
    }
    #[inline(always)]
    fn decode_portable(bytes: &[u8], _s: u8, w: &mut [f32; LANES]) {
        for (l, o) in w.iter_mut().enumerate() {
            *o = f32_at(bytes, lane_col(l));
        }
    }
}

/// MXFP4 rows: packed nibbles and E8M0 scale bytes, each array row-major.
#[derive(Clone, Copy)]
pub(crate) struct Mxfp4Rows<'a> {
    packed: &'a [u8],
    scales: &'a [u8],
    cols: usize,
    /// Packed bytes per row.
    pstride: usize,
    /// Scale bytes per row.
    sstride: usize,
}

impl Format for Mxfp4Rows<'_> {
    const KIND: FormatKind = FormatKind::Mxfp4;
    #[inline(always)]
    unsafe fn at(&self, r: usize, q: usize) -> (*const u8, u8) {
        // SAFETY: the caller guarantees (r, q) is a full group: 16 packed bytes and a
        // scale byte exist there.
        unsafe {
            (
                self.packed.as_ptr().add(r * self.pstride + 16 * q),
                *self.scales.as_ptr().add(r * self.sstride + q),
            )
        }
    }
    #[inline(always)]
    fn spans(&self, r0: usize, r1: usize) -> [(*const u8, usize); 2] {
        [
            (
                self.packed.as_ptr().wrapping_add(r0 * self.pstride),
                (r1 - r0) * self.pstride,
            ),
            (
                self.scales.as_ptr().wrapping_add(r0 * self.sstride),
                (r1 - r0) * self.sstride,
            ),
        ]
    }
    #[inline(always)]
    fn group_bytes(&self, r: usize, q: usize) -> (&[u8], u8) {
        let (c0, c1) = group_cols(self.cols, q);
        let base = r * self.pstride;
        (
            &self.packed[base + c0 / 2..base + c1.div_ceil(2)],
            self.scales[r * self.sstride + q],
        )
    }
    #[inline(always)]
    unsafe fn decode<I: Ops>(p: *const u8, s: u8) -> I::Lanes {
        // SAFETY: forwarded (16 bytes at p).
        unsafe { I::mxfp4(p, s) }
    }
    #[inline(always)]
    fn decode_portable(bytes: &[u8], s: u8, w: &mut [f32; LANES]) {
        let sc = E8M0[s as usize];
        for i in 0..16 {
            w[i] = mxfp4::E2M1[(bytes[i] & 0x0F) as usize] * sc;
            w[16 + i] = mxfp4::E2M1[(bytes[i] >> 4) as usize] * sc;
        }
    }
}

/// Columns `c0..c1` of group `q` in a row of `cols` (fewer than 32 in a partial group).
#[inline(always)]
fn group_cols(cols: usize, q: usize) -> (usize, usize) {
    let c0 = q * GROUP_COLS;
    (c0, (c0 + GROUP_COLS).min(cols))
}

/// A computation over a matrix's format, run by [`with_format`] with that format's view.
pub(crate) trait FormatFn {
    /// The result.
    type Out;
    /// Run on `f`, the view of `m`'s weights.
    fn call<F: Format>(self, f: F, m: &Mat<'_>) -> Self::Out;
}

/// Run `v` on `m`'s format view: the product kernels' one `match` on the format.
#[inline(always)]
pub(crate) fn with_format<V: FormatFn>(m: &Mat<'_>, v: V) -> V::Out {
    let c = m.cols;
    match m.data {
        MatData::Bf16(w) => v.call(
            Bf16Rows {
                w,
                cols: c,
                stride: FormatKind::Bf16.info().row_bytes(c),
            },
            m,
        ),
        MatData::F32(w) => v.call(
            F32Rows {
                w,
                cols: c,
                stride: FormatKind::F32.info().row_bytes(c),
            },
            m,
        ),
        MatData::Mxfp4 { packed, scales } => v.call(
            Mxfp4Rows {
                packed,
                scales,
                cols: c,
                pstride: FormatKind::Mxfp4.info().row_bytes(c),
                sstride: FormatKind::Mxfp4.info().row_scale_bytes(c),
            },
            m,
        ),
    }
}

/// Copy a partial group (fewer than 32 columns) into a zeroed 128-byte buffer, as if the
/// row were padded with zero weights; returns its scale byte. A sub-byte format with an
/// odd column count has the unused high nibble of the last byte cleared. Every path
/// decodes the padded group the same way. Kept out of line: the drivers call it once per
/// row tile, never in a loop over groups.
#[inline(never)]
pub fn stage_partial(m: &Mat<'_>, r: usize, q: usize, buf: &mut [u8; 128]) -> u8 {
    struct Stage<'b> {
        r: usize,
        q: usize,
        buf: &'b mut [u8; 128],
    }
    impl FormatFn for Stage<'_> {
        type Out = u8;
        fn call<F: Format>(self, f: F, m: &Mat<'_>) -> u8 {
            let (bytes, s) = f.group_bytes(self.r, self.q);
            *self.buf = [0u8; 128];
            self.buf[..bytes.len()].copy_from_slice(bytes);
            let valid = m.cols - self.q * GROUP_COLS;
            if F::KIND.info().bits == 4 && valid % 2 == 1 {
                self.buf[valid / 2] &= 0x0F;
            }
            s
        }
    }
    with_format(m, Stage { r, q, buf })
}

/// An instruction set's row-block driver: its register-tile shapes over [`Ops`].
pub(crate) trait Driver {
    /// Sums of rows `r0..r1` × `ntok` permuted tokens (f32-block contract) into
    /// `out[(r - r0) * ntok + t]`.
    ///
    /// # Safety
    /// `f` is `m`'s view; the CPU supports the instruction set and the caller is its
    /// `#[target_feature]` entry point.
    unsafe fn drive<F: Format>(
        f: F,
        m: &Mat<'_>,
        rows: (usize, usize),
        xp: &[f32],
        ntok: usize,
        out: &mut [f64],
        tuning: &DriverTuning,
    );
}

/// Rows `r0..r1` × `ntok` permuted tokens on driver `D`, for `m`'s format: the body of
/// every instruction set's `rows_f32` entry point.
///
/// # Safety
/// As [`Driver::drive`].
#[inline(always)]
pub(crate) unsafe fn rows<D: Driver>(
    m: &Mat<'_>,
    rows: (usize, usize),
    xp: &[f32],
    ntok: usize,
    out: &mut [f64],
    tuning: &DriverTuning,
) {
    struct Rows<'x, D> {
        rows: (usize, usize),
        xp: &'x [f32],
        ntok: usize,
        out: &'x mut [f64],
        tuning: &'x DriverTuning,
        driver: std::marker::PhantomData<D>,
    }
    impl<D: Driver> FormatFn for Rows<'_, D> {
        type Out = ();
        #[inline(always)]
        fn call<F: Format>(self, f: F, m: &Mat<'_>) {
            // SAFETY: `f` is m's view (with_format); the instruction set's guarantees are
            // the caller's (`rows` is unsafe with the same contract).
            unsafe { D::drive(f, m, self.rows, self.xp, self.ntok, self.out, self.tuning) }
        }
    }
    let v = Rows::<D> {
        rows,
        xp,
        ntok,
        out,
        tuning,
        driver: std::marker::PhantomData,
    };
    with_format(m, v)
}
