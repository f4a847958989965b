//! MXFP4's scale bytes (`src/kernels/mxfp4.rs`).

use k3_layer_compute::kernels::mxfp4::*;

// Catches: E8M0 decoded as 2^(s-128), and a subnormal mishandled at s = 0.
#[test]
fn e8m0_is_exact_power_of_two() {
    for s in 0u8..255 {
        assert_eq!(e8m0(s) as f64, 2f64.powi(s as i32 - 127), "s={s}");
    }
    assert_eq!(e8m0(255), 0.0);
}
