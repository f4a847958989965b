//! KDA short causal depthwise convolution with SiLU fused, carrying its state.
//!
//! Per channel c, tap `j` of `w[c, 0, j]` (j = 0..W−1) multiplies the input `W−1−j` steps
//! back, so tap W−1 is the current token. The state holds the last `W−1` PRE-conv inputs of
//! each channel, oldest first (`state[c·(W−1) + j]`); it is zero at sequence start. Width
//! 1 has no history and no state (the guard is on the history length).

/// Run `ntok` tokens (`x` is `ntok × channels`, token-major) through the conv, writing
/// `y` (same shape) and updating `state` (`channels × (width−1)`). Token by token: the
/// taps' f64 sums of every channel, then one SiLU pass over them
/// ([`super::act::silu_into`], at the CPU's vector width).
pub fn shortconv_silu(
    x: &[f32],
    w: &[f32],
    width: usize,
    channels: usize,
    state: &mut [f32],
    y: &mut [f32],
) {
    assert!(width >= 1, "conv width must be at least 1");
    let hist = width - 1;
    let ntok = x.len() / channels;
    assert_eq!(x.len(), ntok * channels);
    assert_eq!(y.len(), x.len());
    assert_eq!(w.len(), channels * width);
    assert_eq!(state.len(), channels * hist);
    // One token at a time: every channel's f64 tap sum, then the token's SiLU pass.
    let mut z = vec![0f64; channels];
    for t in 0..ntok {
        let xt = &x[t * channels..(t + 1) * channels];
        for (c, (zc, &cur)) in z.iter_mut().zip(xt).enumerate() {
            let wc = &w[c * width..(c + 1) * width];
            let st = &mut state[c * hist..(c + 1) * hist];
            // Taps oldest to newest, then the current token.
            let mut acc = 0f64;
            for j in 0..hist {
                acc += wc[j] as f64 * st[j] as f64;
            }
            acc += wc[hist] as f64 * cur as f64;
            if hist > 0 {
                st.copy_within(1.., 0);
                st[hist - 1] = cur;
            }
            *zc = acc;
        }
        super::act::silu_into(&z, &mut y[t * channels..(t + 1) * channels]);
    }
}
