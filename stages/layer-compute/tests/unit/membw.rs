//! The read probe (`src/membw.rs`): every path reads every byte once.

use k3_layer_compute::kernels::simd;
use k3_layer_compute::membw::*;

// Catches: a vector path that skips the bytes after the last whole tile, or reads a
// row twice or not at all (each path is compared with the sum's definition, computed
// here by a plain loop over the words).
#[test]
fn every_byte_is_read_once() {
    let buf: Vec<u8> = (0..3 * ROW * 4 + 777).map(|i| (i * 7 + 3) as u8).collect();
    for k in [1, 4, 8] {
        for len in [0, 1, 127, 128, 4 * ROW, buf.len()] {
            let c = &buf[..len];
            // The definition: the wrapping sum of the little-endian u64 words of the
            // whole 128-byte blocks, plus the bytes after them (a tile is 112 such
            // blocks, so the vector path's tail starts on a block boundary).
            let words = len / 128 * 128;
            let want = c[..words]
                .chunks_exact(8)
                .fold(0u64, |a, w| {
                    a.wrapping_add(u64::from_le_bytes(w.try_into().unwrap()))
                })
                .wrapping_add(c[words..].iter().map(|&b| b as u64).sum::<u64>());
            assert_eq!(sum_streams(c, k), want, "k {k} len {len}");
            assert_eq!(sum_portable(c), want, "portable len {len}");
            #[cfg(target_arch = "x86_64")]
            if simd::avx2_available() {
                // SAFETY: AVX2 detected.
                assert_eq!(
                    unsafe { sum_streams_256(c, k) },
                    want,
                    "avx2 k {k} len {len}"
                );
            }
        }
    }
}
